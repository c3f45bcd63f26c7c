"""The demo: its data pipeline pieces, and `python -m dataecho demo --quick` end to end."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("PIL", reason="the demo extra (pillow) is not installed")
pytest.importorskip("mlxtend", reason="the demo extra (mlxtend) is not installed")

from dataecho.demo import digits  # noqa: E402
from dataecho.demo.cache import npy_bytes  # noqa: E402


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("png-cache")
    files, labels = digits.write_pngs(path)
    return path, files, labels


def test_pngs_round_trip_the_shipped_digits(cache):
    path, files, labels = cache
    assert len(files) == 5000 and np.bincount(labels).tolist() == [500] * 10
    image = digits.decode(files[1234])
    assert image.shape == (28, 28) and image.dtype == np.uint8 and image.max() > 100
    again, _ = digits.write_pngs(path)  # cached: nothing rewritten
    assert again == files


@pytest.mark.parametrize("damage", ["empty", "cut-short", "not-labels"])
def test_a_cache_that_is_not_whole_is_written_again(cache, tmp_path, damage):
    # What an interrupted first run, or two runs at once, left before the cache
    # was written atomically; every PNG is there, so only the labels can tell.
    path, files, labels = cache
    damaged = tmp_path / "cache"
    shutil.copytree(path, damaged)
    whole = (path / "labels.npy").read_bytes()
    planted = {"empty": b"", "cut-short": whole[: len(whole) // 2], "not-labels": npy_bytes(np.zeros((2, 3)))}
    (damaged / "labels.npy").write_bytes(planted[damage])
    again, relabeled = digits.write_pngs(damaged)
    assert np.array_equal(relabeled, labels) and [f.name for f in again] == [f.name for f in files]
    assert (damaged / "labels.npy").read_bytes() == whole, "the labels are written again, whole"
    assert np.array_equal(digits.decode(again[1234]), digits.decode(files[1234]))
    assert not list(damaged.glob(".*.tmp")), "no temporary file is left behind"


def test_split_is_balanced_and_disjoint(cache):
    _, _, labels = cache
    train, val = digits.split(labels, validation=1000, seed=3)
    assert len(val) == 1000 and len(train) == 4000 and not set(train) & set(val)
    assert np.bincount(labels[val]).tolist() == [100] * 10


def test_augment_shifts_and_adds_noise(cache):
    _, files, labels = cache
    example = {"image": digits.decode(files[0]), "label": int(labels[0])}
    augment = digits.Augment(seed=0)
    a, b = augment(example), augment(example)
    assert a["image"].shape == (1, 28, 28) and a["image"].dtype == np.float32
    assert not np.array_equal(a["image"], b["image"]), "every call draws a new shift and noise"
    clean = digits.to_float(example)["image"]
    assert abs(float(a["image"].mean()) - float(clean.mean())) < 0.05


def test_demo_quick_end_to_end(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "dataecho", "demo", "--quick", "--out", str(out), "--cache", str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=110,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("no echoing (baseline)", "example echo before augment, e=4", "batch echo, e=2", '"auto"'):
        assert name in result.stdout
    assert "time to target" in result.stdout and "speed-up" in result.stdout
    plot = out / "dataecho-demo.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert len(runs) == 6 and all(run["history"] for run in runs)
    assert str(plot.resolve()) in result.stdout


def test_cli_usage():
    result = subprocess.run([sys.executable, "-m", "dataecho"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "python -m dataecho demo" in result.stdout
    result = subprocess.run([sys.executable, "-m", "dataecho", "train"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "unknown command" in result.stderr
