"""Variable-length token sequences: ``EchoLoader`` against the loaders a user
would otherwise pad with, in one run.

Every pipeline delivers shuffled batches of 256 sequences of 16 to 512 int32
tokens (lengths uniform, 264 on average) at echo factor 1, epoch after epoch,
from one of two sources of the same sequences:

* ``per-example``: a map-style dataset whose ``__getitem__`` returns
  ``{"input_ids": tokens}``, a view of a sequence of the tokenized corpus held
  in memory (as a dataset of pre-tokenized arrays returns its arrays): every
  loader copies each sequence once, into its batch or its buffer;
* ``HF Dataset``: a Hugging Face ``datasets.Dataset`` with an ``input_ids``
  column of int32 lists, where datasets imports (DataLoader reads it in its
  ``torch`` format).

Contestants: ``EchoLoader(source, batch_size=256, echo_factor=1)``, which
delivers packed values and offsets (``dataecho.Ragged``: nothing padded), and
with ``padding="longest"`` (``dataecho.Padded``: padded rows and lengths);
torch ``DataLoader(source, batch_size=256, shuffle=True)`` with 0 and 2
(persistent) workers and a padding ``collate_fn``, as transformers'
``DataCollatorWithPadding`` pads (``pad_sequence`` to the longest, and an
attention mask); and tf.data over the same packed tokens, ``range(n)
.shuffle(4096).map(slice of the tokens, AUTOTUNE).padded_batch(256)
.prefetch(2)``, where tensorflow imports.

Figures: delivered tokens/s (the sequences' own tokens, not padding) in steady
state, the median of ``repeat`` interleaved rounds; and, mid-epoch, the echo
buffer's memory per example it holds (its slot, and the pages of the page heap
its tokens take) against the tokens' own bytes.

Usage:
    python bench/bench_ragged.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import common
import dataecho
from bench_buffer import median_run
from bench_loaders import endless, run_dataloader, run_echo

BATCH = 256
SHUFFLE = 4096
SEQUENCES = 1 << 15
SHORTEST, LONGEST = 16, 512
WARMUP_BATCHES = 4
ECHO, ECHO_PADDED = "EchoLoader (packed)", "EchoLoader, padding='longest'"
DL0, DL2 = "DataLoader + pad collate, 0 workers", "DataLoader + pad collate, 2 workers"
TF = "tf.data padded_batch"


def sequences(n: int = SEQUENCES) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, offsets): n sequences of SHORTEST to LONGEST int32 tokens, packed."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(SHORTEST, LONGEST + 1, n)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return rng.integers(0, 32000, offsets[-1], dtype=np.int32), offsets


class Tokenized:
    """Map-style: ``self[i]`` is ``{"input_ids": sequence i}`` (a view of the packed tokens)."""

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray) -> None:
        self.tokens, self.offsets = tokens, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.tokens[self.offsets[i]:self.offsets[i + 1]]}


def pad_collate(examples: list[dict[str, Any]]) -> dict[str, Any]:
    """Pads to the longest in the batch, with an attention mask, as
    ``DataCollatorWithPadding`` does."""
    import torch
    from torch.nn.utils.rnn import pad_sequence

    ids = [torch.as_tensor(e["input_ids"]) for e in examples]
    lengths = torch.tensor([len(t) for t in ids])
    padded = pad_sequence(ids, batch_first=True)
    return {"input_ids": padded, "attention_mask": torch.arange(padded.shape[1])[None, :] < lengths[:, None]}


def tokens_in(batch: Any) -> tuple[int, int]:
    """(sequences, real tokens) of a batch of any contestant."""
    leaf = batch["input_ids"]
    if isinstance(leaf, dataecho.Ragged):
        return len(leaf), len(leaf.values)
    if isinstance(leaf, dataecho.Padded):
        return len(leaf.lengths), int(leaf.lengths.sum())
    mask = batch["attention_mask"]
    return len(mask), int(mask.sum())


def timed(batches: Iterator[Any], seconds: float) -> dict:
    """Tokens and sequences per second after WARMUP_BATCHES batches."""
    for _ in range(WARMUP_BATCHES):
        next(batches)
    start, rows, tokens = time.perf_counter(), 0, 0
    while time.perf_counter() - start < seconds:
        n, t = tokens_in(next(batches))
        rows, tokens = rows + n, tokens + t
    elapsed = time.perf_counter() - start
    return {"ex_s": rows / elapsed, "tokens_s": tokens / elapsed}


def run_tfdata(tokens: np.ndarray, offsets: np.ndarray, seconds: float) -> dict:
    import tensorflow as tf

    values, bounds = tf.constant(tokens), tf.constant(offsets)
    dataset = (tf.data.Dataset.range(len(offsets) - 1).shuffle(SHUFFLE)
               .map(lambda i: values[bounds[i]:bounds[i + 1]], num_parallel_calls=tf.data.AUTOTUNE)
               .padded_batch(BATCH).prefetch(2))

    def epoch() -> Iterator[dict[str, Any]]:
        for padded in dataset.as_numpy_iterator():
            yield {"input_ids": padded, "attention_mask": padded != 0}  # no token is 0 here but by chance

    return timed(endless(epoch), seconds)


def memory_per_example(tokens: np.ndarray, offsets: np.ndarray) -> dict:
    """Mid-epoch: the echo buffer's bytes per example held (slot + pages) and
    the tokens' own bytes per example held, from ``loader.stats()``."""
    loader = dataecho.EchoLoader(Tokenized(tokens, offsets), batch_size=BATCH, echo_factor=1)
    epoch = iter(loader)
    for _ in range(SHUFFLE // BATCH):
        next(epoch)
    memory = loader.stats()["this_epoch"]["memory"]
    loader.close()
    held = memory["held"]
    own = 4 * float(np.mean(np.diff(offsets)))
    per = memory["slot_bytes"] + memory["ragged_bytes_in_use"] / held
    return {"held": held, "bytes_per_example": per, "tokens_bytes": own, "ratio": per / own,
            "budget_bytes": memory["ragged_bytes"]}


def run(seconds: float, repeat: int) -> tuple[list[dict], dict, list[dict]]:
    """The rates (median of `repeat` interleaved rounds), the memory figures, and the targets."""
    available = {name: _imports(name) for name in ("torch", "tensorflow", "datasets")}
    tokens, offsets = sequences()
    sources = {"per-example": Tokenized(tokens, offsets)}
    if available["datasets"]:
        import datasets

        rows = [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
        sources["HF Dataset"] = datasets.Dataset.from_dict({"input_ids": rows}, features=features)
    cells: dict[tuple[str, str], list[dict]] = {}
    for _ in range(repeat):
        for kind, source in sources.items():
            runs: dict[str, Callable[[], dict]] = {
                ECHO: lambda: run_echo(source, seconds, timed),
                ECHO_PADDED: lambda: run_echo(source, seconds, timed, padding="longest"),
            }
            if available["torch"]:
                torch_source = source.with_format("torch") if kind == "HF Dataset" else source
                runs[DL0] = lambda: run_dataloader(torch_source, seconds, 0, timed, pad_collate)
                runs[DL2] = lambda: run_dataloader(torch_source, seconds, 2, timed, pad_collate)
            for name, fn in runs.items():
                print(f"running {kind}: {name} ...", file=sys.stderr, flush=True)
                cells.setdefault((kind, name), []).append(fn())
        if available["tensorflow"]:
            print(f"running {TF} ...", file=sys.stderr, flush=True)
            cells.setdefault(("the packed tokens", TF), []).append(run_tfdata(tokens, offsets, seconds))
    rows = [{"source": kind, "contestant": name, **median_run(results)} for (kind, name), results in cells.items()]
    memory = memory_per_example(tokens, offsets)
    return rows, memory, targets(rows, memory)


def rate(rows: list[dict], source: str, name: str) -> float | None:
    return next((r["tokens_s"] for r in rows if (r["source"], r["contestant"]) == (source, name)), None)


def print_table(rows: list[dict], memory: dict) -> None:
    table = []
    for r in rows:
        echo = rate(rows, r["source"], ECHO) or rate(rows, "per-example", ECHO)
        ratio = "" if r["contestant"] == ECHO or not echo else f"{echo / r['tokens_s']:.2f}x"
        table.append((r["source"], r["contestant"], f"{r['tokens_s'] / 1e6:,.2f} M", f"{r['ex_s']:,.0f}", ratio))
    common.print_table(("source", "contestant", "tokens/s", "sequences/s", "EchoLoader / it"), table, left=(0, 1))
    print(f"    memory mid-epoch, {memory['held']} sequences held: {memory['bytes_per_example']:.0f} bytes each "
          f"(slot + pages) for {memory['tokens_bytes']:.0f} bytes of tokens: {memory['ratio']:.2f}x; "
          f"budget {memory['budget_bytes'] / 2**20:.1f} MiB (pages touched only once used)")


def targets(rows: list[dict], memory: dict) -> list[dict]:
    echo = rate(rows, "per-example", ECHO)
    best_dl = max((r for n in (DL0, DL2) if (r := rate(rows, "per-example", n))), default=None)
    tf = rate(rows, "the packed tokens", TF)
    return [
        _check("tokens 16-512: EchoLoader >= 5 x DataLoader + pad collate (its best)",
               echo / best_dl if echo and best_dl else None, 5.0, "torch did not run"),
        _check("tokens 16-512: EchoLoader >= tf.data padded_batch", echo / tf if echo and tf else None, 1.0,
               "tf.data did not run"),
        {"target": "memory per resident sequence <= 1.2 x its tokens' bytes", "value": memory["ratio"],
         "threshold": 1.2, "shown": f"{memory['ratio']:.2f}x", "met": memory["ratio"] <= 1.2},
    ]


def _check(target: str, value: float | None, threshold: float, why_skipped: str) -> dict:
    met = None if value is None else value >= threshold
    return {"target": target, "value": value, "threshold": threshold,
            "shown": why_skipped if value is None else f"{value:.2f}x", "met": met}


def _imports(name: str) -> bool:
    try:
        __import__(name)
        return True
    except Exception:  # a broken install is a skip, not a crash
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="short runs, one round")
    args = parser.parse_args(argv)
    seconds, repeat = (0.5, 1) if args.quick else (1.5, 3)
    info = common.machine(**{k: "yes" if _imports(k) else None for k in ("torch", "tensorflow", "datasets")})
    common.print_header(info, f"delivered tokens/s, batch {BATCH} sequences of {SHORTEST}-{LONGEST} int32 tokens, "
                              f"echo 1; higher is better")
    rows, memory, checks = run(seconds, repeat)
    print_table(rows, memory)
    common.print_targets(checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
