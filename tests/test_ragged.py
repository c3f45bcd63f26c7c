"""Ragged leaves (a first axis whose length varies: token ids, boxes) and leaves
that are Python objects (str, bytes, None), through the native buffer and every
part of the loader: echo in each placement, augment, worker processes, resume,
torch nested tensors, padding; how they are declared or inferred; budgets of
memory that run out; and the batch types themselves.

Examples are support.ragged_one(i): an id and its payload, tokens of 0 to 2,999
int32 derived from the id, 0 to 5 boxes, and a name that is a str, bytes or
None; support.checked_ids checks every leaf of every row against its id.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from support import (
    Records,
    Stream,
    boxes_of,
    check_at_most,
    check_exact,
    checked_ids,
    drain,
    join_all,
    name_of,
    objects_held,
    ragged_one,
    rows,
    spy_on_last_stage,
    start,
    tokens_of,
)

import dataecho

N = 600


def loader(source: Any = None, **kwargs: Any) -> dataecho.EchoLoader:
    args = {"batch_size": 16, "echo_factor": 2, "seed": 7, "shuffle_buffer": 64}
    return dataecho.EchoLoader(Records(N, form="ragged") if source is None else source, **{**args, **kwargs})


# ---- exact accounting, every placement ----


@pytest.mark.parametrize("echo", [1, 2, 1.5, 3])
@pytest.mark.parametrize("workers", [0, 1, 3])
def test_ragged_and_object_leaves_come_exactly_as_often_as_the_echo_factor_says(echo, workers):
    delivered: Counter = Counter()
    epoch = iter(loader(echo_factor=echo, num_workers=workers))
    first = next(epoch)
    assert isinstance(first["tokens"], dataecho.Ragged) and isinstance(first["boxes"], dataecho.Ragged)
    assert isinstance(first["name"], list) and first["boxes"].row_shape == (4,)
    delivered.update(checked_ids(first).tolist())
    drain(epoch, delivered)
    check_exact(delivered, range(N), echo)
    assert objects_held(epoch) == 0, "the objects of every example delivered for the last time are dropped"


def test_auto_echo_and_batch_echo_carry_ragged_leaves():
    delivered: Counter = Counter()
    drain(loader(echo_factor="auto", max_echo=3), delivered)
    check_at_most(delivered, lambda i: 0 <= i < N, 3)
    assert set(delivered) == set(range(N)), "every example at least once"
    for output in ("numpy", "torch"):
        delivered = Counter()
        drain(loader(echo_at="batch", shuffle_buffer=4, output=output), delivered)
        check_exact(delivered, range(N), 2)


def crop(example: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """An augment that keeps a random prefix of the tokens (new memory) and a
    ragged leaf of its own whose length varies."""
    tokens = example["tokens"]
    assert not tokens.flags.writeable, "augment sees read-only views of the echo buffer"
    keep = int(rng.integers(0, len(tokens) + 1))
    return {**example, "tokens": tokens[:keep].copy(), "kept": np.arange(keep % 7, dtype=np.int16)}


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_augment_gets_each_repeat_and_may_return_ragged_leaves(worker_type):
    seen: Counter = Counter()
    for batch in loader(augment=crop, worker_type=worker_type, num_workers=2):
        ids = batch["id"].tolist()
        for i, tokens, kept, name in zip(ids, batch["tokens"], batch["kept"], batch["name"]):
            assert np.array_equal(tokens, tokens_of(i)[:len(tokens)]) and len(kept) == len(tokens) % 7
            assert name == name_of(i)
        assert isinstance(batch["kept"], dataecho.Ragged)
        seen.update(ids)
    check_exact(seen, range(N), 2)


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_processes_write_ragged_values_and_pickled_objects_straight_into_shared_memory(persistent):
    with loader(worker_type="process", num_workers=2, echo_factor=1.5, persistent_workers=persistent) as it:
        for epoch in range(2):
            delivered: Counter = Counter()
            drain(it, delivered)
            check_exact(delivered, range(N), 1.5)
            produced = sum(w["produced"] for w in it.stats()["workers"])
            # The first epoch reads its first examples here, to learn the structure.
            assert produced == N, "the workers read every example, the first ones, ragged values and all"


def test_an_iterable_source_of_ragged_examples_is_read_exactly():
    delivered: Counter = Counter()
    drain(loader(Stream(N, form="ragged"), transform=dict), delivered)
    check_exact(delivered, range(N), 2)


# ---- checkpoints ----


def run_batches(it: Any) -> list[tuple]:
    return [(b["id"].tolist(), [r.tolist() for r in b["tokens"]], b["name"]) for b in it]


@pytest.mark.parametrize("augment", [None, crop])
@pytest.mark.parametrize("after", [1, 9, 40])
def test_a_ragged_epoch_resumes_exactly_mid_epoch(augment, after):
    def make() -> dataecho.EchoLoader:
        return loader(deterministic=True, augment=augment, num_workers=2)

    whole = run_batches(make())
    first = make()
    epoch = iter(first)
    taken = run_batches(next(epoch) for _ in range(after))
    state = first.state_dict()
    del epoch
    resumed = make()
    resumed.load_state_dict(state)
    assert taken + run_batches(resumed) == whole


# ---- torch: nested tensors over the batch memory, padding ----


def test_torch_output_gives_jagged_nested_tensors_over_the_batch_memory():
    epoch = iter(loader(output="torch"))
    native = spy_on_last_stage(epoch)
    for batch in epoch:
        tokens, boxes = batch["tokens"], batch["boxes"]
        assert tokens.is_nested and tokens.layout == torch.jagged and tokens.dtype == torch.int32
        assert boxes.shape[0] == len(batch["id"]) and boxes.values().shape[1:] == (4,)
        assert {tokens.values().data_ptr(), tokens.offsets().data_ptr(), boxes.values().data_ptr()} <= native[-1], \
            "no copy: the nested tensors view the batch's memory"
        checked_ids(batch)


@pytest.mark.parametrize("output", ["numpy", "torch"])
def test_padding_gives_padded_rows_with_their_lengths(output):
    for batch in loader(output=output, padding="longest", echo_factor=1):
        padded = batch["tokens"]
        assert isinstance(padded, dataecho.Padded)
        lengths = np.asarray(padded.lengths)
        assert padded.data.shape == (len(lengths), max(lengths.max(), 0))
        checked_ids(batch)
    with pytest.raises(ValueError, match="more than length=100"):
        list(loader(padding=100))


def test_collate_fn_gets_each_row_as_a_view():
    batches = list(loader(collate_fn=lambda examples: examples, echo_factor=1))
    for examples in batches:
        for example in examples:
            i = int(example["id"])
            assert np.array_equal(example["tokens"], tokens_of(i)) and example["name"] == name_of(i)
    assert sum(len(b) for b in batches) == N


# ---- declaring and inferring ----


class Lists:
    """Token ids as Python lists (as tokenizers return them), of length `lengths(i)`."""

    def __init__(self, n: int, lengths: Any) -> None:
        self.n, self.lengths = n, lengths

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "input_ids": list(range(i, i + self.lengths(i)))}


def test_lists_of_numbers_whose_length_varies_are_ragged_and_equal_ones_stay_lists():
    batch = next(iter(dataecho.EchoLoader(Lists(100, lambda i: i % 9), batch_size=8, shuffle=False, echo_factor=1)))
    assert isinstance(batch["input_ids"], dataecho.Ragged) and batch["input_ids"].dtype == np.int64
    assert [r.tolist() for r in batch["input_ids"]] == [list(range(i, i + i % 9)) for i in range(8)]
    fixed = next(iter(dataecho.EchoLoader(Lists(100, lambda i: 3), batch_size=8, shuffle=False, echo_factor=1)))
    assert isinstance(fixed["input_ids"], list) and len(fixed["input_ids"]) == 3, "as torch's default collate"
    declared = next(iter(dataecho.EchoLoader(Lists(100, lambda i: 3), batch_size=8, echo_factor=1,
                                             ragged=["input_ids"])))
    assert isinstance(declared["input_ids"], dataecho.Ragged)


def test_a_leaf_taken_as_fixed_whose_length_changes_names_the_leaf_and_the_argument():
    later = Lists(200, lambda i: 3 if i < 100 else 5)
    with pytest.raises(TypeError, match=r"'input_ids'.*ragged=\['input_ids'\]"):
        list(dataecho.EchoLoader(later, batch_size=8, shuffle=False, echo_factor=1))

    class Arrays(Lists):
        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"id": i, "input_ids": np.zeros(3 if i < 100 else 5, np.int32)}

    with pytest.raises(ValueError, match=r"leaf 'input_ids' has shape \(5,\).*ragged=\['input_ids'\]"):
        list(dataecho.EchoLoader(Arrays(200, None), batch_size=8, shuffle=False, echo_factor=1))
    fine = dataecho.EchoLoader(Arrays(200, None), batch_size=8, echo_factor=1, ragged=["input_ids"])
    assert sum(len(b["id"]) for b in fine) == 200


@pytest.mark.parametrize("declared", [None, ["input_ids"]], ids=["found", "declared"])
def test_a_list_with_an_int_beyond_int64_in_the_first_examples_overflows_naming_the_leaf(declared):
    class Huge(Lists):  # NumPy would keep 2 ** 70 as a Python object
        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"id": i, "input_ids": [1, 2**70]} if i == 3 else super().__getitem__(i)

    with pytest.raises(OverflowError, match=r"leaf 'input_ids' value 1180591620717411303424 is out of range for int64"):
        list(dataecho.EchoLoader(Huge(100, lambda i: i % 9), batch_size=8, shuffle=False, echo_factor=1,
                                 ragged=declared))


def test_declared_paths_must_be_leaves_with_a_first_axis():
    with pytest.raises(ValueError, match=r"ragged: \['nope'\] are not leaves"):
        list(loader(ragged=["nope"]))
    with pytest.raises(ValueError, match="only a leaf's first axis may vary"):
        list(dataecho.EchoLoader([np.zeros((2, i % 3 + 1)) for i in range(20)], batch_size=4))
    with pytest.raises(TypeError, match="ragged: expected leaf paths"):
        dataecho.EchoLoader(Records(10), ragged="tokens")
    with pytest.raises(ValueError, match="padding: expected None, 'longest' or a length"):
        dataecho.EchoLoader(Records(10), padding="max")


def test_a_pil_image_is_refused_with_what_to_do():
    from PIL import Image

    images = [{"image": Image.new("RGB", (4, 4)), "label": i} for i in range(10)]
    with pytest.raises(TypeError, match=r"leaf 'image' is a PIL.Image.Image.*convert it in transform"):
        list(dataecho.EchoLoader(images, batch_size=2))


def test_objects_keep_their_identity_and_come_in_the_batch_order():
    class Tag:
        def __init__(self, i: int) -> None:
            self.i = i

    tags = [Tag(i) for i in range(300)]
    source = [{"id": i, "tag": tags[i], "text": f"row {i}", "maybe": None if i % 2 else b"x"} for i in range(300)]
    seen: Counter = Counter()
    for batch in dataecho.EchoLoader(source, batch_size=16, echo_factor=2, seed=1):
        for i, tag, text, maybe in zip(batch["id"].tolist(), batch["tag"], batch["text"], batch["maybe"]):
            assert tag is tags[i] and text == f"row {i}" and maybe == (None if i % 2 else b"x")
        seen.update(batch["id"].tolist())
    check_exact(seen, range(300), 2)


# ---- memory: budgets and lifetimes ----


def test_a_budget_smaller_than_the_buffer_blocks_producers_and_corrupts_nothing():
    # Room for the values of about 4 long examples: producers wait for pages while
    # the buffer draws from the few it holds, with 3 threads putting at once.
    buf = dataecho.ShuffleBuffer({"id": ((), "int64"), "tokens": ((None,), "int32")}, capacity=64,
                                 batch_size=8, echo_factor=2, seed=3, ragged_bytes=4 * 3000 * 4)

    def produce(first: int) -> None:
        for i in range(first, 900, 3):
            buf.put({"id": i, "tokens": tokens_of(i)})

    producers = [start(lambda f=f: produce(f), f"producer-{f}") for f in range(3)]
    closer = start(lambda: (join_all(producers, 60, "producers"), buf.close()), "closer")
    seen: Counter = Counter()
    kept = []
    for batch in buf:
        kept.append(batch)  # alive to the end: recycled memory would show in them
        for i, tokens in zip(batch["id"].tolist(), batch["tokens"]):
            assert np.array_equal(tokens, tokens_of(i)), f"tokens of id {i}"
        seen.update(batch["id"].tolist())
    join_all([closer], 60, "closer")
    check_exact(seen, range(900), 2)
    assert buf.stats()["starved"] > 0, "the budget ran short, as planned: batches were drawn from fewer examples"
    for batch in kept:
        assert all(np.array_equal(t, tokens_of(i)) for i, t in zip(batch["id"].tolist(), batch["tokens"]))
    assert buf.stats()["pages_in_use"] == 0 and buf.stats()["free_slots"] == 64


def test_an_example_larger_than_the_whole_budget_is_refused_and_nothing_is_stored():
    buf = dataecho.ShuffleBuffer({"tokens": ((None,), "int32")}, capacity=8, batch_size=2, ragged_bytes=1024)
    with pytest.raises(ValueError, match=r"more than the whole memory budget.*raise ragged_bytes"):
        buf.put_many({"tokens": [np.zeros(10, np.int32), np.zeros(1000, np.int32)]})
    assert buf.stats()["fresh"] == 0
    with pytest.raises(ValueError, match="ragged_bytes"):
        list(loader(ragged_bytes=4096, shuffle=False))


def test_a_loader_under_a_small_budget_still_delivers_every_example_exactly():
    delivered: Counter = Counter()
    drain(loader(ragged_bytes=64 * 1024, num_workers=3), delivered)
    check_exact(delivered, range(N), 2)


# ---- the low-level buffer and the batch types ----


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 400), min_size=1, max_size=120), st.sampled_from([(), (3,), (2, 2)]),
       st.sampled_from(["int8", "float64", "uint16"]), st.integers(1, 9), st.sampled_from([1, 2, 1.5]))
def test_fuzzed_lengths_and_row_shapes_come_back_exactly(lengths, row, dtype, batch_size, echo):
    buf = dataecho.ShuffleBuffer({"id": ((), "int64"), "x": ((None, *row), dtype)}, capacity=16,
                                 batch_size=min(batch_size, 16), echo_factor=echo, seed=len(lengths))

    def value(i: int) -> np.ndarray:
        return (np.arange(lengths[i] * int(np.prod(row))).reshape(lengths[i], *row) + i).astype(dtype)

    def produce() -> None:
        with buf:
            half = len(lengths) // 2
            buf.put_many({"id": np.arange(half), "x": [value(i) for i in range(half)]})
            for i in range(half, len(lengths)):
                buf.put({"id": i, "x": value(i)})

    producer = start(produce)
    seen: Counter = Counter()
    for batch in buf:
        for i, x in zip(batch["id"].tolist(), batch["x"]):
            assert x.dtype == np.dtype(dtype) and np.array_equal(x, value(i))
        seen.update(batch["id"].tolist())
    join_all([producer], 30, "producer")
    check_exact(seen, range(len(lengths)), echo)


def test_ragged_batches_are_packed_rows_with_offsets():
    r = dataecho.Ragged.from_rows([[1, 2, 3], [], [4]], dtype=np.int32)
    assert r.offsets.tolist() == [0, 3, 3, 4] and r.lengths.tolist() == [3, 0, 1] and len(r) == 3
    assert r[0].tolist() == [1, 2, 3] and r[-1].tolist() == [4] and [x.tolist() for x in r] == [[1, 2, 3], [], [4]]
    assert repr(r) == "Ragged(3 rows of (n) int32, lengths [3, 0, 1], 4 in all)"
    padded = r.padded(value=-1)
    assert padded.data.tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1]] and padded.lengths.tolist() == [3, 0, 1]
    assert padded.mask.tolist() == [[True] * 3, [False] * 3, [True, False, False]]
    assert padded.data.shape == r.padded(3).data.shape and r.padded(5).data.shape == (3, 5)
    assert repr(padded).startswith("Padded(data=ndarray (3, 3) int32")
    with pytest.raises(ValueError, match="more than length=2"):
        r.padded(2)
    with pytest.raises(IndexError):
        r[3]
    with pytest.raises(ValueError, match="offsets must rise"):
        dataecho.Ragged(np.zeros(3), np.array([0, 2, 1, 3]))
    boxes = dataecho.Ragged.from_rows([np.ones((2, 4)), np.zeros((0, 4))])
    assert boxes.row_shape == (4,) and boxes.padded().data.shape == (2, 2, 4)
    nested = r.to_torch()
    assert nested.values().data_ptr() == r.values.ctypes.data, "over the same memory"
    assert [t.tolist() for t in nested.unbind()] == [[1, 2, 3], [], [4]]
    view = r.read_only()
    assert not view.values.flags.writeable and view == r and view.values.ctypes.data == r.values.ctypes.data


def test_the_shuffle_buffer_takes_ragged_fields_in_put_many_as_a_ragged_or_a_list():
    buf = dataecho.ShuffleBuffer({"id": ((), "int64"), "t": ((None,), "int32"), "s": ((), object)}, capacity=16,
                                 batch_size=4, echo_factor=1, seed=0)
    with buf:
        buf.put_many({"id": np.arange(3), "t": dataecho.Ragged.from_rows([[1], [], [2, 3]], np.int32),
                      "s": ["a", None, b"c"]})
        buf.put_many({"id": np.arange(3, 5), "t": [np.arange(4, dtype=np.int32), []], "s": [1.5, ("t",)]})
        with pytest.raises(TypeError, match="field 't' expected a Ragged or a list of 2 examples"):
            buf.put_many({"id": np.arange(2), "t": np.zeros((2, 3), np.int32), "s": ["x", "y"]})
    got = {}
    for batch in buf:
        for i, t, s in zip(batch["id"].tolist(), batch["t"], batch["s"]):
            got[i] = (t.tolist(), s)
    assert got == {0: ([1], "a"), 1: ([], None), 2: ([2, 3], b"c"), 3: ([0, 1, 2, 3], 1.5), 4: ([], ("t",))}



def to_bytes(example: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """An augment that tokenizes text into bytes, from a random start (echo
    before tokenization); the example's name, a str, becomes its id."""
    data = example["text"].encode()
    start = int(rng.integers(0, len(data) + 1))
    return {"id": int(example["name"]), "tokens": np.frombuffer(data[start:], dtype=np.uint8).copy()}


def test_examples_of_objects_only_echo_before_an_augment_that_tokenizes_them():
    texts = [f"text {i} " * (i % 4) for i in range(300)]
    source = [{"name": str(i), "text": text} for i, text in enumerate(texts)]  # no array at all
    seen: Counter = Counter()
    for batch in dataecho.EchoLoader(source, batch_size=16, echo_factor=2, augment=to_bytes, seed=5):
        assert isinstance(batch["tokens"], dataecho.Ragged) and batch["tokens"].dtype == np.uint8
        for i, tokens in zip(batch["id"].tolist(), batch["tokens"]):
            assert texts[i].encode().endswith(tokens.tobytes())
        seen.update(batch["id"].tolist())
    check_exact(seen, range(300), 2)
    strings = next(iter(dataecho.EchoLoader(texts, batch_size=8, shuffle=False, echo_factor=1)))
    assert strings == texts[:8], "an example that is one object: a batch is a list"


class ShortFirst:
    """Token sequences of one token for the first ids, of 400 after: a loader
    that sized its memory from the first examples alone would be short of it."""

    def __len__(self) -> int:
        return 400

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "tokens": np.full(1 if i < 16 else 400, i, dtype=np.int32)}


@pytest.mark.parametrize("ragged_bytes", [None, 1024])
def test_a_resumed_ragged_epoch_takes_the_saved_structure_and_memory(ragged_bytes):
    def make(**kwargs):
        return dataecho.EchoLoader(ShortFirst(), batch_size=8, echo_factor=2, shuffle_buffer=64, seed=1,
                                   ragged=["tokens"], timeout=30, **kwargs)

    loader = make()
    epoch = iter(loader)
    seen = Counter(i for _ in range(40) for i in next(epoch)["id"].tolist())
    state = loader.state_dict()
    assert state["structure"]["kinds"] == ["array", "ragged"]
    assert state["stages"]["intake"]["ragged_bytes"] > 64 * 400 * 4 // 2, "the saved buffer's memory"
    resumed = make(ragged_bytes=ragged_bytes)  # its own first examples are short: the state tells the rest
    resumed.load_state_dict(state)
    for batch in resumed:
        for i, tokens in zip(batch["id"].tolist(), batch["tokens"]):
            assert len(tokens) == (1 if i < 16 else 400) and (tokens == i).all()
            seen[i] += 1
    assert seen == Counter({i: 2 for i in range(400)})
