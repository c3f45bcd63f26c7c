"""Fuzzing the public surface with Hypothesis.

Every constructor argument, every example given to ``put``/``put_many`` and every
timeout may be anything: random shapes (zero, negative, huge), dtypes (object,
void, strings, datetimes, structured, byte-swapped), layouts (Fortran order,
strided, negative strides, byte-swapped, read-only, unaligned, broadcast,
zero-size) and Python values (NaN, inf, huge ints, bool, None, strings, nested
and ragged lists, objects). The laws:

* a call returns, or raises TypeError / ValueError / OverflowError / MemoryError
  (``put``: also BufferClosed and TimeoutError) whose message names the
  argument or field at fault; never a crash, a hang or a SystemError;
* a call that raises stores nothing; NumPy emits no warning along the way;
* what a put accepts comes out of the buffer intact (values cast by the rule in
  ``dataecho.examples.fields``), exactly as often as the echo factor says, and a batch
  the consumer keeps is never overwritten.

Nothing here can block for long: every ``put`` and ``next_batch`` has a timeout
of at most 0.05 s until the buffer is closed, buffers hold at most a few dozen
small examples, and calls with long (valid) timeouts, and loader epochs, run on
a helper thread that fails the test if they do not return within seconds.

Reproducible: examples are derandomized, so CI runs the same ones on every run
and a failure replays with the command Hypothesis prints (``-k`` on the test).
To explore new examples give a seed, and optionally scale the example counts:

    DATAECHO_FUZZ_SEED=7 DATAECHO_FUZZ_SCALE=10 python -m pytest tests/test_fuzz.py

Deviations this file once found, all fixed, are pinned by plain tests at the end.
"""

from __future__ import annotations

import decimal
import fractions
import math
import operator
import os
import threading
import types
import warnings
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pytest
import support
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from processes import dataecho_threads
from support import PAYLOAD, Ledger, Records, Stream, free_slots, payload_of, shaped

import dataecho

try:
    import torch
except ImportError:  # torch is optional: its tensors are one more array-like
    torch = None

# ---- settings: reproducible by default, explorable on demand ----

_SEED = os.environ.get("DATAECHO_FUZZ_SEED")
_SCALE = float(os.environ.get("DATAECHO_FUZZ_SCALE", "1"))


def fuzz(max_examples: int):
    """Hypothesis settings for this file: derandomized (CI runs the same examples
    every time) unless DATAECHO_FUZZ_SEED is set; no example database."""

    def decorate(test):
        test = settings(
            max_examples=max(1, int(max_examples * _SCALE)),
            deadline=None,
            derandomize=_SEED is None,
            database=None,
            print_blob=True,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
        )(test)
        if _SEED is not None:
            test = hypothesis_seed(int(_SEED))(test)
        if _SCALE > 1:  # more examples take longer than the suite's per-test limit
            test = pytest.mark.timeout(120 * _SCALE)(test)
        return test

    return decorate


def replay_note(name: str) -> None:
    how = f"DATAECHO_FUZZ_SEED={_SEED} " if _SEED else ""
    note(f"replay: {how}python -m pytest tests/test_fuzz.py -k {name} (or the @reproduce_failure line below)")


# ---- checking outcomes ----

NUMBER_ERRORS = (TypeError, ValueError, OverflowError, MemoryError)


def check_error(exc: BaseException, allowed: tuple, names, what: str) -> None:
    """`exc` is one of `allowed` and its message names one of `names`."""
    assert not isinstance(exc, SystemError), f"{what}: SystemError: {exc}"
    assert isinstance(exc, allowed), f"{what}: unexpected {type(exc).__name__}: {exc}"
    message = str(exc)
    assert any(n in message for n in names), f"{what}: {type(exc).__name__} {message!r} names none of {list(names)}"


def bounded(call, seconds: float, on_timeout=None):
    """Runs `call` on a helper thread; fails the test if it does not return in time."""
    task = support.start(call, "fuzz-bounded")
    task.join(seconds)
    if task.is_alive():
        if on_timeout is not None:
            on_timeout()
        task.join(5)
        pytest.fail(f"a call did not return within {seconds} s")
    if task.error is not None:
        raise task.error
    return task.result


def canon(a) -> tuple:
    """A hashable, exact key for one field's value: byte order normalized, NaNs
    made equal, structured values compared field by field (padding ignored)."""
    a = np.asarray(a)
    if a.dtype.names:
        return (a.shape,) + tuple(canon(a[name]) for name in a.dtype.names)
    native = a.astype(a.dtype.newbyteorder("="), copy=True).reshape(-1)
    if native.dtype.kind == "c":
        native = native.view(np.dtype(f"f{native.dtype.itemsize // 2}"))
    if native.dtype.kind == "f":
        native[np.isnan(native)] = np.nan
    return (a.shape, native.dtype.str, native.tobytes())


def to_numpy(leaf) -> np.ndarray:
    return leaf if isinstance(leaf, np.ndarray) else leaf.numpy()


# ---- strategies: odd values for any argument ----

HUGE_INTS = [2**31 - 1, 2**31, 2**31 + 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**100, -(2**63), -(2**100)]
BEYOND_FLOAT = [2**1100, -(2**1100), 10**400]


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque>"


def odd_values():
    """Anything a caller might pass for a number, a flag or a name."""
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 12),
        st.sampled_from(HUGE_INTS + BEYOND_FLOAT),
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.5, 1.0, 1.5, 2.0, 4.0, 4294967295.5, 4294967296.0, 1e300, -0.0]),
        st.text(max_size=4),
        st.sampled_from(["auto", "2", "", "inf", "example", "numpy", "thread"]),
        st.binary(max_size=3),
        st.sampled_from(
            [
                np.int64(4), np.uint64(2**64 - 1), np.int8(-1), np.float32(1.5), np.float64("nan"),
                np.bool_(True), np.longdouble("1e4000"), np.array(3), np.array([2, 3]),
                fractions.Fraction(3, 2), decimal.Decimal("2"), complex(2, 0), [2], (2,), {}, _Opaque(),
            ]
        ),
    )


def _int_like(value) -> int | None:
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _real(value) -> float | None:
    import numbers

    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


def valid_positive_int(value, maximum=None) -> bool:
    n = _int_like(value)
    return n is not None and n >= 1 and (maximum is None or n <= maximum)


def valid_real(value, low=1.0, high=float(1 << 32)) -> bool:
    x = _real(value)
    return x is not None and math.isfinite(x) and low <= x < high


def valid_seed(value) -> bool:
    if value is None:
        return True
    n = _int_like(value)
    return n is not None and 0 <= n < 2**64


def beyond_float(value) -> bool:
    """An int too large for a float."""
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**1023


# ---- strategies: dtypes, shapes, fields ----

NUMERIC = [
    "bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "float32", "float64", "complex64", "complex128",
]
SWAPPED = [">i2", ">u4", ">i8", ">f4", ">f8", ">c16", "<i2", "<f8"]
STRUCTS = [
    np.dtype([("a", "<i4"), ("b", "<f8")]),
    np.dtype([("a", "<i4"), ("b", "<f8")], align=True),
    np.dtype([("x", ">u2"), ("y", "i1", (2,))]),
    np.dtype([("p", [("q", "f4"), ("r", "?")])]),
]
OTHER = ["M8[s]", "M8[ms]", "m8[us]", "S3", "U2", "V4"]
VALUE_DTYPES = [np.dtype(d) for d in NUMERIC + SWAPPED + OTHER] + STRUCTS
# Declarations only (no values are generated for these).
DECL_ONLY = [
    "longdouble", "clongdouble", "M8", "O", "i4,O", "S0", "V0", "U0", "not-a-dtype", None, 7, object,
    float, int, bool, complex, str, bytes, ("i4", (2,)), [("a", "O")], np.dtype([]), "f", "i4,i4",
]


def dims():
    return st.one_of(
        st.integers(1, 3),
        st.integers(1, 3),
        st.integers(-2, 0),
        st.sampled_from([2**31, 2**40, 2**62, 2**63, 2**64, 2**100]),
        st.booleans(),
        st.sampled_from([2.0, 1.5, None, "3", np.int64(2), np.uint8(3), np.int32(-1), (2,)]),
    )


def shape_specs():
    return st.one_of(
        dims(),
        st.lists(dims(), max_size=4),
        st.lists(dims(), max_size=4).map(tuple),
        st.integers(60, 66).map(lambda n: (1,) * n),
    )


def field_specs():
    dtype = st.one_of(st.sampled_from(VALUE_DTYPES + DECL_ONLY), st.text(max_size=3))
    return st.one_of(
        st.tuples(shape_specs(), dtype),
        st.lists(st.integers(1, 3), max_size=3),  # not a (shape, dtype) pair
        st.sampled_from([None, 5, "u1", ((2,),), ((2,), "u1", 3)]),
    )


def odd_fields():
    names = st.one_of(st.text(max_size=3), st.sampled_from([1, None, b"x", ("a",)]))
    return st.one_of(
        field_specs(),
        st.dictionaries(names, field_specs(), max_size=3),
        st.dictionaries(names, field_specs(), max_size=2).map(lambda d: types.MappingProxyType(d)),
    )


@st.composite
def valid_fields(draw, max_elements=8):
    """(fields, single): small valid declarations, a pair or a dict of 1-3 fields."""

    def one():
        shape = tuple(draw(st.lists(st.integers(1, 3), max_size=3).filter(lambda s: math.prod(s) <= max_elements)))
        return shape, draw(st.sampled_from(VALUE_DTYPES))

    if draw(st.booleans()):
        return one(), True
    names = draw(st.lists(st.sampled_from(["a", "b", "image", "label", "é", "x y"]), min_size=1, max_size=3, unique=True))
    return {name: one() for name in names}, False


# ---- the casting rule, as documented in dataecho.examples.fields ----

WEAK_KINDS = {"b": "biufc", "i": "iufc", "f": "fc", "c": "c"}
PY_NUMBERS = (bool, int, float, complex)


@dataclass
class Verdict:
    """What a put must do with one field's value: accept it (and store
    `expected`), or refuse it with one of `errors`."""

    accept: bool
    expected: np.ndarray | None = None
    errors: tuple = ()


def _leaves(value):
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def _quiet(call):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return call()


def _cast_expected(array: np.ndarray, dtype: np.dtype) -> tuple[np.ndarray, bool]:
    """array cast to dtype, and whether NumPy warned (an overflow)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = np.array(array, dtype=dtype, order="C")
    return out, bool(caught)


def field_verdict(value, dtype: np.dtype, shape: tuple) -> Verdict:
    leaves = list(_leaves(value))
    weak = isinstance(value, PY_NUMBERS + (list, tuple)) and all(type(v) in PY_NUMBERS for v in leaves)
    if not weak:
        # Arrays, NumPy scalars, lists holding NumPy values, other array-likes: 'safe'.
        try:
            array = _quiet(lambda: np.asarray(value))
        except Exception:
            return Verdict(False, errors=(TypeError,))
        if array.dtype.hasobject:
            return Verdict(False, errors=(TypeError,))
        errors = ()
        if not np.can_cast(array.dtype, dtype, "safe"):
            errors += (TypeError,)
        if array.shape != shape:
            errors += (ValueError,)
        if errors:
            return Verdict(False, errors=errors)
        try:
            return Verdict(True, _cast_expected(array, dtype)[0])
        except OverflowError:  # NumPy 2.5 raises where earlier versions warned (datetime64 units)
            return Verdict(False, errors=(OverflowError,))
    # Python numbers and (nested) lists or tuples of only them: "weak" values,
    # checked for kind, then shape, then range.
    try:
        inferred = _quiet(lambda: np.asarray(value))
    except Exception:  # ragged
        return Verdict(False, errors=(TypeError,))
    kind = (
        "c" if any(type(v) is complex for v in leaves)
        else "f" if any(type(v) is float for v in leaves) or not leaves
        else "i" if any(type(v) is int for v in leaves)
        else "b"
    )
    if dtype.kind not in WEAK_KINDS[kind]:
        return Verdict(False, errors=(TypeError,))
    if inferred.shape != shape:
        return Verdict(False, errors=(ValueError,))
    if dtype.kind in "iu":  # any int in range, however large
        info = np.iinfo(dtype)
        if any(not info.min <= int(v) <= info.max for v in leaves):
            return Verdict(False, errors=(OverflowError,))
        return Verdict(True, np.array([int(v) for v in leaves], dtype=dtype).reshape(shape))
    if dtype.kind == "b":
        return Verdict(True, np.array(leaves, dtype=dtype).reshape(shape))
    # Float or complex: every finite value must stay finite.
    try:
        if dtype.kind == "c":
            wide = np.array([complex(v) for v in leaves], dtype=np.complex128)
        else:
            wide = np.array([float(v) for v in leaves], dtype=np.float64)
    except OverflowError:  # an int beyond float range
        return Verdict(False, errors=(OverflowError,))
    expected, overflowed = _cast_expected(wide.reshape(shape), dtype)
    if overflowed:
        return Verdict(False, errors=(OverflowError,))
    return Verdict(True, expected)


# ---- strategies: values for a field ----


@st.composite
def array_of(draw, dtype: np.dtype, shape: tuple) -> np.ndarray:
    if dtype.kind == "V" or dtype.names or draw(st.integers(0, 3)) == 0:
        n = math.prod(shape) * dtype.itemsize
        raw = draw(st.binary(min_size=n, max_size=n))
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    return draw(hnp.arrays(dtype, shape))


LAYOUTS = ["C", "F", "strided", "reversed", "swapped", "readonly", "unaligned", "broadcast"]


def relayout(array: np.ndarray, layout: str) -> np.ndarray:
    """The same values in another memory layout."""
    if layout == "F":
        return np.asfortranarray(array)
    if layout == "strided" and array.ndim:
        wide = np.zeros(array.shape[:-1] + (2 * array.shape[-1],), array.dtype)
        wide[..., ::2] = array
        return wide[..., ::2]
    if layout == "reversed" and array.ndim:
        return np.flip(np.flip(array).copy())
    if layout == "swapped" and array.dtype.newbyteorder() != array.dtype:
        return array.astype(array.dtype.newbyteorder())
    if layout == "readonly":
        copy = array.copy()
        copy.flags.writeable = False
        return copy
    if layout == "unaligned" and array.dtype.itemsize > 1:
        out = np.frombuffer(bytearray(array.nbytes + 1), array.dtype, count=array.size, offset=1).reshape(array.shape)
        out[...] = array
        return out
    if layout == "broadcast" and array.size:
        return np.broadcast_to(array.reshape(-1)[0], array.shape)
    return array


def python_number(kind_hint: str):
    return st.one_of(
        st.booleans(),
        st.integers(-300, 300),
        st.sampled_from([0, 1, -1, 127, 128, 255, 256, 2**15, 2**31 - 1, 2**31, 2**32, 2**53 + 1] + HUGE_INTS + BEYOND_FLOAT[:1]),
        st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
        st.sampled_from([float("nan"), float("inf"), -float("inf"), -0.0, 1e300, 65504.0, 65520.0, 3.5e38, 5e-324]),
        st.complex_numbers(allow_nan=True, allow_infinity=True),
    ) if kind_hint == "any" else {
        "b": st.booleans(),
        "i": st.one_of(st.integers(-128, 255), st.sampled_from(HUGE_INTS)),
        "f": st.one_of(st.floats(width=16), st.floats(width=32), st.floats()),
    }[kind_hint]


@st.composite
def nested(draw, shape: tuple, leaf):
    if not shape:
        return draw(leaf)
    items = [draw(nested(shape[1:], leaf)) for _ in range(shape[0])]
    return tuple(items) if draw(st.integers(0, 4)) == 0 else items


JUNK = [None, "abc", b"ab", _Opaque(), {}, {"a": 1}, [None], [[1], [1, 2]], [1, "a"], set(), Ellipsis, print, [], [[]]]


@st.composite
def field_value(draw, dtype: np.dtype, shape: tuple, fit: bool = False):
    """A value meant for a field of `dtype` and `shape` (batch axis included for
    put_many): right, castable, wrong in one way, or junk; with `fit`, meant to
    be accepted (the right dtype, a castable one, or Python numbers)."""
    if fit:
        how = draw(st.sampled_from(["exact", "exact", "castable", "weak_fit"]))
    else:
        how = draw(st.sampled_from(["castable", "uncastable", "wrong_shape", "weak", "weak", "weak", "junk", "array_like", "array_like"]))
    if how == "weak_fit" and dtype.kind not in "biufc":
        how = "exact"
    note(f"value made as: {how}")
    if how in ("castable", "uncastable"):
        pool = [d for d in VALUE_DTYPES if d != dtype and bool(np.can_cast(d, dtype, "safe")) == (how == "castable")]
        if pool:
            dtype = draw(st.sampled_from(pool))
    if how == "wrong_shape":
        shape = tuple(draw(st.lists(st.integers(0, 3), max_size=4).filter(lambda s: tuple(s) != shape)))
    if how in ("exact", "castable", "uncastable", "wrong_shape"):
        array = draw(array_of(dtype, shape))
        for layout in draw(st.lists(st.sampled_from(LAYOUTS), max_size=2)):
            array = relayout(array, layout)
        return array
    if how == "weak_fit":
        if dtype.kind in "iu":
            info = np.iinfo(dtype)
            leaf = st.one_of(st.booleans(), st.integers(int(info.min), int(info.max)))
        elif dtype.kind == "f":
            leaf = st.one_of(st.booleans(), st.integers(-(2**63), 2**63 - 1), st.floats(width=min(64, 8 * dtype.itemsize)))
        elif dtype.kind == "c":
            leaf = st.one_of(st.integers(-1000, 1000), st.floats(width=min(64, 4 * dtype.itemsize)), st.complex_numbers(width=min(128, 8 * dtype.itemsize)))
        else:
            leaf = st.booleans()
        return draw(nested(shape, leaf))
    if how == "weak":
        if draw(st.integers(0, 5)) == 0:  # a shape that is off by one somewhere
            shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
        if dtype.kind in "iu" and draw(st.integers(0, 3)):  # near and beyond the field's range
            info = np.iinfo(dtype)
            leaf = st.one_of(st.integers(int(info.min) - 300, int(info.max) + 300), st.sampled_from(HUGE_INTS), st.booleans())
        elif dtype.kind in "fc" and draw(st.integers(0, 3)):
            leaf = st.one_of(python_number("f"), st.sampled_from([1e300, -1e300, 3.5e38, 65520.0, 2**70, 2**64]))
        else:
            leaf = python_number({"b": "b", "f": "f"}.get(dtype.kind, "any") if draw(st.booleans()) else "any")
        return draw(nested(shape, leaf))
    if how == "junk":
        return draw(st.sampled_from(JUNK))
    # array_like: NumPy scalars, lists of NumPy values, memoryviews, masked arrays, tensors
    array = draw(array_of(draw(st.sampled_from([d for d in VALUE_DTYPES if not d.names])), shape))
    kind = draw(st.sampled_from(["scalar", "list", "memoryview", "masked", "torch"]))
    if kind == "scalar" or not shape or not array.size:
        return array.reshape(-1)[0] if array.size else np.zeros((), array.dtype)[()]
    if kind == "list":
        return list(array)
    if kind == "memoryview" and array.dtype.isnative and array.dtype.kind in "biuf":
        return memoryview(array)
    if kind == "masked":
        return np.ma.masked_array(array, mask=np.zeros(array.shape, bool))
    if kind == "torch" and torch is not None and array.dtype.isnative and array.dtype.kind in "biufc":
        return torch.from_numpy(array.copy())
    return array


# ---- ShuffleBuffer(...) ----

SMALL_BYTES = 1 << 24  # a buffer up to this size is built, used and checked
HUGE_BYTES = 1 << 50  # beyond any machine's memory: must raise MemoryError (or ValueError)


@st.composite
def buffer_arguments(draw):
    """Keyword arguments for ShuffleBuffer and the names of those drawn from the
    odd pool (which may or may not be valid)."""
    odd = set()
    # Most examples have one odd argument or none, so that the checks of each
    # argument and the buffers built from valid ones get their share.
    odd_rate = draw(st.sampled_from([0, 0, 0, 1, 1, 1, 2, 5]))

    def pick(name, valid):
        if odd_rate and draw(st.integers(0, 10)) < odd_rate:
            odd.add(name)
            return draw(odd_values())
        return draw(valid)

    scenario = draw(st.sampled_from(["small"] * 8 + ["huge"]))
    if scenario == "huge":
        nbytes = draw(st.sampled_from([2**30, 2**34, 2**40]))
        kwargs = {
            "fields": ((nbytes,), "uint8"),
            "capacity": draw(st.sampled_from([2**20, 2**24, 2**31])) if nbytes < 2**40 else draw(st.integers(2**10, 2**12)),
            "batch_size": 1,
        }
        return kwargs, odd, scenario
    if draw(st.integers(0, 3)) == 0:
        odd.add("fields")
        fields = draw(odd_fields())
    else:
        fields = draw(valid_fields(max_elements=4096))[0]
    capacity = pick("capacity", st.integers(1, 64))
    cap = _int_like(capacity) or 64
    kwargs = {
        "fields": fields,
        "capacity": capacity,
        "batch_size": pick("batch_size", st.integers(1, max(1, min(cap, 64)))),
        "echo_factor": pick("echo_factor", st.sampled_from([1, 2, 1.5, 2.75, 1e6, "auto", np.float32(1.25), fractions.Fraction(5, 4)])),
        "seed": pick("seed", st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        "drop_last": pick("drop_last", st.booleans()),
        "prefetch": pick("prefetch", st.one_of(st.integers(1, 4), st.just(1 << 16))),
        "initial": pick("initial", st.one_of(st.none(), st.integers(1, max(1, min(cap, 64))))),
        "max_echo": pick("max_echo", st.sampled_from([1.0, 2.5, 4, 1e9])),
    }
    # Leave some out (not the sizes: the defaults, 4096 and 256, are not small).
    optional = sorted(set(kwargs) - {"fields", "capacity", "batch_size"})
    for name in draw(st.lists(st.sampled_from(optional), max_size=3, unique=True)):
        del kwargs[name]
        odd.discard(name)
    return kwargs, odd, scenario


def invalid_arguments(kwargs: dict) -> set[str]:
    """The arguments (other than fields) that the documented contract refuses."""
    bad = set()
    capacity, batch = kwargs.get("capacity", 4096), kwargs.get("batch_size", 256)
    if not valid_positive_int(capacity, 2**31):
        bad.add("capacity")
    if not valid_positive_int(batch) or (not bad and operator.index(batch) > operator.index(capacity)):
        bad.add("batch_size")
    echo = kwargs.get("echo_factor", 1.0)
    if not (echo == "auto" if isinstance(echo, str) else valid_real(echo)):
        bad.add("echo_factor")
    if not valid_real(kwargs.get("max_echo", 4.0)):
        bad.add("max_echo")
    if not valid_seed(kwargs.get("seed")):
        bad.add("seed")
    if not isinstance(kwargs.get("drop_last", False), bool):
        bad.add("drop_last")
    if not valid_positive_int(kwargs.get("prefetch", 2), 1 << 16):
        bad.add("prefetch")
    initial = kwargs.get("initial")
    if initial is not None and not (valid_positive_int(initial) and "capacity" not in bad and operator.index(initial) <= operator.index(capacity)):
        bad.add("initial")
    return bad


def smoke(buf: dataecho.ShuffleBuffer, data) -> None:
    """Puts batch_size examples of random bytes, closes, and checks the first
    batch holds only those examples, byte for byte."""
    fields = buf.fields
    n = buf.batch_size
    rows = []
    for _ in range(n):
        example = {}
        for f in fields:
            raw = data.draw(st.binary(min_size=f.nbytes, max_size=f.nbytes), label=f"bytes of {f.label()}")
            example[f.name] = np.frombuffer(raw, f.dtype).reshape(f.shape)
        buf.put(example[None] if len(fields) == 1 and fields[0].name is None else example, timeout=1)
        rows.append(tuple(canon(example[f.name]) for f in fields))
    buf.close()
    batch = buf.next_batch(timeout=10)
    arrays = [batch] if fields[0].name is None else [batch[f.name] for f in fields]
    for f, a in zip(fields, arrays):
        assert a.dtype == f.dtype and a.shape == (n, *f.shape), f"{f.label()}: batch {a.dtype} {a.shape}"
    put = Counter(rows)
    got = Counter(tuple(canon(a[i, ...]) for a in arrays) for i in range(n))
    assert not got - put, "a batch holds bytes that were never put"


@fuzz(max_examples=400)
@given(buffer_arguments(), st.data())
def test_shuffle_buffer_takes_any_arguments(arguments, data):
    replay_note("test_shuffle_buffer_takes_any_arguments")
    kwargs, odd, scenario = arguments
    bad = invalid_arguments(kwargs)
    if not bad and scenario == "small" and operator.index(kwargs["capacity"]) > 1 << 16:
        # A valid capacity this large may really be allocated (and its rings
        # written) on a large machine: the "huge" scenario covers it safely.
        event("skipped: a valid capacity above 65536")
        return
    unsure = {"fields"} if "fields" in odd else set()
    if scenario == "huge" or unsure:
        unsure |= {"fields", "capacity", "batch_size"}  # sizes: named by whichever overflows
    try:
        buf = dataecho.ShuffleBuffer(**kwargs)
    except Exception as exc:
        assert bad or unsure, f"valid arguments refused: {type(exc).__name__}: {exc}"
        check_error(exc, NUMBER_ERRORS, bad | unsure, "ShuffleBuffer()")
        event(f"refused: {type(exc).__name__}")
        return
    try:
        assert not bad, f"ShuffleBuffer() accepted invalid {sorted(bad)}"
        assert scenario != "huge", "ShuffleBuffer() claimed more memory than any machine has"
        assert buf.capacity == operator.index(kwargs["capacity"]) and buf.batch_size == operator.index(kwargs["batch_size"])
        assert buf.stats()["fresh"] == 0 and not buf.closed
        repr(buf)
        fields = buf.fields
        assert all(len(f.shape) < 64 and f.dtype.subdtype is None for f in fields), fields
        if sum(f.nbytes for f in fields) * buf.capacity <= SMALL_BYTES:
            smoke(buf, data)
            event("built, and examples came out intact")
        else:
            event("built (too large to fill)")
    finally:
        buf.close()


# ---- put / put_many / next_batch ----


@st.composite
def buffer_setup(draw):
    fields, single = draw(valid_fields())
    capacity = draw(st.integers(1, 8))
    kwargs = {
        "capacity": capacity,
        "batch_size": draw(st.integers(1, capacity)),
        "echo_factor": draw(st.sampled_from([1, 2, 3, 1.5, 2.25, "auto"])),
        "prefetch": draw(st.integers(1, 3)),
        "seed": draw(st.integers(0, 2**64 - 1)),
        "drop_last": draw(st.sampled_from([False, False, True])),
        "initial": draw(st.one_of(st.none(), st.integers(1, capacity))),
    }
    if kwargs["echo_factor"] == "auto":
        kwargs["max_echo"] = draw(st.sampled_from([1.0, 1.5, 3.0]))
    return fields, single, kwargs


@dataclass
class Expectation:
    """What a put or put_many must do with a whole example."""

    accept: bool
    errors: tuple = ()
    names: tuple = ()
    expected: list | None = None  # per field, rows axis included for put_many
    rows: int | None = None


def expect_put(example, fields, single: bool, many: bool) -> Expectation:
    if not single and not isinstance(example, Mapping):
        return Expectation(False, (TypeError,), ("expected a dict",))
    rows = None
    if many:
        first = example if single else example.get(fields[0].name)
        try:
            shape = _quiet(lambda: np.shape(first)) if first is not None else ()
        except Exception:  # ragged
            return Expectation(False, (TypeError,), (fields[0].label(),))
        if len(shape) < 1:
            return Expectation(False, (ValueError,), ("leading axis",))
        rows = int(shape[0])
        if rows == 0:
            return Expectation(True, rows=0)  # nothing to put, whatever else is there
    if not single:
        names = [f.name for f in fields]
        if len(example) != len(names) or any(n not in example for n in names):
            return Expectation(False, (ValueError,), ("missing", "unexpected"))
    values = [example] if single else [example[f.name] for f in fields]
    verdicts = [field_verdict(v, f.dtype, f.shape if rows is None else (rows, *f.shape)) for v, f in zip(values, fields)]
    refused = [(v, f) for v, f in zip(verdicts, fields) if not v.accept]
    if refused:
        # Fields are converted in order: the first refused one raises.
        return Expectation(False, refused[0][0].errors, (refused[0][1].label(),))
    return Expectation(True, expected=[v.expected for v in verdicts], rows=rows)


def draw_example(data, fields, single: bool, rows: int | None):
    # Half the examples are meant to fit, so that buffers fill and batches flow.
    fit = data.draw(st.booleans(), label="meant to fit")

    def value_for(f, r):
        shape = f.shape if r is None else (r, *f.shape)
        return data.draw(field_value(f.dtype, shape, fit), label=f"value for {f.label()}")

    if single:
        return value_for(fields[0], rows)
    mutations = ["none"] if fit else ["none"] * 3 + ["missing", "extra", "not_a_dict", "mapping", "other_rows"]
    mutation = data.draw(st.sampled_from(mutations))
    example = {}
    for i, f in enumerate(fields):
        last = i == len(fields) - 1
        r = data.draw(st.integers(0, 4)) if mutation == "other_rows" and last and rows is not None else rows
        example[f.name] = value_for(f, r)
    if mutation == "missing":
        del example[data.draw(st.sampled_from(sorted(example)))]
    elif mutation == "extra":
        example["extra"] = np.zeros(1)
    elif mutation == "not_a_dict":  # (drawn by index: sampled_from hashes its elements)
        example = [list(example.values()), tuple(example.items()), None, np.zeros(2)][data.draw(st.integers(0, 3))]
    elif mutation == "mapping":
        example = [types.MappingProxyType(example), OrderedDict(reversed(list(example.items())))][data.draw(st.integers(0, 1))]
    return example


def attempt(call, *args, **kwargs):
    """(exception or None, warnings) of one call; warnings are recorded, not raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call(*args, **kwargs)
            error = None
        except Exception as exc:  # judged by the caller
            error = exc
    return error, [f"{w.category.__name__}: {w.message}" for w in caught]


def echo_bounds(kwargs) -> tuple[int, int]:
    echo = kwargs.get("echo_factor", 1.0)
    if echo == "auto":
        return 1, math.floor(kwargs.get("max_echo", 4.0)) + 1
    return support.echo_bounds(echo)


def record_batch(batch, fields, single: bool, batch_size: int, ledger: Ledger, kept: list) -> None:
    """Checks a batch's shape, counts its rows (by value) as delivered, and keeps
    it alive with its row keys in `kept`."""
    if single:
        arrays = [batch]
    else:
        assert isinstance(batch, dict) and list(batch) == [f.name for f in fields], f"batch keys {list(batch)}"
        arrays = [batch[f.name] for f in fields]
    rows = len(arrays[0])
    assert 1 <= rows <= batch_size, f"a batch of {rows} rows (batch_size {batch_size})"
    for f, a in zip(fields, arrays):
        assert isinstance(a, np.ndarray) and a.dtype == f.dtype, f"{f.label()}: {type(a)} {getattr(a, 'dtype', '')}"
        assert a.shape == (rows, *f.shape), f"{f.label()}: batch shape {a.shape}"
    keys = [tuple(canon(a[i, ...]) for a in arrays) for i in range(rows)]
    ledger.deliver(keys)
    kept.append((arrays, keys))


def do_put(buf, data, fields, single, many, closed, ledger: Ledger) -> None:
    rows = data.draw(st.integers(0, 4), label="rows") if many else None
    example = draw_example(data, fields, single, rows)
    expectation = expect_put(example, fields, single, many)
    timeout = data.draw(st.sampled_from([0, 0.001, 0.01, 0.03]), label="timeout")
    where = "put_many()" if many else "put()"
    before = buf.stats()["fresh"]
    error, warned = attempt(buf.put_many if many else buf.put, example, timeout=timeout)
    stored = buf.stats()["fresh"] - before
    note(f"{where}: expected {expectation.accept}, got {type(error).__name__}: {error}; stored {stored}")
    assert not warned, f"{where} warned: {warned}"
    if error is None:
        assert expectation.accept, f"{where} accepted a value the casting rule refuses"
        count = 1 if not many else expectation.rows
        assert not closed or count == 0, f"{where} succeeded on a closed buffer"
        assert stored == count, f"{where} returned but stored {stored} of {count}"
        put_rows(expectation, count, many, ledger)
        return
    assert not isinstance(error, SystemError), f"{where}: SystemError {error}"
    if isinstance(error, dataecho.BufferClosed):
        assert closed, f"{where}: BufferClosed on an open buffer"
        assert stored == 0 and getattr(error, "examples_put", 0) == 0
        return
    if isinstance(error, TimeoutError):
        assert not closed, f"{where}: TimeoutError on a closed buffer (expected BufferClosed)"
        assert expectation.accept, f"{where}: a refused value timed out instead of raising"
        done = getattr(error, "examples_put", 0) if many else 0
        assert stored == done, f"{where} timed out having stored {stored}, reported {done}"
        put_rows(expectation, done, many, ledger)
        return
    assert stored == 0, f"{where} raised {type(error).__name__} but stored {stored} examples"
    if expectation.accept:
        pytest.fail(f"{where} refused a valid value: {type(error).__name__}: {error}")
    check_error(error, expectation.errors, expectation.names, where)


def put_rows(expectation: Expectation, count: int, many: bool, ledger: Ledger) -> None:
    if not count:
        return
    if not many:
        ledger.accept([tuple(canon(e) for e in expectation.expected)])
        return
    ledger.accept(tuple(canon(e[i, ...]) for e in expectation.expected) for i in range(count))


@fuzz(max_examples=300)
@given(buffer_setup(), st.data())
def test_put_and_next_batch_take_any_example(setup, data):
    replay_note("test_put_and_next_batch_take_any_example")
    declaration, single, kwargs = setup
    buf = dataecho.ShuffleBuffer(declaration, **kwargs)
    fields, batch_size = buf.fields, buf.batch_size
    ledger = Ledger()
    kept: list = []  # (arrays, row keys) of every batch, kept alive
    closed = ended = False
    try:
        operations = data.draw(st.lists(st.sampled_from(["put", "put", "put", "put_many", "next", "next"]), min_size=1, max_size=16), label="operations")
        close_at = data.draw(st.one_of(st.none(), st.integers(0, len(operations))), label="close before operation")
        for i, operation in enumerate(operations + ["end"]):
            if i == close_at:
                buf.close()
                closed = True
            if operation == "end":
                break
            if operation == "next":
                try:
                    batch = buf.next_batch(timeout=data.draw(st.sampled_from([0, 0.001, 0.02]), label="timeout"))
                except TimeoutError:
                    assert not ended, "TimeoutError after the end"
                    continue
                except StopIteration:
                    assert closed, "StopIteration from an open buffer"
                    ended = True
                    continue
                assert not ended, "a batch after the end"
                record_batch(batch, fields, single, batch_size, ledger, kept)
            else:
                do_put(buf, data, fields, single, operation == "put_many", closed, ledger)
        buf.close()
        for _ in range(10_000):
            try:
                batch = buf.next_batch(timeout=5)
            except StopIteration:
                break
            except TimeoutError:
                pytest.fail("no batch within 5 s after close(): the buffer hangs")
            record_batch(batch, fields, single, batch_size, ledger, kept)

        # Kept batches were never overwritten.
        for arrays, keys in kept:
            assert [tuple(canon(a[i, ...]) for a in arrays) for i in range(len(keys))] == keys, "a live batch changed"
        # Only the last batch may be short (none with drop_last).
        assert all(n == batch_size for n in ledger.sizes[:-1]), f"short batch before the end: {ledger.sizes}"
        if kwargs["drop_last"] and ledger.sizes:
            assert ledger.sizes[-1] == batch_size
        # Exact accounting per example (by value: equal examples share a key).
        low, high = echo_bounds(kwargs)
        invented = set(ledger.delivered) - set(ledger.accepted)
        assert not invented, f"delivered {len(invented)} example(s) that were never put, or corrupted"
        for key, m in ledger.accepted.items():
            got = ledger.delivered[key]
            floor = 0 if kwargs["drop_last"] else m * low
            assert floor <= got <= m * high, f"an example put {m} time(s) was delivered {got} times (echo {low}..{high})"
        stats = buf.stats()
        assert stats["fresh"] == sum(ledger.accepted.values())
        assert stats["delivered"] == sum(ledger.sizes) and stats["batches"] == len(ledger.sizes)
        assert stats["resident"] == 0 and free_slots(buf) == buf.capacity, "a slot was not returned"
        if kwargs["drop_last"] and low == high:
            assert stats["delivered"] + stats["dropped"] == stats["fresh"] * low
        event(f"examples put: {min(sum(ledger.accepted.values()), 10)}{'+' if sum(ledger.accepted.values()) >= 10 else ''}")
    finally:
        buf.close()


# ---- timeouts ----


@fuzz(max_examples=150)
@given(odd_values(), st.sampled_from(["put", "put_closed", "put_many", "next_closed", "next_empty"]))
def test_timeouts_of_any_type_are_checked_or_honoured(timeout, where):
    replay_note("test_timeouts_of_any_type_are_checked_or_honoured")
    seconds = None if timeout is None else _real(timeout)
    # None waits forever (and so does inf); an int beyond float range is refused.
    valid = timeout is None or (seconds is not None and not math.isnan(seconds) and seconds >= 0 and not beyond_float(timeout))
    buf = dataecho.ShuffleBuffer({"id": ((), "int64")}, capacity=4, batch_size=2, seed=0)
    try:
        if where in ("put_closed", "next_closed"):
            buf.put_many({"id": np.arange(3)}, timeout=1)
            buf.close()
        calls = {
            "put": lambda: buf.put({"id": 7}, timeout=timeout),
            "put_closed": lambda: buf.put({"id": 7}, timeout=timeout),
            "put_many": lambda: buf.put_many({"id": np.arange(2)}, timeout=timeout),
            "next_closed": lambda: buf.next_batch(timeout=timeout),
            "next_empty": lambda: buf.next_batch(timeout=timeout),
        }
        if where == "next_empty" and valid and (seconds is None or seconds > 0.05):
            # A long wait must really wait, and close() must end it.
            result: dict = {}

            def wait():
                try:
                    buf.next_batch(timeout=timeout)
                except BaseException as exc:  # judged below
                    result["error"] = exc

            waiter = threading.Thread(target=wait, daemon=True)
            waiter.start()
            waiter.join(0.06)
            assert waiter.is_alive() or isinstance(result.get("error"), TimeoutError) and seconds <= 0.2, (
                f"next_batch(timeout={timeout!r}) returned early: {result}"
            )
            buf.close()
            waiter.join(5)
            assert not waiter.is_alive(), "close() did not end a waiting next_batch()"
            assert isinstance(result.get("error"), (StopIteration, TimeoutError)), result
            return
        try:
            bounded(calls[where], 5, on_timeout=buf.close)
        except Exception as exc:
            if valid:
                expected = {
                    "put_closed": dataecho.BufferClosed,
                    # The batch may still be in the making when the wait is short.
                    "next_closed": TimeoutError if seconds is not None and seconds < 1 else None,
                    "next_empty": TimeoutError,
                }.get(where)
                assert expected is not None and isinstance(exc, expected), f"{where}: {type(exc).__name__}: {exc}"
                return
            check_error(exc, (TypeError, ValueError), ["timeout"], where)
            return
        assert valid, f"{where} accepted timeout={timeout!r}"
        assert where != "put_closed", "put() on a closed buffer returned"
    finally:
        buf.close()


# ---- EchoLoader(...) and its epochs ----


def _map_payload(example, fn):
    if isinstance(example, dict):
        return {"id": example["id"], "payload": fn(example["payload"])}
    if isinstance(example, tuple):
        return (example[0], fn(example[1]))
    return fn(example)


# On the uint8 payload these wrap around; check_epoch computes the same.
def doubled(example):
    return _map_payload(example, lambda x: x * 2)


def plus_one(example):
    return _map_payload(example, lambda x: x + 1)


ODD_SOURCES = ["abc", b"", [None], [_Opaque()], [np.zeros(0)], [{"a": 1}, {"b": 1}], [1, 2.5], [2**70], {"a": 1}, [np.zeros((1,) * 64)]]


@st.composite
def loader_arguments(draw):
    odd = set()
    odd_rate = draw(st.sampled_from([0, 0, 0, 1, 1, 2]))  # in 20

    def pick(name, valid, extra=()):
        if odd_rate and draw(st.integers(0, 19)) < odd_rate:
            odd.add(name)
            return draw(st.one_of(odd_values(), st.sampled_from(list(extra) or [None])))
        return draw(valid)

    n = draw(st.integers(0, 30))
    form = draw(st.sampled_from(["dict", "tuple", "scalar"]))
    sources = [Records(n, form=form), Stream(n, form=form), [shaped(i, form) for i in range(n)]]
    if form == "scalar":
        sources.append(np.arange(n))
    kwargs = {"dataset": pick("dataset", st.sampled_from(sources), ODD_SOURCES)}
    kwargs["batch_size"] = pick("batch_size", st.integers(1, 6))
    batch = _int_like(kwargs["batch_size"]) or 1
    choices = [np.array(["example", "batch"]), np.str_("batch"), "Example", None, 1]
    kwargs.update(
        echo_factor=pick("echo_factor", st.sampled_from([1, 2, 3, 1.5, 2.5, "auto"])),
        echo_at=pick("echo_at", st.sampled_from(["example", "batch"]), choices),
        transform=pick("transform", st.sampled_from([None, doubled]), [print, "f"]),
        augment=pick("augment", st.sampled_from([None, plus_one]), [print, 3]),
        shuffle_buffer=pick("shuffle_buffer", st.one_of(st.none(), st.integers(max(1, min(batch, 64)), 64))),
        num_workers=pick("num_workers", st.integers(1, 3), [1024, 1025]),
        shuffle=pick("shuffle", st.booleans()),
        seed=pick("seed", st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        drop_last=pick("drop_last", st.booleans()),
        prefetch_factor=pick("prefetch_factor", st.integers(1, 3)),
        max_echo=pick("max_echo", st.sampled_from([1.0, 2.5, 4])),
        output=pick("output", st.sampled_from(["numpy", "torch"] if torch is not None else ["numpy"]), choices),
        pin_memory=pick("pin_memory", st.just(False)),
        device=pick("device", st.sampled_from([None, None, "cpu"] if torch is not None else [None]), ["cuda:x", "meta", -1, 2**64]),
        worker_type=pick("worker_type", st.sampled_from(["thread"] * 6 + ["process"]), choices),
    )
    # DataLoader's multiprocessing_context means worker processes: drawn for them.
    processes = isinstance(kwargs["worker_type"], str) and kwargs["worker_type"] == "process"
    methods = [None, "spawn", "forkserver"] if processes else [None]
    kwargs["multiprocessing_context"] = pick("multiprocessing_context", st.sampled_from(methods),
                                             ["fork", "spawn", np.array(["a", "b"])])
    for name in draw(st.lists(st.sampled_from(sorted(kwargs)), max_size=3, unique=True)):
        if name != "dataset":
            del kwargs[name]
            odd.discard(name)
    return kwargs, odd, n, form


def _choice(value, options) -> bool:
    return isinstance(value, str) and value in options


def invalid_loader_arguments(kw: dict) -> tuple[set, set]:
    """(arguments the contract refuses, arguments that may be refused or not)."""
    from collections.abc import Iterable

    bad, unsure = set(), set()
    source = kw["dataset"]
    map_style = hasattr(source, "__len__") and hasattr(source, "__getitem__") and not isinstance(source, (str, bytes))
    if not (map_style or isinstance(source, Iterable)):
        bad.add("dataset")
    batch = kw.get("batch_size", 1)
    if not valid_positive_int(batch):
        bad.add("batch_size")
    echo = kw.get("echo_factor", 2.0)
    if not (echo == "auto" if isinstance(echo, str) else valid_real(echo)):
        bad.add("echo_factor")
    echo_at = kw.get("echo_at", "example")
    if not _choice(echo_at, ("example", "batch")):
        bad.add("echo_at")
        echo_at = None  # (an array would not compare)
    for name in ("transform", "augment"):
        if kw.get(name) is not None and not callable(kw[name]):
            bad.add(name)
    # Each of an epoch's buffers holds at most 2**31 examples: shuffle_buffer
    # examples, or 2 batches (echo_at="batch"), or 4 (after augment).
    buffer = kw.get("shuffle_buffer")
    if buffer is not None and not valid_positive_int(buffer, 2**31):
        bad.add("shuffle_buffer")
    elif echo_at == "example" and "batch_size" not in bad:
        if (4096 if buffer is None else operator.index(buffer)) < operator.index(batch):
            bad.add("shuffle_buffer")
    held = 4 if kw.get("augment") is not None else 2 if echo_at == "batch" else 1
    if "batch_size" not in bad and operator.index(batch) * held > 2**31:
        bad.add("batch_size")
    # None stands for the default where DataLoader's names may give the value instead.
    workers = kw.get("num_workers")
    if workers is not None and not (valid_positive_int(workers, 1024) or _int_like(workers) == 0):
        bad.add("num_workers")
    for name in ("shuffle", "drop_last", "pin_memory"):
        if not isinstance(kw.get(name, False), bool) and not (name == "shuffle" and kw[name] is None):
            bad.add(name)
    if not valid_seed(kw.get("seed")):
        bad.add("seed")
    factor = kw.get("prefetch_factor")
    if factor is not None and (not valid_positive_int(factor, 1 << 16) or _int_like(workers) == 0):
        bad.add("prefetch_factor")  # per worker, as in DataLoader: not with num_workers=0
    if not valid_real(kw.get("max_echo", 4.0)):
        bad.add("max_echo")
    if not _choice(kw.get("output", "numpy"), ("numpy", "torch")):
        bad.add("output")
    if kw.get("pin_memory") is True:
        unsure.add("pin_memory")  # needs CUDA
    if kw.get("device") is not None:
        unsure.add("device")
    method = kw.get("multiprocessing_context")
    worker_type = kw.get("worker_type")
    if worker_type is None:
        worker_type = "thread" if method is None else "process"
    if not _choice(worker_type, ("thread", "process")):
        bad.add("worker_type")
    elif method is not None and worker_type != "process":
        bad.add("multiprocessing_context")  # it means worker processes
    elif worker_type == "process":
        if workers is not None and _int_like(workers) == 0:
            bad |= {"num_workers", "multiprocessing_context"}  # 0 reads in the calling thread
        if method is not None and not _choice(method, ("spawn", "forkserver")):
            bad.add("multiprocessing_context")
        unsure |= {"dataset", "transform"}  # must be picklable
    return bad, unsure


def run_epochs(loader, epochs: int) -> list[list]:
    return [list(loader) for _ in range(epochs)]


def check_epoch(batches, kw: dict, n: int, form: str) -> int:
    """Exact accounting of one epoch from a source of `n` examples of `form`."""
    batch_size = kw.get("batch_size", 1)
    transform, augment = kw.get("transform"), kw.get("augment")

    def f(x):
        return (x * 2 if transform else x) + (1 if augment else 0)

    ids = Counter()
    for batch in batches:
        if form == "dict":
            assert isinstance(batch, dict) and sorted(batch) == ["id", "payload"]
            id_, x = to_numpy(batch["id"]), to_numpy(batch["payload"])
        elif form == "tuple":
            assert isinstance(batch, tuple) and len(batch) == 2
            id_, x = to_numpy(batch[0]), to_numpy(batch[1])
        else:
            id_, x = to_numpy(batch), None
        assert 1 <= len(id_) <= batch_size
        if x is not None:
            assert x.shape == (len(id_), PAYLOAD)
            np.testing.assert_array_equal(x, f(payload_of(id_)))
        ids.update(id_.tolist())
    expected_ids = {f(i) for i in range(n)} if form == "scalar" else set(range(n))
    assert set(ids) <= expected_ids, "an example that was never read"
    echo, max_echo = kw.get("echo_factor", 2.0), kw.get("max_echo", 4.0)
    low, high = echo_bounds({"echo_factor": echo, "max_echo": max_echo})
    if kw.get("drop_last", False):
        low = 0
        assert all(len(to_numpy(b if form == "scalar" else (b["id"] if form == "dict" else b[0]))) == batch_size for b in batches)
    for i in expected_ids:
        assert low <= ids[i] <= high, f"example {i} delivered {ids[i]} times (echo {echo}: {low}..{high})"
    return sum(ids.values())


@fuzz(max_examples=250)
@given(loader_arguments(), st.integers(1, 2))
def test_echo_loader_takes_any_arguments(arguments, epochs):
    replay_note("test_echo_loader_takes_any_arguments")
    kw, odd, n, form = arguments
    bad, unsure = invalid_loader_arguments(kw)
    threads_before = dataecho_threads()
    try:
        loader = dataecho.EchoLoader(**kw)
    except Exception as exc:
        assert dataecho_threads() == threads_before, "a failed constructor left threads"
        assert bad or unsure, f"valid arguments refused: {type(exc).__name__}: {exc}"
        allowed = NUMBER_ERRORS + ((RuntimeError,) if unsure & {"pin_memory", "device"} else ())
        check_error(exc, allowed, bad | unsure, "EchoLoader()")
        event(f"refused: {type(exc).__name__}")
        return
    with loader:
        assert not bad, f"EchoLoader() accepted invalid {sorted(bad)}"
        assert dataecho_threads() == threads_before, "the constructor started threads"
        batch, buffer = kw.get("batch_size", 1), kw.get("shuffle_buffer") or 0
        echo = kw.get("echo_factor", 2.0)
        runnable = (
            (kw.get("worker_type") or ("thread" if kw.get("multiprocessing_context") is None else "process")) == "thread"
            and not kw.get("pin_memory", False)
            and kw.get("device") in (None, "cpu")
            and operator.index(batch) <= 64
            and buffer <= 4096
            and operator.index(kw.get("num_workers") or 2) <= 4
            and (echo == "auto" and float(kw.get("max_echo", 4.0)) <= 4 or echo != "auto" and float(echo) <= 4)
        )
        if not runnable:
            event("built (not iterated)")
            return
        # An odd source, or a callable like print for transform or augment,
        # may make examples that fail in the epoch (naming the example).
        odd_source = bool(odd & {"dataset", "transform", "augment"})
        try:
            results = bounded(lambda: run_epochs(loader, epochs), 20, on_timeout=loader.close)
        except Exception as exc:
            assert odd_source, f"an epoch over a valid source failed: {type(exc).__name__}: {exc}"
            assert isinstance(exc, (TypeError, ValueError, KeyError, IndexError, OverflowError)), repr(exc)
            event(f"epoch over an odd source raised {type(exc).__name__}")
            return
        if odd_source:
            event("epoch over an odd source ran")
            return
        event(f"epochs checked ({kw.get('echo_at', 'example')}, {'augment' if kw.get('augment') else 'no augment'}, {type(kw['dataset']).__name__})")
        total = 0
        for batches in results:
            total += check_epoch(batches, kw, n, form)
        stats = loader.stats()
        assert stats["fresh"] == n * epochs and stats["delivered"] == total, stats
    for _ in range(100):
        if dataecho_threads() == threads_before:
            break
        threading.Event().wait(0.02)
    assert dataecho_threads() == threads_before, "an epoch's threads outlived it"


# ---- deviations this file found, pinned ----


def test_a_field_of_64_dimensions_is_refused():
    # NumPy arrays have at most 64 dimensions, and a batch adds one: such a
    # field could not be delivered, so it is refused when declared.
    with pytest.raises(ValueError, match="fields"):
        dataecho.ShuffleBuffer(((1,) * 64, "uint8"), capacity=2, batch_size=1)
    with pytest.raises(ValueError, match=r"fields\['x'\]"):
        dataecho.ShuffleBuffer({"x": ((1,) * 62, ("uint8", (1, 1)))}, capacity=2, batch_size=1)
    buf = dataecho.ShuffleBuffer(((1,) * 63, "uint8"), capacity=2, batch_size=1)
    buf.put(np.full((1,) * 63, 7, np.uint8), timeout=1)
    buf.close()
    batch = buf.next_batch(timeout=5)
    assert batch.shape == (1,) * 64 and batch.reshape(-1).tolist() == [7]


def test_a_subarray_dtype_declares_trailing_axes():
    # As in NumPy: a field of shape (2,) and dtype ('i4', (2,)) holds (2, 2) int32.
    buf = dataecho.ShuffleBuffer(((2,), ("i4", (2,))), capacity=2, batch_size=1)
    assert [(f.shape, f.dtype) for f in buf.fields] == [((2, 2), np.dtype("i4"))]
    buf.put(np.arange(4, dtype=np.int32).reshape(2, 2), timeout=1)
    buf.close()
    np.testing.assert_array_equal(buf.next_batch(timeout=5), [[[0, 1], [2, 3]]])
    with pytest.raises(ValueError, match=r"fields.*positive"):
        dataecho.ShuffleBuffer(((2,), ("i4", (0,))), capacity=2, batch_size=1)


@pytest.mark.parametrize(
    "value,shape",
    [(np.float64(0.1), ()), ([np.float64(0.1)], (1,)), ([np.float64(1e300)], (1,)), ([np.array([0.1, 0.2])], (1, 2)),
     (np.complex128(1j), ()), ([np.int64(1), 2], (2,))],
)
def test_numpy_values_follow_the_safe_rule(value, shape):
    # A NumPy float64 alone, or NumPy values inside a list, are cast like an
    # array of them: float64 into float32 is refused, with no warning.
    buf = dataecho.ShuffleBuffer((shape, "float32"), capacity=2, batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TypeError, match="example"):
            buf.put(value, timeout=1)
    assert buf.stats()["fresh"] == 0


def test_lists_of_numpy_values_that_cast_safely_are_accepted():
    buf = dataecho.ShuffleBuffer(((2,), "int16"), capacity=2, batch_size=1)
    buf.put([np.int8(-3), np.uint8(200)], timeout=1)
    buf.close()
    np.testing.assert_array_equal(buf.next_batch(timeout=5), [[-3, 200]])


@pytest.mark.parametrize(
    "dtype,value",
    [("float32", 1e300), ("float16", 70000.0), ("complex64", 1e300j), ("complex64", complex(1, -1e300)),
     ("float16", 70000), ("float32", 2**200), ("float64", 2**1100), ("float32", [1.0, 1e300])],
)
def test_python_numbers_out_of_range_are_refused(dtype, value):
    # Python ints out of an integer field's range raise OverflowError, and so do
    # finite Python numbers that a float field cannot hold, with no warning.
    shape = np.shape(value)
    buf = dataecho.ShuffleBuffer((shape, dtype), capacity=2, batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(OverflowError, match="example value"):
            buf.put(value, timeout=1)
    assert buf.stats()["fresh"] == 0


def test_python_infinities_and_nans_go_into_float_fields():
    buf = dataecho.ShuffleBuffer(((3,), "float16"), capacity=2, batch_size=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        buf.put([float("inf"), -float("inf"), float("nan")], timeout=1)
    buf.close()
    np.testing.assert_array_equal(buf.next_batch(timeout=5), [[np.inf, -np.inf, np.nan]])


@pytest.mark.parametrize(
    "dtype,shape,value",
    [("uint64", (2,), [2**63, 1]), ("float64", (), 2**70), ("float64", (1,), [2**64]), ("uint64", (), 2**64 - 1),
     ("uint64", (2,), [2**63 + 1, True]), ("int64", (2,), (-(2**63), 2**63 - 1)), ("float32", (2,), [2**100, 0.5])],
)
def test_python_ints_beyond_int64_follow_the_documented_rule(dtype, shape, value):
    # The rule: an int goes into an integer field when in range (exactly), and
    # into a float field always. NumPy alone reads these lists as float64 or object.
    buf = dataecho.ShuffleBuffer((shape, dtype), capacity=2, batch_size=1)
    buf.put(value, timeout=1)
    buf.close()
    got = buf.next_batch(timeout=5)[0]
    if dtype.startswith("float"):
        expected = np.array([float(v) for v in np.ravel(np.array(value, dtype=object))], dtype=dtype).reshape(shape)
    else:
        expected = np.array(value, dtype=object).astype(dtype)
    assert got.tolist() == expected.tolist()


@pytest.mark.parametrize("name", ["echo_factor", "max_echo", "timeout", "loader_echo_factor", "loader_max_echo"])
def test_huge_ints_for_number_arguments_are_named(name):
    huge = 2**1100
    with pytest.raises(ValueError, match=name.replace("loader_", "")):
        if name == "timeout":
            dataecho.ShuffleBuffer(((), "uint8"), capacity=2, batch_size=1).put(1, timeout=huge)
        elif name.startswith("loader_"):
            dataecho.EchoLoader([1], **{name.replace("loader_", ""): huge})
        else:
            dataecho.ShuffleBuffer(((), "uint8"), capacity=2, batch_size=1, **{"echo_factor": "auto", name: huge})


@pytest.mark.parametrize("name", ["echo_at", "output", "worker_type", "multiprocessing_context"])
def test_an_array_for_a_string_choice_is_named(name):
    extra = {"worker_type": "process"} if name == "multiprocessing_context" else {}
    with pytest.raises((TypeError, ValueError), match=name):
        dataecho.EchoLoader([1], **extra, **{name: np.array(["example", "numpy"])})


def test_a_numpy_str_for_a_string_choice_is_accepted():
    loader = dataecho.EchoLoader([1], echo_at=np.str_("batch"), output=np.str_("numpy"))
    assert type(loader.echo_at) is str and loader.echo_at == "batch" and type(loader.output) is str


def test_a_huge_int_device_is_named():
    pytest.importorskip("torch")
    with pytest.raises((TypeError, ValueError, RuntimeError), match="device"):
        dataecho.EchoLoader([1], device=2**64)


def test_ragged_put_many_names_the_field():
    buf = dataecho.ShuffleBuffer(((1,), "uint8"), capacity=2, batch_size=1)
    with pytest.raises((TypeError, ValueError), match="example"):
        buf.put_many([[1], [1, 2]], timeout=1)
    buf = dataecho.ShuffleBuffer({"a": ((1,), "uint8")}, capacity=2, batch_size=1)
    with pytest.raises((TypeError, ValueError), match="field 'a'"):
        buf.put_many({"a": [[1], [1, 2]]}, timeout=1)
    assert buf.stats()["fresh"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"shuffle_buffer": 2**40}, {"shuffle_buffer": 2**31 + 1}, {"echo_at": "batch", "batch_size": 2**40},
     {"echo_at": "batch", "batch_size": 2**30 + 1}, {"augment": abs, "batch_size": 2**29 + 1, "shuffle_buffer": 2**31}],
)
def test_loader_sizes_beyond_the_buffer_are_refused_when_built(kwargs):
    # Not at the first epoch, naming 'capacity', an argument the caller never gave.
    with pytest.raises(ValueError, match="shuffle_buffer|batch_size"):
        dataecho.EchoLoader([1], **kwargs)


def test_loader_sizes_at_the_buffer_limits_are_accepted():
    dataecho.EchoLoader([1], shuffle_buffer=2**31, batch_size=2**31)
    dataecho.EchoLoader([1], echo_at="batch", batch_size=2**30)
    dataecho.EchoLoader([1], augment=abs, shuffle_buffer=2**31, batch_size=2**29)


@pytest.mark.parametrize("value,shape", [(True, ()), ([False, True], (2,))])
def test_python_bools_go_into_uint64_fields(value, shape):
    # The rule: "bool into any number".
    buf = dataecho.ShuffleBuffer((shape, "uint64"), capacity=2, batch_size=1)
    buf.put(value, timeout=1)
    buf.close()
    np.testing.assert_array_equal(buf.next_batch(timeout=5)[0], np.array(value, dtype=np.uint64))
