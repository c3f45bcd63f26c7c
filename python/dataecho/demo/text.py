"""The text task's data: the docstrings of Python's own standard library,
split into examples of 16 to 512 bytes, written once to a cache file and read
back one example per access with a simulated latency, like a remote store.

Tokens are bytes (UTF-8, a vocabulary of 256), so the tokens read from the
store are its bytes and no text is ever out of vocabulary.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import sysconfig
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .cache import npz_bytes, write_whole

VOCAB = 256
MIN_TOKENS, MAX_TOKENS = 16, 512
# Folders whose docstrings are not the standard library's own: installed
# packages (they differ from one environment to the next) and tests.
_SKIP = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def default_cache() -> Path:
    """Per Python version: another version's standard library says other things."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dataecho" / f"stdlib-docstrings-py{sys.version_info[0]}.{sys.version_info[1]}"


def encode(text: str) -> np.ndarray:
    """The tokenizer: a string's UTF-8 bytes as uint8 token ids."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def decode(tokens: np.ndarray) -> str:
    return bytes(np.asarray(tokens, dtype=np.uint8)).decode("utf-8", errors="replace")


def docstrings(stdlib: Path) -> Iterator[tuple[str, str]]:
    """(module path, docstring) for each module, class and function, in file order."""
    files = sorted(f for f in stdlib.rglob("*.py") if not _SKIP & set(f.relative_to(stdlib).parts))
    for path in files:
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError):  # a few files are templates or fixtures, not Python
            continue
        for node in ast.walk(tree):
            if isinstance(node, _DOCUMENTED):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    yield str(path.relative_to(stdlib)), doc


def paragraphs(doc: str) -> list[str]:
    """Blank-line separated paragraphs; prose reflowed onto one line, code
    (doctests, indented blocks) kept line by line, since its layout is content."""
    out = []
    for block in re.split(r"\n\s*\n", doc.expandtabs(4)):
        lines = [line.rstrip() for line in textwrap.dedent(block).strip("\n").splitlines()]
        if not any(lines):
            continue
        code = any(line.startswith((">>>", "...", " ")) for line in lines)
        out.append("\n".join(lines) if code else " ".join(block.split()))
    return out


def _pieces(paragraph: str, limit: int) -> Iterator[str]:
    """Cuts a paragraph longer than `limit` bytes at the last line break or space."""
    while len(paragraph.encode("utf-8")) > limit:
        head = paragraph.encode("utf-8")[:limit].decode("utf-8", errors="ignore")
        cut = max(head.rfind("\n"), head.rfind(" "))
        cut = cut if cut > limit // 4 else len(head)
        yield paragraph[:cut].rstrip()
        paragraph = paragraph[cut:].lstrip()
    if paragraph:
        yield paragraph


def examples(doc: str, limit: int = MAX_TOKENS) -> Iterator[str]:
    """A docstring as examples of at most `limit` bytes: whole consecutive
    paragraphs while they fit, so lengths follow the text's own."""
    current = ""
    for paragraph in paragraphs(doc):
        for piece in _pieces(paragraph, limit):
            joined = f"{current}\n\n{piece}" if current else piece
            if len(joined.encode("utf-8")) <= limit:
                current = joined
                continue
            if current:
                yield current
            current = piece
    if current:
        yield current


@dataclass(frozen=True)
class Corpus:
    """The cached corpus: every example's bytes one after another in `path`.

    Attributes:
        path: the file of examples.
        offsets: ``(n + 1,)`` int64: example ``i`` is bytes ``offsets[i]:offsets[i + 1]``.
        modules: ``(n,)`` int32: which standard-library file each example comes
            from, so that the validation split holds out whole modules.
    """

    path: Path
    offsets: np.ndarray
    modules: np.ndarray

    def __len__(self) -> int:
        return len(self.modules)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def read(self, i: int) -> bytes:
        """Example `i`'s bytes, read from the file (no latency added)."""
        # Opened per read, as a store serves one object per request; pread
        # leaves no shared file position for reader threads to contend for.
        with open(self.path, "rb") as f:
            return os.pread(f.fileno(), int(self.offsets[i + 1] - self.offsets[i]), int(self.offsets[i]))


def write_corpus(cache: Path, stdlib: Path | None = None) -> Corpus:
    """Builds the corpus from the standard library's docstrings into `cache`
    once (a few seconds), and loads it from there afterwards.

    Examples shorter than MIN_TOKENS bytes are dropped, and repeated ones
    ("Return self==value.") kept once: the order is the files' sorted order,
    so the corpus is the same on every build from the same standard library.
    Both files are written whole or not at all (dataecho.demo.cache); a cache
    that is not whole, or whose files do not match, is built again.
    """
    data, index = cache / "examples.txt", cache / "index.npz"
    cached = _cached_corpus(data, index)
    if cached is not None:
        return cached
    stdlib = stdlib or Path(sysconfig.get_paths()["stdlib"])
    seen: set[str] = set()
    chunks, lengths, modules, names = [], [], [], {}
    for module, doc in docstrings(stdlib):
        for example in examples(doc):
            raw = example.encode("utf-8")
            if len(raw) < MIN_TOKENS or example in seen:
                continue
            seen.add(example)
            chunks.append(raw)
            lengths.append(len(raw))
            modules.append(names.setdefault(module, len(names)))
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    cache.mkdir(parents=True, exist_ok=True)
    # The index last: where it matches the examples' file, the corpus is whole.
    write_whole(data, b"".join(chunks))
    write_whole(index, npz_bytes(offsets=offsets, modules=np.asarray(modules, dtype=np.int32)))
    return Corpus(data, offsets, np.asarray(modules, dtype=np.int32))


def _cached_corpus(data: Path, index: Path) -> Corpus | None:
    """The corpus cached in ``data`` and ``index``, or None where either is
    missing, not whole, or does not match the other."""
    try:
        with open(index, "rb") as f, np.load(f) as arrays:  # closed here even where np.load fails
            offsets, modules = arrays["offsets"], arrays["modules"]
        size = data.stat().st_size
    except Exception:  # missing, empty, cut short, not an index: the cache is built again
        return None
    if offsets.ndim != 1 or modules.shape != (len(offsets) - 1,) or len(modules) == 0:
        return None
    whole = offsets[0] == 0 and offsets[-1] == size and bool((np.diff(offsets) >= 0).all())
    return Corpus(data, offsets, modules) if whole else None


def split(corpus: Corpus, validation: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split into train and validation example indices, by module:
    held-out modules, not held-out paragraphs of modules trained on.

    Args:
        corpus: the corpus.
        validation: the share of examples to hold out (about: whole modules).
        seed: chooses the modules and the order of the training indices.
    """
    rng = np.random.default_rng(seed)
    counts = np.bincount(corpus.modules)
    order = rng.permutation(len(counts))
    held = order[: int(np.searchsorted(np.cumsum(counts[order]), validation * len(corpus))) + 1]
    is_val = np.isin(corpus.modules, held)
    return rng.permutation(np.flatnonzero(~is_val)), np.flatnonzero(is_val)


class StoredText:
    """Map-style dataset: one example's text per access, read from the corpus
    file after a simulated network latency, as ``{"text": str}``.

    Counts the tokens it reads (``tokens_read``): one per byte, since the
    tokenizer is byte-level.

    Args:
        corpus: the cached corpus.
        indices: which examples (the training split).
        latency_s: a simulated read time per example (a sleep).
    """

    def __init__(self, corpus: Corpus, indices: np.ndarray, latency_s: float) -> None:
        self.corpus, self.indices, self.latency_s = corpus, np.asarray(indices), latency_s
        self.tokens_read = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        if self.latency_s:
            time.sleep(self.latency_s)
        raw = self.corpus.read(int(self.indices[i]))
        with self._lock:  # reader threads count at once
            self.tokens_read += len(raw)
        return {"text": raw.decode("utf-8")}


def tokenize(example: dict) -> dict:
    """``{"text": str}`` to ``{"tokens": uint8 (n,)}``: a ragged leaf in a batch."""
    return {"tokens": encode(example["text"])}


def tokenize_and_crop(example: dict, rng: np.random.Generator, keep: float = 0.75) -> dict:
    """Tokenizes, then keeps a random window of at least `keep` of the tokens
    (and at least MIN_TOKENS): as ``augment`` after echoing, each repeat of an
    example is another window of it, so repeats are not identical."""
    tokens = encode(example["text"])
    n = len(tokens)
    if n <= MIN_TOKENS:
        return {"tokens": tokens}
    length = int(rng.integers(max(MIN_TOKENS, int(np.ceil(n * keep))), n + 1))
    start = int(rng.integers(0, n - length + 1))
    return {"tokens": tokens[start : start + length]}
