"""The demo's text task: its corpus, tokenizer and model, and
`python -m dataecho demo --task text --quick` end to end."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dataecho.demo import report, text
from dataecho.demo.train import Config, Run


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return text.write_corpus(tmp_path_factory.mktemp("text-cache"))


def test_corpus_is_stdlib_docstrings_of_bounded_length(corpus):
    lengths = corpus.lengths
    assert len(corpus) > 5000 and lengths.sum() > 1_000_000
    assert lengths.min() >= text.MIN_TOKENS and lengths.max() <= text.MAX_TOKENS
    assert np.percentile(lengths, 10) < 64 < 256 < np.percentile(lengths, 90), "lengths vary"
    examples = [corpus.read(i).decode("utf-8") for i in range(len(corpus))]
    assert len(set(examples)) == len(examples), "repeated docstrings are kept once"
    assert any(">>> " in e for e in examples) and sum("Return" in e for e in examples) > 500


def test_corpus_is_cached_and_rebuilt_identically(corpus, tmp_path):
    again = text.write_corpus(corpus.path.parent)  # from the cache
    assert np.array_equal(again.offsets, corpus.offsets) and again.path == corpus.path
    rebuilt = text.write_corpus(tmp_path / "fresh")  # from the standard library again
    assert np.array_equal(rebuilt.offsets, corpus.offsets)
    assert rebuilt.path.read_bytes() == corpus.path.read_bytes()


@pytest.mark.parametrize("name", ["index.npz", "examples.txt"])
def test_a_corpus_cache_that_is_not_whole_is_built_again(corpus, tmp_path, name):
    cache = tmp_path / "cache"
    shutil.copytree(corpus.path.parent, cache)
    whole = (cache / name).read_bytes()
    (cache / name).write_bytes(whole[: len(whole) // 2])  # what a run cut short would leave
    again = text.write_corpus(cache)
    assert np.array_equal(again.offsets, corpus.offsets) and np.array_equal(again.modules, corpus.modules)
    assert (cache / name).read_bytes() == whole, "built again, whole"


def test_split_holds_out_whole_modules(corpus):
    train, val = text.split(corpus, validation=0.05, seed=1)
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(len(corpus)))
    assert 0.04 * len(corpus) <= len(val) <= 0.1 * len(corpus)
    assert not set(corpus.modules[train]) & set(corpus.modules[val])
    again, _ = text.split(corpus, validation=0.05, seed=1)
    other, _ = text.split(corpus, validation=0.05, seed=2)
    assert np.array_equal(train, again) and not np.array_equal(train, other)


def test_prose_is_reflowed_and_code_kept_by_line():
    doc = "Sum two\nnumbers,   quickly.\n\n>>> add(1, 2)\n3\n\n    indented\n      more"
    assert text.paragraphs(doc) == ["Sum two numbers, quickly.", ">>> add(1, 2)\n3", "indented\n  more"]
    long = " ".join(f"word{i}" for i in range(300))  # about 2,400 bytes, one paragraph
    pieces = list(text.examples(long))
    assert len(pieces) >= 5 and all(len(p.encode()) <= text.MAX_TOKENS for p in pieces)
    assert " ".join(pieces) == long, "cut at spaces, nothing lost"


def test_tokens_are_utf8_bytes():
    tokens = text.tokenize({"text": "naïve ≥ 2"})["tokens"]
    assert tokens.dtype == np.uint8 and len(tokens) == len("naïve ≥ 2".encode())
    assert text.decode(tokens) == "naïve ≥ 2"


def test_crop_is_a_random_window_of_most_of_the_tokens():
    example = {"text": "".join(chr(ord("a") + i % 26) for i in range(400))}
    whole = text.encode(example["text"]).tobytes()
    rng = np.random.default_rng(0)
    crops = [text.tokenize_and_crop(example, rng)["tokens"] for _ in range(20)]
    assert all(300 <= len(c) <= 400 and c.tobytes() in whole for c in crops)
    assert len({c.tobytes() for c in crops}) > 15, "repeats of an example differ"
    again = text.tokenize_and_crop(example, np.random.default_rng(0))["tokens"]
    assert np.array_equal(again, crops[0]), "the draws depend on the generator alone"
    short = {"text": "x" * text.MIN_TOKENS}
    assert len(text.tokenize_and_crop(short, rng)["tokens"]) == text.MIN_TOKENS


def test_stored_text_counts_the_tokens_it_reads(corpus):
    dataset = text.StoredText(corpus, np.array([3, 7]), latency_s=0.0)
    assert len(dataset) == 2 and dataset[1]["text"] == corpus.read(7).decode()
    dataset[0]
    assert dataset.tokens_read == corpus.lengths[7] + corpus.lengths[3]


def test_packed_sequences_do_not_see_each_other():
    torch = pytest.importorskip("torch")
    from dataecho.demo import lm

    torch.manual_seed(0)
    model = lm.make_lm(torch, width=16, layers=2, heads=2)
    rows = [np.frombuffer(b, np.uint8).copy() for b in (b"first sequence", b"the second, longer one")]
    values, offsets = (torch.from_numpy(a) for a in lm.pack(rows))
    with torch.no_grad():
        packed = model(values, offsets)
        alone = [model(torch.from_numpy(r), torch.tensor([0, len(r)])) for r in rows]
        loss = lm.lm_loss(torch, model, values, offsets, reduction="sum")
        separate = sum(lm.lm_loss(torch, model, torch.from_numpy(r), torch.tensor([0, len(r)]), reduction="sum")
                       for r in rows)
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)
    assert torch.allclose(loss, separate, atol=1e-4), "each sequence's last token predicts nothing"


def test_loader_delivers_tokens_on_the_ragged_path(corpus):
    torch = pytest.importorskip("torch")
    from dataecho.demo import lm

    dataset = text.StoredText(corpus, np.arange(200), latency_s=0.0)
    for config in (lm.CONFIGS[0], lm.CONFIGS[3]):  # tokenized before the echo stage, and after it
        loader = lm.make_loader(config, dataset, batch_size=8, workers=2, seed=0, shuffle_buffer=32)
        try:
            tokens = next(iter(loader))["tokens"]
        finally:
            loader.close()
        assert tokens.is_nested and tokens.values().dtype == torch.uint8
        offsets = tokens.offsets()
        assert len(offsets) == 9 and int(offsets[0]) == 0 and int(offsets[-1]) == len(tokens.values())
        lengths = (offsets[1:] - offsets[:-1]).tolist()
        assert all(text.MIN_TOKENS <= n <= text.MAX_TOKENS for n in lengths) and len(set(lengths)) > 1


def test_loss_table_reads_lower_is_better_and_image_table_is_unchanged():
    base, echo = Run(Config("base", 1.0, "after")), Run(Config("echo", 2.0, "after"))
    base.history = [(5.0, 90_000, 20, 2.9), (10.0, 180_000, 40, 2.4)]
    echo.history = [(3.0, 50_000, 20, 2.9), (5.0, 80_000, 40, 2.45)]
    base.reached, echo.reached = base.history[-1], echo.history[-1]
    table = report.table([base, echo], 2.5, report.LOSS)
    assert table.startswith("target: validation loss 2.50 nats/token, lower is better (mean of the last 3 "
                            "evaluations, every 25 steps)")
    assert "fresh tokens" in table and "final val loss" in table and "2.00x" in table and "80,000" in table
    image = report.table([base], 0.96)
    assert image.startswith("target: validation accuracy 0.96 (mean of the last 3 evaluations, every 10 steps); "
                            "speed-up = baseline time / time (higher is better)\n")
    assert "fresh examples" in image and "final val acc" in image


def _fresh_at(run: dict, step: int) -> int:
    return next(row[1] for row in run["history"] if row[2] == step)


@pytest.mark.timeout(300)  # about a minute on 2 idle cores; room for a loaded machine
def test_text_demo_quick_end_to_end(corpus, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    from dataecho.demo import lm

    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "dataecho", "demo", "--task", "text", "--quick", "--out", str(out),
         "--cache", str(corpus.path.parent)],
        capture_output=True, text=True, timeout=280,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "time to target" in result.stdout and "fresh tokens" in result.stdout and "final val loss" in result.stdout
    for config in lm.CONFIGS:
        assert config.name in result.stdout
    plot = out / "dataecho-demo-text.png"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(plot.resolve()) in result.stdout
    results = json.loads((out / "results.json").read_text())
    runs = {run["config"]: run for run in results["runs"]}
    assert results["task"] == "text" and list(runs) == [c.name for c in lm.CONFIGS]
    assert all(run["history"] for run in runs.values()), "every configuration trained and was evaluated"
    for run in runs.values():
        losses = [row[3] for row in run["history"]]
        assert losses[-1] < 4.0 and losses[-1] < losses[0] + 0.05, f"{run['config']} learned: {losses}"
    # At equal progress (the same step), echoing has read fewer fresh tokens:
    # each example the baseline delivers is a fresh read, while an echoed
    # example's repeats hold its slot in a buffer of 128, so that the echo runs
    # can read at most that far ahead of half (a quarter) of what they deliver.
    baseline = runs["no echoing (baseline)"]
    for name, ratio in (("example echo after tokenizing, e=2", 1.0), ("example echo after tokenizing, e=4", 1.3)):
        step = max({row[2] for row in baseline["history"]} & {row[2] for row in runs[name]["history"]})
        assert step >= 20, "past the first 20 steps, the buffer's 128 examples weigh less than the repeats"
        assert _fresh_at(baseline, step) > ratio * _fresh_at(runs[name], step), (name, step)
