"""JAX output, on JAX's CPU backend: ``EchoLoader(output="jax")`` and
``dataecho.to_jax``. Values and dtypes against the NumPy output of the same
seed; no copy where one is claimed, proven by pointer; bfloat16; ragged leaves
as values and offsets; objects as lists; a given device; batches kept alive
while later ones come (a JAX array must never see recycled memory); resume;
``collate_fn``; and the arguments refused.
"""

from __future__ import annotations

import gc
import pickle
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="the JAX output needs jax: pip install 'dataecho[jax]'")
import dataecho  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from support import (  # noqa: E402
    Records,
    boxes_of,
    checked_ids,
    examples,
    id_buffer,
    payload_of,
    run_python,
    spy_on_last_stage,
    tokens_of,
    wait_for,
)

N = 256
CPU = jax.devices("cpu")[0]


def loader(source=None, **kwargs) -> dataecho.EchoLoader:
    args = {"batch_size": 16, "echo_factor": 2, "seed": 7, "shuffle_buffer": 64, "output": "jax"}
    return dataecho.EchoLoader(Records(N) if source is None else source, **{**args, **kwargs})


def pointer(array) -> int:
    """Where a JAX array's memory starts (on the CPU: a host address)."""
    return array.unsafe_buffer_pointer()


def test_import_dataecho_does_not_import_jax():
    result = run_python(
        """
        import sys, dataecho, dataecho.examples.jax_trees, dataecho.config.devices, dataecho.pipeline.output
        print("jax" in sys.modules, "ml_dtypes" in sys.modules)
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"], "importing dataecho must not import jax"


# ---- the batches: values, dtypes, memory ----


@pytest.mark.parametrize("echo_at", ["example", "batch"])
def test_values_and_dtypes_are_those_of_the_numpy_output(echo_at, seed):
    source = Records(N, form="ragged")
    expected = list(loader(source, output="numpy", echo_at=echo_at, seed=seed))
    got = list(loader(source, echo_at=echo_at, seed=seed))  # all kept alive at once, too
    assert len(got) == len(expected) > 0
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys()
        for key in ("id", "payload"):
            assert isinstance(mine[key], jax.Array)
            assert mine[key].dtype == jax.dtypes.canonicalize_dtype(theirs[key].dtype)  # int64: int32 without x64
            np.testing.assert_array_equal(np.asarray(mine[key]), theirs[key])
        for key in ("tokens", "boxes"):
            assert isinstance(mine[key], dataecho.JaxRagged)
            np.testing.assert_array_equal(np.asarray(mine[key].values), theirs[key].values)
            np.testing.assert_array_equal(np.asarray(mine[key].offsets), theirs[key].offsets)
        assert isinstance(mine["name"], list) and mine["name"] == theirs["name"]
        checked_ids(mine)


def test_arrays_view_the_batch_memory_on_the_cpu():
    epoch = iter(loader(Records(N, form="ragged"), echo_factor=1))
    native = spy_on_last_stage(epoch)
    for batch in epoch:
        viewed = [batch["payload"], batch["tokens"].values, batch["boxes"].values]
        assert {pointer(a) for a in viewed if a.size} <= native[-1], "no copy: JAX views the batch's memory"
        # Without jax_enable_x64, JAX makes int64 leaves int32: a conversion, so new memory.
        assert batch["id"].dtype == jnp.int32 and pointer(batch["id"]) not in native[-1]
        assert batch["tokens"].offsets.dtype == jnp.int32


def test_with_x64_the_int64_leaves_are_not_copied_either():
    with jax.enable_x64(True):
        source = loader(echo_factor=1)
        epoch = iter(source)
        native = spy_on_last_stage(epoch)
        batch = next(epoch)
        assert batch["id"].dtype == jnp.int64
        assert {pointer(batch["id"]), pointer(batch["payload"])} == native[-1], "no copy"
        source.close()


def test_bfloat16_leaves_come_as_jnp_bfloat16_over_the_batch_memory():
    torch = pytest.importorskip("torch")
    ml_dtypes = pytest.importorskip("ml_dtypes")

    class Source:  # a torch bfloat16 tensor (stored as its bits) and an ml_dtypes array
        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"id": np.int64(i), "t": torch.full((3,), float(i % 256), dtype=torch.bfloat16),
                    "m": np.full(5, i % 256, ml_dtypes.bfloat16)}

    epoch = iter(loader(Source(), echo_factor=1))
    native = spy_on_last_stage(epoch)
    for batch in epoch:
        ids = np.asarray(batch["id"])
        for key, width in (("t", 3), ("m", 5)):
            leaf = batch[key]
            assert isinstance(leaf, jax.Array) and leaf.dtype == jnp.bfloat16 and leaf.shape == (len(ids), width)
            np.testing.assert_array_equal(np.asarray(leaf, np.float32), np.repeat((ids % 256)[:, None], width, 1))
            assert pointer(leaf) in native[-1], "no copy: the bits are viewed as bfloat16"


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
def test_a_dtype_jax_lacks_is_refused_naming_the_leaf():
    torch = pytest.importorskip("torch")
    source = [{"z": torch.zeros(2, dtype=torch.complex32)} for _ in range(32)]
    with pytest.raises(TypeError, match="leaf 'z' is a torch.complex32 tensor, a dtype JAX lacks"):
        next(iter(loader(source, echo_factor=1)))


def test_ragged_leaves_are_values_and_offsets_for_segment_ops():
    segment_sum = jax.jit(lambda r: jax.ops.segment_sum(r.values, r.segment_ids, r.num_segments,
                                                        indices_are_sorted=True))
    epoch = iter(loader(Records(N, form="ragged")))
    for batch, _ in zip(epoch, range(4)):  # each batch's total differs: one trace each
        ids = checked_ids(batch)  # tokens, boxes and names, row by row
        tokens, boxes = batch["tokens"], batch["boxes"]
        assert tokens.num_segments == len(ids) and tokens.values.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(tokens.lengths), [len(tokens_of(i)) for i in ids])
        np.testing.assert_array_equal(np.asarray(segment_sum(tokens)), [tokens_of(i).sum() for i in ids])
        np.testing.assert_allclose(np.asarray(segment_sum(boxes)), [boxes_of(i).sum(axis=0) for i in ids])


def test_padding_gives_padded_jax_arrays_whose_mask_works_under_jit():
    mask = jax.jit(lambda padded: padded.mask)
    for batch in loader(Records(N, form="ragged"), padding=3000, echo_factor=1):  # fixed shapes: one trace
        padded = batch["tokens"]
        assert isinstance(padded, dataecho.Padded) and isinstance(padded.data, jax.Array)
        assert padded.data.shape == (len(batch["id"]), 3000)
        np.testing.assert_array_equal(np.asarray(mask(padded)), np.asarray(padded.mask))
        checked_ids(batch)  # reads each row through the mask


@pytest.mark.parametrize("device", [CPU, "cpu"])
def test_batches_go_to_the_given_device_committed(device):
    for batch in loader(Records(N, form="ragged"), jax_device=device, echo_factor=1):
        arrays = [leaf for leaf in jax.tree.leaves(batch) if isinstance(leaf, jax.Array)]
        assert len(arrays) == 6 and all(a.devices() == {CPU} and a.committed for a in arrays)
    batch = next(iter(loader()))
    assert not batch["payload"].committed, "no jax_device: JAX's default device, uncommitted"


def test_another_device_is_honoured():
    result = run_python(
        """
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        import jax, numpy as np, dataecho
        second = jax.devices("cpu")[1]
        loader = dataecho.EchoLoader(np.arange(64.0, dtype=np.float32), batch_size=8, output="jax",
                                     jax_device=second, seed=0)
        print(sorted({str(batch.devices()) for batch in loader}), sum(int(b.sum()) for b in loader))
        """,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("]")[0] == "['{CpuDevice(id=1)}'", result.stdout
    assert result.stdout.split()[-1] == str(2 * sum(range(64)))


# ---- lifetimes: what JAX sees is never recycled ----


def test_a_batch_kept_alive_is_intact_after_many_later_batches(seed):
    source = loader(Records(1024), seed=seed)
    epoch = iter(source)
    first = next(epoch)
    ids, payload = np.array(first["id"]), np.array(first["payload"])  # copies, to compare with
    np.testing.assert_array_equal(payload, payload_of(ids))
    address = pointer(first["payload"])
    for _ in range(50):
        later = next(epoch)
        assert pointer(later["payload"]) != address, "a live JAX array's memory was leased again"
        checked_ids(later)
    source.close()  # the epoch's memory is freed or kept for the next: never this batch's
    del epoch, later
    gc.collect()
    for batch in loader(Records(1024), seed=seed + 1):  # another loader churns memory
        checked_ids(batch)
    np.testing.assert_array_equal(np.asarray(first["id"]), ids)
    np.testing.assert_array_equal(np.asarray(first["payload"]), payload)
    assert pointer(first["payload"]) == address


def test_a_jax_array_holds_its_batch_until_it_is_gone():
    with id_buffer(capacity=64, batch_size=8, echo_factor=1, seed=0) as buf:
        buf.put_many(examples(range(32)))
    host = next(iter(buf))["payload"]  # its base is the batch's lease
    before = sys.getrefcount(host)
    payload = dataecho.to_jax(host)
    held = sys.getrefcount(host) - before  # outside the assert: pytest's rewriting holds references of its own
    assert pointer(payload) == host.ctypes.data, "no copy"
    assert held == 1, "JAX holds the array, and so its batch lease"
    del payload
    gc.collect()
    assert wait_for(lambda: sys.getrefcount(host) == before, 5.0), "and lets it go with its last array"


def test_jax_never_writes_the_batch_memory_even_when_a_step_donates_it():
    with id_buffer(capacity=64, batch_size=8, echo_factor=1, seed=0) as buf:
        buf.put_many(examples(range(8)))
    host = next(iter(buf))["payload"]
    before = host.copy()
    step = jax.jit(lambda p: p + 1, donate_argnums=0)
    out = step(dataecho.to_jax(host))  # aliased memory JAX does not own: not reused for the output
    np.testing.assert_array_equal(np.asarray(out), before + 1)
    np.testing.assert_array_equal(host, before)


# ---- resume, collate_fn, batch_size=None ----


@pytest.mark.parametrize("saved_with", ["jax", "numpy"])
def test_resume_yields_the_rest_of_an_uninterrupted_run(saved_with):
    reference = [np.asarray(batch["id"]) for batch in loader()]
    first = loader(output=saved_with)
    epoch = iter(first)
    taken = [np.asarray(next(epoch)["id"]) for _ in range(5)]
    state = pickle.loads(pickle.dumps(first.state_dict()))
    first.close()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = [np.asarray(batch["id"]) for batch in resumed]
    assert len(taken) + len(rest) == len(reference)
    for mine, theirs in zip(taken + rest, reference):
        np.testing.assert_array_equal(mine, theirs)


def test_collate_fn_gets_the_examples_as_returned_and_its_result_is_yielded_as_is():
    seen = []

    def collate(batch_examples):
        seen.append(batch_examples)
        return {"ids": [int(e["id"]) for e in batch_examples]}

    delivered = [batch["ids"] for batch in loader(collate_fn=collate, echo_factor=1)]
    assert sorted(i for ids in delivered for i in ids) == list(range(N)), "a list, as collate_fn made it"
    example = seen[0][0]
    assert isinstance(example["id"], np.int64) and isinstance(example["payload"], np.ndarray)


def test_without_batching_each_example_comes_as_jax_arrays():
    for example in loader(batch_size=None, echo_factor=1, jax_device=CPU):
        assert isinstance(example["id"], jax.Array) and example["id"].shape == ()  # a NumPy scalar
        np.testing.assert_array_equal(np.asarray(example["payload"]), payload_of([int(example["id"])])[0])
    scalars = list(loader(Records(32, form="scalar"), batch_size=None, echo_factor=1))
    assert sorted(scalars) == list(range(32)) and all(type(i) is int for i in scalars), "Python numbers stay"


# ---- to_jax, for ShuffleBuffer batches or any tree ----


def test_to_jax_views_shuffle_buffer_batches():
    with id_buffer(capacity=64, batch_size=8, echo_factor=1, seed=0) as buf:
        buf.put_many(examples(range(32)))
    for batch in buf:
        out = dataecho.to_jax(batch, device="cpu")
        assert pointer(out["payload"]) == batch["payload"].ctypes.data, "no copy"
        np.testing.assert_array_equal(np.asarray(out["payload"]), batch["payload"])
        np.testing.assert_array_equal(np.asarray(out["id"]), batch["id"])


def test_to_jax_takes_every_kind_of_leaf():
    torch = pytest.importorskip("torch")
    ragged = dataecho.Ragged.from_rows([np.arange(3, dtype=np.float32), np.arange(0, dtype=np.float32)])
    padded = ragged.padded(4)
    tensor = torch.arange(64, dtype=torch.float32).to(torch.bfloat16)
    tree = {"ragged": ragged, "padded": padded, "names": ["a", b"b", None], "n": 3, "s": np.float32(2),
            "nested": [(np.ones((2, 2), np.uint8),)], "tensor": tensor}
    out = dataecho.to_jax(tree)
    assert isinstance(out["ragged"], dataecho.JaxRagged) and out["ragged"].num_segments == 2
    np.testing.assert_array_equal(np.asarray(out["ragged"].segment_ids), [0, 0, 0])
    assert isinstance(out["padded"], dataecho.Padded) and isinstance(out["padded"].data, jax.Array)
    assert pointer(out["padded"].data) == padded.data.ctypes.data, "padding is aligned: put without a copy"
    assert pointer(out["ragged"].values) == ragged.values.ctypes.data, "packing too"
    assert out["names"] == ["a", b"b", None] and out["n"] == 3
    assert isinstance(out["s"], jax.Array) and out["s"].shape == ()
    assert isinstance(out["nested"], list) and isinstance(out["nested"][0], tuple)
    assert out["tensor"].dtype == jnp.bfloat16 and pointer(out["tensor"]) == tensor.data_ptr(), "DLPack, no copy"


def test_to_jax_errors_name_the_leaf_or_argument():
    with pytest.raises(TypeError, match=r"to_jax\(\): tree\['x'\]\[1\]: .*not a valid JAX array type"):
        dataecho.to_jax({"x": [np.zeros(2), np.array(["a"])]})
    with pytest.raises(TypeError, match=r"to_jax\(\): device: expected a jax.Device"):
        dataecho.to_jax(np.zeros(2), device=0)
    with pytest.raises(RuntimeError, match=r"to_jax\(\): device: no JAX device for 'no-such-platform'"):
        dataecho.to_jax(np.zeros(2), device="no-such-platform")


# ---- arguments ----


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"device": "cpu"}, ValueError, r"device: is torch's device .* give jax_device="),
        ({"output": "numpy", "jax_device": "cpu"}, ValueError, r"jax_device: .* output='jax' only"),
        ({"pin_memory": True}, ValueError, r"pin_memory: .* leave pin_memory=False"),
        ({"jax_device": 0}, TypeError, r"jax_device: expected a jax.Device"),
        ({"jax_device": "no-such-platform"}, RuntimeError, r"jax_device: no JAX device"),
        ({"jax_device": "cpu", "collate_fn": list}, ValueError, r"collate_fn: .* `jax_device` cannot move it"),
        ({"output": "jaxx"}, ValueError, r"output: "),
    ],
)
def test_arguments_that_do_not_fit_the_jax_output_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        loader(**kwargs)


def test_without_jax_the_loader_says_how_to_install_it():
    result = run_python(
        """
        import sys
        sys.modules["jax"] = None  # as if not installed
        import dataecho
        try:
            dataecho.EchoLoader(range(4), output="jax")
        except ImportError as exc:
            print(exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'dataecho[jax]'" in result.stdout
