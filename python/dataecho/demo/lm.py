"""The text task's model and training runs: a small causal Transformer over
byte tokens that takes a batch as it comes from the loader's ragged path,
packed (every sequence's tokens one after another, and their offsets), so that
no step computes on padding; trained per configuration until its validation
loss reaches the target, recording the loss against wall time and against
fresh tokens read."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

import dataecho

from .text import VOCAB, Corpus, StoredText, encode, tokenize, tokenize_and_crop
from .train import Config, Run, fit


def make_lm(torch: Any, width: int = 64, layers: int = 2, heads: int = 4) -> Any:
    """A byte-level Transformer language model (about 150 k parameters at the
    defaults: on one CPU core, a step of 16 sequences takes about 120 ms)."""
    nn, functional = torch.nn, torch.nn.functional

    class Block(nn.Module):
        """Pre-norm attention and MLP, as in GPT-2."""

        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

        def forward(self, x: Any, bounds: list[int]) -> Any:
            total = x.shape[0]
            q, k, v = self.qkv(self.norm1(x)).view(total, 3, heads, width // heads).permute(1, 2, 0, 3).unbind(0)
            # Attention is the one part that needs sequences apart: one causal
            # attention per sequence, over views of the packed tokens.
            # (4-D inputs: the 3-D form falls back to unfused attention on the CPU.)
            attended = [functional.scaled_dot_product_attention(q[None, :, a:b], k[None, :, a:b], v[None, :, a:b],
                                                                is_causal=True)[0]
                        for a, b in zip(bounds[:-1], bounds[1:])]
            x = x + self.out(torch.cat(attended, dim=1).transpose(0, 1).reshape(total, width))
            return x + self.mlp(self.norm2(x))

    class LanguageModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.previous = nn.Embedding(VOCAB, width), nn.Embedding(VOCAB, width)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB)

        def forward(self, tokens: Any, offsets: Any) -> Any:
            """Next-token logits ``(total, VOCAB)`` for packed `tokens` ``(total,)``
            split by `offsets` ``(batch + 1,)``."""
            # Each position also sees the byte before it (0 at a sequence's
            # start): attention learns that only slowly, and with it the loss
            # drops past bigram statistics within the first hundred steps. No
            # position embedding: causal attention tells positions apart itself,
            # and without one the loss fell faster here.
            lengths = offsets[1:] - offsets[:-1]
            tokens = tokens.long()
            previous = torch.roll(tokens, 1)
            previous[offsets[:-1][lengths > 0]] = 0
            x = self.embed(tokens) + self.previous(previous)
            bounds = offsets.tolist()
            for block in self.blocks:
                x = block(x, bounds)
            return self.head(self.norm(x))

    return LanguageModel()


def lm_loss(torch: Any, model: Any, tokens: Any, offsets: Any, reduction: str = "mean") -> Any:
    """Cross-entropy of each next token (nats), over every position but each
    sequence's last, which has no next token."""
    logits = model(tokens, offsets)
    keep = torch.ones(len(tokens), dtype=torch.bool, device=tokens.device)
    keep[offsets[1:] - 1] = False
    targets = torch.roll(tokens.long(), -1)
    return torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction=reduction)


def pack(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of rows of tokens, the layout of a ragged leaf."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum([len(r) for r in rows], out=offsets[1:])
    return (np.concatenate(rows) if rows else np.zeros(0, np.uint8)), offsets


BATCH_SIZE = 16  # sequences per step: about 2,900 tokens
LEARNING_RATE = 5e-3
SHUFFLE_BUFFER = 512  # examples: see make_loader

# The text task's ways to feed the model. "after": tokenized in `transform`,
# before the echo stage (repeats are identical); "before": the echo stage
# holds the raw text and `augment` tokenizes each repeat and takes a random
# window of it; "batch": tokenized batches echoed whole.
CONFIGS = (
    Config("no echoing (baseline)", 1.0, "after"),
    Config("example echo after tokenizing, e=2", 2.0, "after"),
    Config("example echo after tokenizing, e=4", 4.0, "after"),
    Config("echo before tokenizing + crop, e=2", 2.0, "before"),
    Config("batch echo, e=2", 2.0, "batch"),
    Config('echo_factor="auto" (max 4)', "auto", "after"),
)


def validation_batches(torch: Any, corpus: Corpus, indices: np.ndarray, *, examples: int, seed: int,
                       per_batch: int = 64) -> list[tuple[Any, Any]]:
    """A fixed, seeded sample of the held-out examples, packed in batches."""
    chosen = np.random.default_rng(seed).permutation(indices)[:examples]
    rows = [encode(corpus.read(int(i)).decode("utf-8")) for i in chosen]
    batches = []
    for start in range(0, len(rows), per_batch):
        values, offsets = pack(rows[start : start + per_batch])
        batches.append((torch.from_numpy(values), torch.from_numpy(offsets)))
    return batches


def evaluate(torch: Any, model: Any, batches: list[tuple[Any, Any]], device: Any) -> float:
    """Cross-entropy per predicted token (nats) over the validation batches."""
    total, count = 0.0, 0
    with torch.no_grad():
        for values, offsets in batches:
            total += float(lm_loss(torch, model, values.to(device), offsets.to(device), reduction="sum"))
            count += len(values) - (len(offsets) - 1)
    return total / count


def make_loader(config: Config, dataset: StoredText, *, batch_size: int, workers: int, seed: int,
                shuffle_buffer: int) -> dataecho.EchoLoader:
    """The loader for one configuration; token ids come as a ragged leaf."""
    before = config.placement == "before"
    if config.placement == "batch":
        resident = 16  # batches
    elif config.echo == 1.0:
        # No repeats to spread apart, and the reading order is already a new
        # permutation every epoch: the smallest buffer, which fills at once.
        resident = 2 * batch_size
    else:
        # Large enough to spread an example's repeats over many batches (with
        # 128 examples, e=4 learned far less per step), small enough to fill
        # soon: until it is full, each example delivered takes two fresh reads.
        resident = shuffle_buffer
    return dataecho.EchoLoader(
        dataset,
        batch_size=batch_size,
        echo_factor=config.echo,
        echo_at="batch" if config.placement == "batch" else "example",
        transform=None if before else tokenize,  # before: the text itself is held
        augment=tokenize_and_crop if before else None,
        shuffle_buffer=resident,
        num_workers=workers,
        seed=seed,
        max_echo=4.0,
        output="torch",
    )


def warm_up(torch: Any) -> None:
    """Pays torch's one-time cost of its first nested tensor (over a second of
    imports) before any run is timed: it would otherwise fall on the first
    batch of whichever configuration runs first."""
    values, offsets = torch.zeros(20, dtype=torch.uint8), torch.tensor([0, 8, 20])
    torch.nested.nested_tensor_from_jagged(values, offsets=offsets).values()


def train(config: Config, corpus: Corpus, indices: np.ndarray, validation: list[tuple[Any, Any]], *,
          target: float, max_seconds: float, latency_s: float, batch_size: int, workers: int,
          shuffle_buffer: int, eval_every: int, lr: float, seed: int, device: str,
          progress: Callable[[Run, float], None]) -> Run:
    """Trains a fresh model, from the same initial weights for every
    configuration, until its validation loss reaches `target` (or `max_seconds`).

    Returns:
        The run; its history rows are (seconds, fresh tokens read, steps,
        validation loss).
    """
    import torch

    torch.manual_seed(seed)
    model = make_lm(torch).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    dataset = StoredText(corpus, indices, latency_s)
    loader = make_loader(config, dataset, batch_size=batch_size, workers=workers, seed=seed,
                         shuffle_buffer=shuffle_buffer)

    def step(batch: dict) -> None:
        tokens = batch["tokens"]  # a jagged nested tensor: packed values and offsets
        loss = lm_loss(torch, model, tokens.values().to(device), tokens.offsets().to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return fit(Run(config), loader, step, lambda: evaluate(torch, model, validation, device),
               lambda: dataset.tokens_read, target=target, higher_is_better=False, max_seconds=max_seconds,
               eval_every=eval_every, progress=progress)
