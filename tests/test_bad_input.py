"""Bad input gets a clear TypeError/ValueError naming the argument, before any
thread starts; nothing crashes, hangs or stores a corrupted example."""

from __future__ import annotations

import numpy as np
import pytest

import dataecho
from dataecho import _core

GOOD = {"image": ((2, 3), "uint8"), "label": ((), "int64")}


def make(**kwargs):
    args = {"fields": GOOD, "capacity": 16, "batch_size": 4}
    args.update(kwargs)
    return dataecho.ShuffleBuffer(**args)


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        ({"fields": {}}, ValueError, "fields"),
        ({"fields": None}, TypeError, "fields"),
        ({"fields": {"x": ((2,), "object")}}, TypeError, r"fields\['x'\].*object"),
        ({"fields": {"x": ((None, 2), "object")}}, TypeError, r"fields\['x'\].*object"),
        ({"fields": {"x": ((2,), [("a", "O"), ("b", "i8")])}}, TypeError, r"fields\['x'\].*Python objects"),
        ({"fields": {"x": ((2,), "not-a-dtype")}}, TypeError, r"fields\['x'\].*not a NumPy dtype"),
        ({"fields": {"x": ((2,), "U")}}, ValueError, r"fields\['x'\].*no size"),
        ({"fields": {"x": ((0, 3), "uint8")}}, ValueError, r"fields\['x'\].*dimension 0.*positive"),
        ({"fields": {"x": ((3, -1), "uint8")}}, ValueError, r"fields\['x'\].*dimension 1.*positive"),
        ({"fields": {"x": ((2.5,), "uint8")}}, TypeError, r"fields\['x'\].*dimension 0"),
        ({"fields": {"x": ((True,), "uint8")}}, TypeError, r"fields\['x'\].*dimension 0"),
        ({"fields": {"x": (2,)}}, TypeError, r"fields\['x'\].*\(shape, dtype\)"),
        ({"fields": {1: ((2,), "uint8")}}, TypeError, "field names"),
        ({"fields": ((1 << 40, 1 << 40), "uint8")}, ValueError, "fields.*limit"),
        ({"capacity": 0}, ValueError, "capacity"),
        ({"capacity": -5}, ValueError, "capacity"),
        ({"capacity": 2.0}, TypeError, "capacity"),
        ({"capacity": True}, TypeError, "capacity"),
        ({"capacity": "16"}, TypeError, "capacity"),
        ({"capacity": 1 << 40}, ValueError, "capacity"),
        ({"batch_size": 0}, ValueError, "batch_size"),
        ({"batch_size": False}, TypeError, "batch_size"),
        ({"batch_size": 17}, ValueError, "batch_size.*larger than capacity"),
        ({"echo_factor": 0.5}, ValueError, "echo_factor"),
        ({"echo_factor": float("nan")}, ValueError, "echo_factor"),
        ({"echo_factor": float("inf")}, ValueError, "echo_factor"),
        ({"echo_factor": True}, TypeError, "echo_factor"),
        ({"echo_factor": "2"}, ValueError, "echo_factor.*'auto'"),
        ({"echo_factor": [2]}, TypeError, "echo_factor"),
        ({"echo_factor": "auto", "max_echo": 0.5}, ValueError, "max_echo"),
        ({"echo_factor": "auto", "max_echo": float("inf")}, ValueError, "max_echo"),
        ({"echo_factor": 1e12}, ValueError, "echo_factor"),
        ({"seed": -1}, ValueError, "seed"),
        ({"seed": 1 << 64}, ValueError, "seed"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"seed": True}, TypeError, "seed"),
        ({"drop_last": 1}, TypeError, "drop_last"),
        ({"prefetch": 0}, ValueError, "prefetch"),
        ({"initial": 0}, ValueError, "initial"),
        ({"initial": 17}, ValueError, "initial"),
        ({"fields": ((1 << 33,), "uint8"), "capacity": 1 << 31, "batch_size": 1}, ValueError, "capacity.*overflow"),
        ({"fields": ((1 << 30,), "uint8"), "capacity": 1 << 30, "batch_size": 1}, MemoryError, "capacity.*bytes"),
    ],
)
def test_bad_constructor_arguments(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        make(**kwargs)


@pytest.fixture
def buf():
    b = make()
    yield b
    b.close()


def good_example():
    return {"image": np.zeros((2, 3), np.uint8), "label": 7}


@pytest.mark.parametrize(
    "example,error,pattern",
    [
        ([1, 2], TypeError, "expected a dict"),
        ({"image": np.zeros((2, 3), np.uint8)}, ValueError, r"missing \['label'\]"),
        ({**good_example(), "extra": 1}, ValueError, r"unexpected \['extra'\]"),
        ({"image": np.zeros((3, 2), np.uint8), "label": 1}, ValueError, r"field 'image'.*shape \(2, 3\).*\(3, 2\)"),
        ({"image": np.zeros((2, 3, 1), np.uint8), "label": 1}, ValueError, "field 'image'.*shape"),
        ({"image": np.zeros((2, 3), np.float32), "label": 1}, TypeError, "field 'image'.*float32"),
        ({"image": np.zeros((2, 3), np.int16), "label": 1}, TypeError, "field 'image'.*int16"),
        ({"image": np.zeros((2, 3), np.uint8), "label": 1.5}, TypeError, "field 'label'.*Python float"),
        ({"image": np.zeros((2, 3), np.uint8), "label": np.float64(1.5)}, TypeError, "field 'label'.*float64"),
        ({"image": np.zeros((2, 3), np.uint8), "label": None}, TypeError, "field 'label'"),
        ({"image": np.zeros((2, 3), np.uint8), "label": "7"}, TypeError, "field 'label'"),
        ({"image": np.zeros((2, 3), np.uint8), "label": 1 << 70}, OverflowError, "field 'label'.*out of range"),
        ({"image": [[1, 2, 3], [4, 5, 300]], "label": 1}, OverflowError, "field 'image'.*300"),
        ({"image": [[1, 2, 3], [4, 5, -1]], "label": 1}, OverflowError, "field 'image'.*-1"),
        ({"image": [[1, 2, 3], [4, 5, 0.5]], "label": 1}, TypeError, "field 'image'"),
        ({"image": np.zeros((2, 3), object), "label": 1}, TypeError, "field 'image'"),
        ({"image": np.zeros((2, 3), np.uint8), "label": np.zeros(1, np.int64)}, ValueError, "field 'label'.*shape"),
    ],
)
def test_bad_examples_are_rejected_and_not_stored(buf, example, error, pattern):
    with pytest.raises(error, match=pattern):
        buf.put(example)
    assert buf.stats()["fresh"] == 0


@pytest.mark.parametrize(
    "examples,error,pattern",
    [
        ({"image": np.zeros((5, 2, 3), np.uint8), "label": np.zeros(4, np.int64)}, ValueError, r"field 'label'.*\(5,\)"),
        ({"image": np.zeros((2, 3), np.uint8), "label": np.zeros(2, np.int64)}, ValueError, "field 'image'.*shape"),
        ({"image": np.zeros((5, 2, 3), np.uint8)}, ValueError, "missing"),
        ({"image": np.uint8(3), "label": 1}, ValueError, "leading axis"),
        ([np.zeros((2, 3))], TypeError, "dict of stacked arrays"),
        ({"image": np.zeros((2, 2, 3), np.uint8), "label": np.array([1, 2], object)}, TypeError, "field 'label'"),
    ],
)
def test_bad_put_many(buf, examples, error, pattern):
    with pytest.raises(error, match=pattern):
        buf.put_many(examples)
    assert buf.stats()["fresh"] == 0


@pytest.mark.parametrize("timeout,error", [(-1, ValueError), (float("nan"), ValueError), ("1", TypeError), (True, TypeError)])
def test_bad_timeouts(buf, timeout, error):
    with pytest.raises(error, match="timeout"):
        buf.put(good_example(), timeout=timeout)
    with pytest.raises(error, match="timeout"):
        buf.next_batch(timeout=timeout)


def test_accepted_conversions_follow_the_documented_rule():
    buf = dataecho.ShuffleBuffer(
        {"f": ((2,), "float32"), "i": ((), "int32"), "b": ((), "bool"), "big": ((3,), ">i4")},
        capacity=8,
        batch_size=8,
    )
    strided = np.arange(6, dtype=np.float32)[::3]  # non-contiguous: copied
    examples = [
        {"f": np.array([1, 2], np.uint8), "i": np.int16(3), "b": True, "big": [1, 2, 3]},  # safe casts
        {"f": [0.5, float("nan")], "i": 2**31 - 1, "b": np.bool_(False), "big": np.array([4, 5, 6], "<i4")},
        {"f": strided, "i": -(2**31), "b": False, "big": np.arange(3, dtype=np.int8)},
        {"f": np.array([3.0, 4.0], np.float32)[::-1], "i": True, "b": 1 == 1, "big": (7, 8, 9)},
    ]
    for ex in examples:
        buf.put(ex)
    buf.close()
    batch = next(iter(buf))
    assert batch["f"].dtype == np.float32 and batch["big"].dtype == np.dtype(">i4")
    order = np.argsort(batch["i"])
    np.testing.assert_array_equal(batch["i"][order], [-(2**31), 1, 3, 2**31 - 1])
    np.testing.assert_array_equal(batch["f"][order][[0, 2]], [[0.0, 3.0], [1.0, 2.0]])
    np.testing.assert_array_equal(batch["big"][order], [[0, 1, 2], [7, 8, 9], [1, 2, 3], [4, 5, 6]])


def test_read_only_and_byte_swapped_inputs_are_accepted():
    buf = dataecho.ShuffleBuffer(((4,), "int32"), capacity=4, batch_size=4)
    read_only = np.arange(4, dtype=np.int32)
    read_only.flags.writeable = False
    buf.put(read_only)
    buf.put(np.arange(4, 8, dtype=">i4"))
    buf.put_many(np.arange(8, 16, dtype=np.int32).reshape(2, 4))
    buf.close()
    rows = next(iter(buf))
    np.testing.assert_array_equal(np.sort(rows[:, 0]), [0, 4, 8, 12])


def test_private_module_misuse_raises_instead_of_crashing():
    config = _core.BufferConfig()
    config.capacity, config.batch_size = 16, 4
    core = _core.Buffer([((2, 3), np.dtype(np.uint8)), ((), np.dtype(np.int64))], config)
    with pytest.raises(TypeError):
        core.put((np.zeros((2, 3), np.uint8), np.zeros((), np.int64)), None)  # tuple, not list
    with pytest.raises(ValueError):
        core.put([np.zeros((2, 3), np.uint8)], None)  # a field short
    with pytest.raises(ValueError):
        core.put([np.zeros((2, 2), np.uint8), np.zeros((), np.int64)], None)  # wrong size
    with pytest.raises(ValueError):
        core.put([np.zeros((3, 2), np.uint8).T, np.zeros((), np.int64)], None)  # not C-contiguous
    with pytest.raises(TypeError):
        core.put([b"\x00" * 6, np.zeros((), np.int64)], None)  # not an array
    with pytest.raises(ValueError):
        core.put_many([np.zeros((2, 2, 3), np.uint8), np.zeros(3, np.int64)], 2, None)
    core.close()



def native_buffer(*fields: tuple) -> _core.Buffer:
    """A _core.Buffer of ``fields`` (``(shape, dtype)``, -1 first for ragged), as
    only dataecho's own code makes one."""
    config = _core.BufferConfig()
    config.capacity, config.batch_size = 16, 4
    if any(shape[:1] == (-1,) for shape, _ in fields):
        config.pages, config.page_bytes = 16, 4096
    return _core.Buffer([(shape, np.dtype(dtype)) for shape, dtype in fields], config)


# An object array's bytes are PyObject pointers, which a copy would keep without
# a reference: the native layer refuses them, whoever calls it.
OBJECTS = np.array([[object(), object()]])  # one row of two pointers: the 16 bytes of two int64
INTS = np.zeros((1, 2), np.int64)
FIXED, RAGGED = ((2,), np.int64), ((-1, 2), np.int64)


@pytest.mark.parametrize("dtype", [object, [("a", object), ("b", np.int64)]], ids=["object", "struct"])
@pytest.mark.parametrize("shape", [(2,), (-1, 2)], ids=["fixed", "ragged"])
def test_the_native_layer_refuses_a_field_of_python_objects(shape, dtype):
    with pytest.raises(TypeError, match=r"fields\[1\]: dtype .* holds Python objects"):
        native_buffer(FIXED, (shape, dtype))


@pytest.mark.parametrize("fields,put", [
    ((FIXED, RAGGED), lambda core: core.put([OBJECTS[0], INTS], None)),
    ((FIXED, RAGGED), lambda core: core.put([INTS[0], OBJECTS], None)),
    ((FIXED,), lambda core: core.put_many([OBJECTS], 1, None)),
    ((FIXED, RAGGED), lambda core: core.put_each([[OBJECTS[0]], [INTS]], 1, None)),
    ((FIXED, RAGGED), lambda core: core.put_each([(OBJECTS, np.zeros(1, np.int64)), [INTS]], 1, None)),
    ((FIXED, RAGGED), lambda core: core.put_each([[INTS[0]], (OBJECTS, np.array([0, 1]))], 1, None)),
    ((FIXED, RAGGED), lambda core: core.copy_batch([OBJECTS, (INTS, np.array([0, 1]))], 1)),
], ids=["put", "put-ragged", "put_many", "put_each", "put_each-gathered", "put_each-packed", "copy_batch"])
def test_the_native_layer_refuses_an_array_of_python_objects_and_stores_nothing(fields, put):
    core = native_buffer(*fields)
    with pytest.raises(TypeError, match=r"(field|column) [01]: dtype object holds Python objects"):
        put(core)
    core.close()
    assert core.next(1.0)[0] == _core.Status.CLOSED, "nothing was stored"
