"""torch dtypes NumPy lacks (bfloat16, float8_*, complex32): a leaf of such a
dtype is stored as its bytes and delivered as a tensor of its dtype, bit for
bit, over the batch memory, through every placement of the loader.

Every record carries its id in such a tensor: digits of the id in base 8 (small
integers, exact in every dtype tested) and their negations (so a zero is a
negative zero: a distinct bit pattern), so a row whose bits do not match its id
shows a torn, misplaced or converted value.
"""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch dtypes need torch: pip install 'dataecho[torch]'")

from support import FIRST, check_exact, run_python, spy_on_last_stage  # noqa: E402

import dataecho  # noqa: E402
from dataecho.examples.structure import Structure  # noqa: E402

N = 240
DIGITS = 4  # base-8 digits of the id: ids below 8**4
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32}
# complex32 is "experimental" in torch: making one warns (an error under this suite's filters).
complex_warning = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")


def digits(i: int) -> list[float]:
    return [float((i >> (3 * k)) & 7) for k in range(DIGITS)]


def value_of(i: int, dtype: torch.dtype) -> torch.Tensor:
    """Record i's tensor: shape (2, DIGITS), the id's digits, then their negations."""
    real = torch.tensor([digits(i), [-d for d in digits(i)]], dtype=torch.float32)
    if dtype.is_complex:
        return torch.complex(real, -real).to(dtype)
    return real.to(dtype)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's items as integers of their size: what bit-exact means."""
    return tensor.view(INT_OF_SIZE[tensor.element_size()])


def ids_of(x: torch.Tensor) -> list[int]:
    """The ids a batch of record tensors carries (from their digits)."""
    first = x[:, 0, :]
    first = (first.real if first.is_complex() else first).to(torch.float32).to(torch.int64)
    return (first * (8 ** torch.arange(DIGITS))).sum(dim=1).tolist()


class DtypeRecords:
    """The map-style source: record i is {"id", "x": value_of(i), "pair": (a
    0-d bfloat16 tensor, a NumPy int32 array)}; module level, so that worker
    processes can unpickle it."""

    def __init__(self, n: int = N, dtype: str = "bfloat16", numpy_only: bool = False) -> None:
        self.n, self.dtype, self.numpy_only = n, dtype, numpy_only

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        if self.numpy_only:
            return {"id": np.int64(i)}
        pair = (torch.tensor(float(i % 256), dtype=torch.bfloat16), np.full(2, i, np.int32))
        return {"id": np.int64(i), "x": value_of(i, getattr(torch, self.dtype)), "pair": pair}


def check_batch(batch: dict, dtype: torch.dtype = torch.bfloat16) -> list[int]:
    """The batch's ids, after checking every leaf of every row against its id."""
    ids = np.asarray(batch["id"]).tolist()
    x, (label, ints) = batch["x"], batch["pair"]
    assert isinstance(x, torch.Tensor) and x.dtype == dtype, type(x)
    assert isinstance(label, torch.Tensor) and label.dtype == torch.bfloat16 and label.shape == (len(ids),)
    expected = torch.stack([value_of(i, dtype) for i in ids])
    assert torch.equal(bits(x), bits(expected)), "a row's bits differ from its id's"
    assert ids_of(x) == ids
    assert label.tolist() == [float(i % 256) for i in ids]
    np.testing.assert_array_equal(np.asarray(ints), np.repeat(np.array(ids, np.int32)[:, None], 2, axis=1))
    return ids


def drain(loader, dtype: torch.dtype = torch.bfloat16) -> Counter:
    delivered: Counter = Counter()
    for batch in loader:
        delivered.update(check_batch(batch, dtype))
    return delivered


def make(source=None, **kwargs) -> dataecho.EchoLoader:
    args = {"batch_size": 16, "echo_factor": 2, "shuffle_buffer": 64, "num_workers": 2}
    args.update(kwargs)
    return dataecho.EchoLoader(source if source is not None else DtypeRecords(), **args)


# ---- the loader, every placement ----


@pytest.mark.parametrize("output", ["torch", "numpy"])
@pytest.mark.parametrize("echo", [1, 2])
def test_bfloat16_is_delivered_bit_exact_and_counted_exactly(output, echo, seed):
    delivered = drain(make(echo_factor=echo, output=output, seed=seed))
    check_exact(delivered, range(N), echo)


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_bfloat16_leaves_view_the_batch_memory(output, seed):
    loader = make(echo_factor=1, output=output, seed=seed)
    epoch = iter(loader)
    native = spy_on_last_stage(epoch)
    batch = next(epoch)
    check_batch(batch)
    assert {batch["x"].data_ptr(), batch["pair"][0].data_ptr()} <= native[-1], "no copy"
    id_type = torch.Tensor if output == "torch" else np.ndarray
    assert isinstance(batch["id"], id_type) and isinstance(batch["pair"][1], id_type)
    loader.close()


@pytest.mark.parametrize("echo", [1, 2])
def test_worker_processes_convert_bfloat16_the_same_way(echo, seed):
    loader = make(echo_factor=echo, worker_type="process", seed=seed)
    delivered = drain(loader)
    check_exact(delivered, range(N), echo)
    workers = loader.stats()["workers"]
    assert len(workers) == 2 and sum(w["produced"] for w in workers) >= N - FIRST, workers


def test_reading_in_the_calling_thread(seed):
    check_exact(drain(make(num_workers=0, output="torch", seed=seed)), range(N), 2)


@pytest.mark.parametrize("echo", [2.5, "auto"])
def test_fractional_and_auto_echo(echo, seed):
    delivered = drain(make(echo_factor=echo, max_echo=3, seed=seed))
    if echo == "auto":
        assert sorted(delivered) == list(range(N)) and max(delivered.values()) <= 3
    else:
        check_exact(delivered, range(N), echo)


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_batch_echo(output, seed):
    delivered = drain(make(echo_at="batch", shuffle_buffer=4, output=output, seed=seed))
    check_exact(delivered, range(N), 2)


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_batch_echo_repeats_of_bfloat16_survive_in_place_changes(output, seed):
    # A bfloat16 leaf is a (writable) tensor with either output: every delivery
    # of a repeated batch but the last has memory of its own.
    delivered: Counter = Counter()
    for batch in make(echo_at="batch", echo_factor=3, shuffle_buffer=4, output=output, seed=seed):
        delivered.update(check_batch(batch))
        batch["x"].zero_()
        batch["pair"][0].fill_(-1.0)
    check_exact(delivered, range(N), 3)


def test_device_copy_keeps_the_dtype(seed):
    delivered = drain(make(output="torch", device="cpu", seed=seed))
    check_exact(delivered, range(N), 2)


@complex_warning
@pytest.mark.parametrize("output", ["torch", "numpy"])
@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2", "complex32"])
def test_other_dtypes_numpy_lacks(name, output, seed):
    dtype = getattr(torch, name)
    epoch = iter(make(DtypeRecords(dtype=name), output=output, seed=seed))
    epoch.start()  # the first examples tell the structure
    assert epoch.structure.specs[1][1] == np.dtype(f"u{dtype.itemsize}"), "stored as its bytes"
    assert epoch.structure.torch_dtypes[1] == str(dtype)
    check_exact(drain(epoch, dtype), range(N), 2)


# ---- augment and collate_fn ----


def double(example):
    """An augmentation that must see bfloat16, and writes to it in place."""
    x = example["x"]
    assert isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16, (type(x), getattr(x, "dtype", None))
    assert example["pair"][0].dtype == torch.bfloat16
    x.mul_(2)  # memory of its own: a repeat of this example must not see it
    return {"id": example["id"], "x": x, "wide": x.to(torch.float32)}


@pytest.mark.parametrize("echo_at", ["example", "batch"])
@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_augment_receives_and_produces_bfloat16(echo_at, output, seed):
    loader = make(augment=double, echo_at=echo_at, shuffle_buffer=4 if echo_at == "batch" else 64,
                  output=output, seed=seed)
    delivered: Counter = Counter()
    for batch in loader:
        ids = np.asarray(batch["id"]).tolist()
        expected = torch.stack([value_of(i, torch.bfloat16) * 2 for i in ids])
        assert batch["x"].dtype == torch.bfloat16 and torch.equal(bits(batch["x"]), bits(expected)), \
            "augmented once per delivery, from an unchanged original"
        wide = batch["wide"]  # an ordinary leaf: NumPy or torch as asked
        assert isinstance(wide, np.ndarray if output == "numpy" else torch.Tensor)
        np.testing.assert_array_equal(np.asarray(wide), expected.to(torch.float32).numpy())
        delivered.update(ids)
    check_exact(delivered, range(N), 2)


def to_bfloat16(example, rng):
    """An augmentation that makes a bfloat16 leaf from a NumPy-only example."""
    i = int(example["id"])
    return {"id": example["id"], "x": value_of(i, torch.bfloat16), "noise": rng.integers(0, 1 << 30)}


def test_augment_may_produce_bfloat16_from_numpy(seed):
    loader = make(DtypeRecords(numpy_only=True), augment=to_bfloat16, output="numpy", seed=seed)
    delivered: Counter = Counter()
    for batch in loader:
        ids = np.asarray(batch["id"]).tolist()
        assert isinstance(batch["id"], np.ndarray) and batch["x"].dtype == torch.bfloat16
        assert ids_of(batch["x"]) == ids
        delivered.update(ids)
    check_exact(delivered, range(N), 2)


@pytest.mark.parametrize("output", ["torch", "numpy"])
def test_collate_fn_gets_per_example_views_of_the_dtype(output, seed):
    seen = []

    def collate(examples):
        xs = [example["x"] for example in examples]
        assert all(x.dtype == torch.bfloat16 and x.shape == (2, DIGITS) for x in xs)
        assert all(example["pair"][0].dtype == torch.bfloat16 and example["pair"][0].dim() == 0
                   for example in examples)
        seen.append([x.data_ptr() for x in xs])
        return {"id": [int(example["id"]) for example in examples], "x": torch.stack(xs)}

    loader = make(echo_factor=1, output=output, collate_fn=collate, seed=seed)
    epoch = iter(loader)
    native = spy_on_last_stage(epoch)
    delivered: Counter = Counter()
    for batch in epoch:
        assert ids_of(batch["x"]) == batch["id"]
        assert torch.equal(bits(batch["x"]), bits(torch.stack([value_of(i, torch.bfloat16) for i in batch["id"]])))
        pointers = seen[-1]
        assert pointers[0] in native[-1], "the first example views its batch's memory"
        row = 2 * DIGITS * 2  # bytes of one row of x
        assert pointers == [pointers[0] + k * row for k in range(len(pointers))], "views, not copies"
        delivered.update(batch["id"])
    check_exact(delivered, range(N), 1)


# ---- resume ----


def rows(batch) -> list[tuple[int, bytes]]:
    """Each row's id and the bytes of its bfloat16 leaf."""
    ids = np.asarray(batch["id"]).tolist()
    return [(i, bits(x).numpy().tobytes()) for i, x in zip(ids, batch["x"])]


def noisy(example, rng):
    return {"id": example["id"], "x": example["x"] + float(rng.integers(0, 4))}


@pytest.mark.parametrize("kwargs", [{}, {"worker_type": "process"}, {"augment": noisy, "echo_at": "batch",
                                                                       "shuffle_buffer": 3}],
                         ids=["threads", "processes", "batch-echo-augment"])
def test_resume_yields_the_same_bits(kwargs):
    args = {"echo_factor": 1.5, "deterministic": True, "seed": 7, "output": "torch", **kwargs}
    reference = [rows(b) for b in make(**args)]
    assert all(batch for batch in reference)
    for cut in (1, len(reference) // 2):
        loader = make(**args)
        epoch = iter(loader)
        taken = [rows(next(epoch)) for _ in range(cut)]
        state = pickle.loads(pickle.dumps(loader.state_dict()))
        loader.close()
        resumed = make(**args)
        resumed.load_state_dict(state)
        assert taken + [rows(b) for b in resumed] == reference, f"resumed after batch {cut}"


# ---- what cannot be stored, and what does not match ----


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
def test_quantized_tensors_are_refused_naming_the_leaf():
    q = torch.quantize_per_tensor(torch.tensor([1.0, 2.0]), 0.1, 10, torch.quint8)
    with pytest.raises(TypeError, match=r"leaf 'meta/q' is a torch.quint8 tensor.*scale and zero point.*"
                                        r"expected a dtype that NumPy has"):
        next(iter(dataecho.EchoLoader([{"id": 0, "meta": {"q": q}}] * 4, batch_size=2)))
    with pytest.raises(TypeError, match="leaf 'example' is a torch.qint8"):
        Structure.infer(torch.quantize_per_tensor(torch.tensor([1.0]), 0.1, 0, torch.qint8))


def test_sparse_tensors_are_refused_naming_the_leaf():
    sparse = torch.eye(2, dtype=torch.bfloat16).to_sparse()
    with pytest.raises(TypeError, match="leaf 'x' is a torch.sparse_coo tensor; expected a dense tensor"):
        Structure.infer({"x": sparse})


def test_a_later_example_must_keep_the_dtype():
    raw = Structure.infer({"x": torch.zeros(3, dtype=torch.bfloat16)})
    assert raw.torch_dtypes == ["torch.bfloat16"] and raw.specs == [((3,), np.dtype(np.uint16))]
    for wrong, got in [(torch.zeros(3, dtype=torch.float16), "a torch.float16 tensor"),
                       (np.zeros(3, np.uint16), "a ndarray"), (7, "a int")]:
        with pytest.raises(TypeError, match=f"leaf 'x' is {got}; expected a torch.bfloat16 tensor"):
            raw.flatten({"x": wrong})
    plain = Structure.infer({"x": np.zeros(3, np.float32)})
    with pytest.raises(TypeError, match="leaf 'x' is a torch.bfloat16 tensor, which NumPy cannot read"):
        plain.flatten({"x": torch.zeros(3, dtype=torch.bfloat16)})


def test_a_later_example_of_another_dtype_fails_the_epoch():
    examples = [{"x": torch.zeros(2, dtype=torch.bfloat16)}] * 5 + [{"x": torch.zeros(2, dtype=torch.float32)}]
    loader = dataecho.EchoLoader(examples, batch_size=2, echo_factor=1, num_workers=1, shuffle=False)  # first: bfloat16
    with pytest.raises(TypeError, match="leaf 'x' is a torch.float32 tensor; expected a torch.bfloat16 tensor"):
        list(loader)


@complex_warning
def test_flatten_keeps_bits_of_strided_scalar_and_conjugate_tensors():
    structure = Structure.infer((torch.zeros(3, 2, dtype=torch.bfloat16).t(), torch.zeros((), dtype=torch.bfloat16),
                                 torch.zeros(2, dtype=torch.complex32)))
    x = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2).t()
    c = torch.tensor([1 + 2j, 3 - 4j]).to(torch.complex32)
    back = structure.unflatten(structure.flatten((x, torch.tensor(-0.0, dtype=torch.bfloat16), c.conj())))
    assert back[0].dtype == torch.bfloat16 and torch.equal(bits(back[0]), bits(x)), "a transposed view"
    assert bits(back[1]).item() == bits(torch.tensor(-0.0, dtype=torch.bfloat16)).item(), "a negative zero"
    assert back[2].dtype == torch.complex32
    assert back[2].to(torch.complex64).tolist() == [1 - 2j, 3 + 4j], "a conjugate view is resolved, not dropped"
    negative = torch.tensor([1.0, -2.0], dtype=torch.bfloat16)._neg_view()
    assert structure.unflatten(structure.flatten((x, negative[0], c)))[1].item() == -1.0


# ---- ShuffleBuffer, and the import ----


def test_shuffle_buffer_refuses_bfloat16_and_says_how():
    buf = dataecho.ShuffleBuffer({"x": ((3,), "float32")}, capacity=8, batch_size=2)
    with pytest.raises(TypeError, match=r"field 'x' could not be read.*declare it as int16 and put "
                                        r"tensor.view\(torch.int16\)"):
        buf.put({"x": torch.zeros(3, dtype=torch.bfloat16)})
    exact = dataecho.ShuffleBuffer({"x": ((2, DIGITS), "int16")}, capacity=8, batch_size=2, echo_factor=1)
    for i in (3, 300):
        exact.put({"x": value_of(i, torch.bfloat16).view(torch.int16)})
    exact.close()
    (batch,) = list(exact)
    back = torch.from_numpy(batch["x"]).view(torch.bfloat16)
    assert sorted(ids_of(back)) == [3, 300]


def test_importing_dataecho_still_does_not_import_torch():
    result = run_python(
        """
        import sys, dataecho, dataecho.examples.structure
        print("torch" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False"]
