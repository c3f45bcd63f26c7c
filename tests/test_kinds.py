"""Each kind behind one of the package's protocols, through that protocol
alone: every reader kind (dataecho.workers.reader_kinds.KINDS) filling an echo
buffer, every output kind (dataecho.examples.outputs.OUTPUTS) over one
structure; and the chain's order (dataecho.pipeline.plan.CHAIN), as drawn in
the docs and as the chain builds it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import dataecho
import numpy as np
import pytest
from dataecho.examples.leaves import stack
from dataecho.examples.outputs import OUTPUTS, output_kind
from dataecho.examples.structure import Structure
from dataecho.native.echo_buffer import NativeBuffer
from dataecho.native.sizing import buffer_config, ragged_heap, reorder_window
from dataecho.pipeline import chain as chains
from dataecho.pipeline import plan as plans
from dataecho.pipeline.plan import CHAIN, drawing, plan
from dataecho.reading.source import SAMPLE, EpochSource
from dataecho.workers.failure import Failure
from dataecho.workers.reader_kinds import KINDS, kind_of
from dataecho.workers.readers import Kind, Reading
from dataecho.workers.resources import EpochResources, Seeds
from processes import dataecho_threads, worker_processes
from support import Records, Stall, Stream, check_exact, checked_ids, noisy_augment, one, rows

ROOT = Path(__file__).resolve().parent.parent

# ---- reader kinds ----

EXAMPLES = 100  # of each source
ECHO = 2

# How a loader asks for each reader kind: a kind added to KINDS without a line here fails the tests.
LOADER_ARGS = {
    "inline": {"num_workers": 0},
    "thread": {"num_workers": 2, "worker_type": "thread"},
    "process": {"num_workers": 2, "worker_type": "process"},
}


def loader_for(name: str, form: str, transform: Any = None) -> dataecho.EchoLoader:
    """A loader whose plan reads ``form`` ("map" or "iterable") with reader kind ``name`` (closed by the caller)."""
    source = Records(EXAMPLES) if form == "map" else Stream(EXAMPLES)
    return dataecho.EchoLoader(source, batch_size=8, echo_factor=ECHO, shuffle_buffer=32, seed=3, transform=transform,
                               **LOADER_ARGS[name])


def echo_buffer(specs: plans.Plan, source: EpochSource, structure: Structure, kind: Kind) -> NativeBuffer:
    """The echo buffer as the intake builds it (dataecho.pipeline.stages.intake) for ``kind``."""
    spec = specs.intake
    objects = "pickle" if kind.shared else "key"
    capacity = spec.capacity
    if spec.bounded and source.length is not None:
        capacity = min(capacity, max(source.length, 2 * spec.batch_size))
    pages, page_bytes = ragged_heap(structure, capacity, spec.ragged_bytes, objects)
    config = buffer_config(
        capacity=capacity, pages=pages, page_bytes=page_bytes, batch_size=spec.batch_size,
        echo_factor=spec.echo_factor, auto_echo=spec.auto_echo, max_echo=spec.max_echo,
        seed=Seeds.of(specs.source.seed, 0, 0).buffer, drop_last=spec.drop_last, prefetch=spec.prefetch,
        initial=spec.initial, shared=kind.shared, deterministic=spec.deterministic, exact_echo=spec.exact_echo,
        in_order=spec.in_order, window=reorder_window(capacity, spec.batch_size) if spec.deterministic else 0,
    )
    return NativeBuffer(structure.fields(), config, None, None, objects)


def read_epoch(readers: Any, structure: Structure) -> Counter:
    """Every batch of the epoch, through ``readers.next_arrays``: each id, counted."""
    delivered: Counter = Counter()
    while True:
        try:
            arrays = readers.next_arrays(10.0)
        except StopIteration:
            return delivered
        delivered.update(checked_ids(structure.unflatten(arrays)).tolist())


def expected_readers(name: str, form: str, transform: Any) -> int:
    """Entries of ``counters()``: the consumer's thread inline; an iterable read by threads without a
    ``transform`` has one reading thread (it transforms on all of them); else one per worker."""
    if name == "inline" or (name == "thread" and form == "iterable" and transform is None):
        return 1
    return LOADER_ARGS[name]["num_workers"]


def check_readers(readers: Any, buffer: NativeBuffer, delivered: Counter, readers_expected: int,
                  threads_before: list[str]) -> None:
    """An epoch read whole: every example ECHO times, the counters, and nothing left after join."""
    check_exact(delivered, range(EXAMPLES), ECHO)
    assert sum(delivered.values()) == ECHO * EXAMPLES
    counters = readers.counters()
    assert len(counters) == readers_expected, counters
    assert sum(c["produced"] for c in counters) == EXAMPLES, counters
    assert all(c["busy_s"] >= 0 for c in counters)
    assert isinstance(readers.grace_s, float) and readers.grace_s >= 0
    readers.stop()
    buffer.abort()
    readers.join(max(5.0, readers.grace_s))
    assert dataecho_threads() == threads_before, "join leaves no reading thread"
    assert not worker_processes(), "join leaves no worker process"


def reading_of(specs: plans.Plan, failure: Failure) -> Reading:
    return Reading(EpochSource(specs.source, 0), specs.intake.workers, failure, lambda: None,
                   EpochResources(Seeds.of(specs.source.seed, 0, 0)))


# (a map-style source's reads and transforms are the same calls: with or without one, the same readers)
SOURCES = {"map": ("map", None), "iterable": ("iterable", None), "iterable-transform": ("iterable", Stall(0.0))}


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_reader_kind_reads_an_epoch_into_the_echo_buffer(name, source):
    form, transform = SOURCES[source]
    loader = loader_for(name, form, transform)
    try:
        specs = plan(loader.config)
    finally:
        loader.close()
    kind = KINDS[name]
    assert specs.intake.workers.kind == name and kind_of(specs.intake.workers) is kind
    failure, threads_before = Failure(), dataecho_threads()
    reading = reading_of(specs, failure)
    source, structure = reading.source, Structure.infer(one(0))
    buffer = echo_buffer(specs, source, structure, kind)
    if form == "map":
        assert source.order is not None
        buffer.set_index_range(0, source.end)  # positions the readers claim
    readers = kind.start(reading, buffer, structure, 0, [])
    delivered = read_epoch(readers, structure)
    assert failure.error is None
    check_readers(readers, buffer, delivered, expected_readers(name, form, transform), threads_before)


@pytest.mark.parametrize("form", ["map", "iterable"])
@pytest.mark.parametrize("name", sorted(name for name, kind in KINDS.items() if kind.probe is not None))
def test_a_reader_kinds_probe_reads_the_first_examples_and_attach_goes_on_after_them(name, form):
    loader = loader_for(name, form)
    try:
        specs = plan(loader.config)
    finally:
        loader.close()
    kind = KINDS[name]
    failure, threads_before = Failure(), dataecho_threads()
    reading = reading_of(specs, failure)
    source, size = reading.source, max(SAMPLE, specs.intake.workers.count)
    probing = kind.probe(reading, size)
    first = probing.probe.examples(10.0)
    assert first is not None and failure.error is None
    ids = [int(example["id"]) for example in first]
    if form == "map":
        assert probing.probed == size
        assert ids == source.order[:size].tolist(), "positions 0, 1, ... of the epoch's order"
    else:
        assert ids == list(range(size)), "the iteration's first examples (each worker's shard's, interleaved)"
    structure = source.structure_of(first, frozenset())
    assert structure.paths == Structure.infer(one(0)).paths
    buffer = echo_buffer(specs, source, structure, kind)
    if form == "map":
        buffer.set_index_range(probing.probed, source.end)  # the positions after the probe's
    probing.attach(buffer, structure)
    delivered = read_epoch(probing, structure)
    assert failure.error is None
    check_readers(probing, buffer, delivered, expected_readers(name, form, None), threads_before)


@pytest.mark.parametrize("source", ["map", "iterable"])
@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_reader_kind_stopped_mid_epoch_leaves_nothing_running_after_join(name, source):
    loader = loader_for(name, source)
    try:
        specs = plan(loader.config)
    finally:
        loader.close()
    kind, failure, threads_before = KINDS[name], Failure(), dataecho_threads()
    reading = reading_of(specs, failure)
    structure = Structure.infer(one(0))
    buffer = echo_buffer(specs, reading.source, structure, kind)
    assert buffer.capacity < EXAMPLES, "the readers wait for room: the epoch is not read whole"
    if source == "map":
        buffer.set_index_range(0, reading.source.end)
    readers = kind.start(reading, buffer, structure, 0, [])
    assert len(checked_ids(structure.unflatten(readers.next_arrays(10.0)))) == 8
    readers.stop()
    buffer.abort()  # releases the readers' waiting puts
    readers.join(max(5.0, readers.grace_s))
    assert failure.error is None
    assert dataecho_threads() == threads_before, "join leaves no reading thread"
    assert not worker_processes(), "join leaves no worker process"
    # (Threads reading an iterable count a chunk once it is put whole: here none may be.)
    counters = readers.counters()
    assert len(counters) == expected_readers(name, source, None)
    assert sum(c["produced"] for c in counters) < EXAMPLES, "stopped before the epoch was read"


def test_every_reader_kind_has_a_loader_that_asks_for_it():
    assert set(LOADER_ARGS) == set(KINDS)
    assert KINDS["inline"].probe is None, "num_workers=0: the caller's thread reads the first examples"
    assert any(kind.probe is not None for kind in KINDS.values())


# ---- output kinds ----

FRAMEWORKS = {"numpy": None, "torch": "torch", "jax": "jax"}  # what each output needs


def framework_type(name: str) -> type:
    if name == "numpy":
        return np.ndarray
    if name == "torch":
        import torch

        return torch.Tensor
    import jax

    return jax.Array


def example_of(i: int) -> dict[str, Any]:
    """An int, a float array and a ragged leaf (i + 1 tokens)."""
    return {"n": i, "x": np.arange(3, dtype=np.float32) + i / 2, "tokens": np.arange(i + 1, dtype=np.int32) * i}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_every_output_kind_gives_its_frameworks_arrays_with_the_same_values(name):
    assert name in FRAMEWORKS, "an output kind this test does not know"
    if FRAMEWORKS[name] is not None:
        pytest.importorskip(FRAMEWORKS[name])
    array_type = framework_type(name)
    examples = [example_of(i) for i in range(4)]
    structure = Structure.infer(examples[0], examples[1:])
    assert dict(zip(structure.paths, structure.kinds)) == {"n": "array", "x": "array", "tokens": "ragged"}
    leaves = stack(structure, [structure.flatten(e) for e in examples])
    output = output_kind(name)

    batch = output.batch(structure, leaves)
    assert set(batch) == {"n", "x", "tokens"}
    assert isinstance(batch["n"], array_type) and isinstance(batch["x"], array_type)
    assert np.asarray(batch["n"]).tolist() == [0, 1, 2, 3]
    assert np.array_equal(np.asarray(batch["x"]), np.stack([e["x"] for e in examples]))
    assert np.asarray(batch["x"]).dtype == np.float32
    assert [r.tolist() for r in rows(batch["tokens"])] == [e["tokens"].tolist() for e in examples]

    example = output.example(examples[2])
    assert isinstance(example["x"], array_type) and isinstance(example["tokens"], array_type)
    assert int(example["n"]) == 2
    assert np.array_equal(np.asarray(example["x"]), examples[2]["x"])
    assert np.asarray(example["tokens"]).tolist() == examples[2]["tokens"].tolist()


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_a_raw_bfloat16_leaf_keeps_its_dtype_and_bits_through_every_output_kind(name):
    torch = pytest.importorskip("torch")
    if FRAMEWORKS[name] == "jax":
        pytest.importorskip("jax")
        pytest.importorskip("ml_dtypes")
    values = [[1.5, -2.0, 3.25], [0.0, 1e-3, -65504.0]]
    examples = [{"t": torch.tensor(v, dtype=torch.bfloat16)} for v in values]
    structure = Structure.infer(examples[0], examples[1:])
    assert structure.torch_dtypes == ["torch.bfloat16"] and structure.specs[0][1] == np.uint16, "stored as its bits"
    leaves = stack(structure, [structure.flatten(e) for e in examples])
    output = output_kind(name)
    out = output.batch(structure, leaves)["t"]
    expected = torch.stack([e["t"] for e in examples])
    if name == "jax":
        import jax.numpy as jnp
        import ml_dtypes

        viewed = output.raw(leaves[0], "torch.bfloat16", "t")  # its bits as the ml_dtypes array, no copy
        assert viewed.dtype == ml_dtypes.bfloat16 and np.shares_memory(viewed, leaves[0])
        assert out.dtype == jnp.bfloat16 and out.shape == (2, 3)
        assert np.asarray(out).view(np.uint16).tolist() == expected.view(torch.int16).numpy().view(np.uint16).tolist()
    else:  # numpy and torch: a tensor of its dtype (NumPy has none)
        assert output.raw is None
        assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
        assert torch.equal(out, expected)


# ---- the chain ----


def test_the_chain_is_drawn_as_plan_draws_it_in_the_plans_docstring_and_the_design_doc():
    drawn = drawing()
    assert drawn == "intake -> [batch_echo] -> [augment] -> [device_echo] -> [lockstep] -> [delivery]"
    assert drawn.split(" -> ")[0] == CHAIN[0][0] and len(drawn.split(" -> ")) == len(CHAIN)
    assert drawn in (ROOT / "python" / "dataecho" / "pipeline" / "plan.py").read_text().split('"""')[1], \
        "plan.py's module docstring"
    assert drawn in (ROOT / "docs" / "design.md").read_text()


class Fake:
    """A stage that was built already, named ``name``."""

    unresumable = None

    def __init__(self, name: str) -> None:
        self.name, self.stopped, self.joined = name, False, False

    def stop(self) -> None:
        self.stopped = True

    def join(self, timeout_s: float) -> None:
        self.joined = True


def every_stage_plan() -> plans.Plan:
    """A plan with every stage one rank can have (lockstep needs several ranks), read inline."""
    loader = dataecho.EchoLoader(Records(64), batch_size=4, echo_factor=2, echo_at="batch", shuffle_buffer=4,
                                 augment=noisy_augment, deterministic=True, num_workers=0, seed=1)
    try:
        return plan(loader.config)
    finally:
        loader.close()


def build(planned: plans.Plan, chain: chains.Chain) -> None:
    source = EpochSource(planned.source, 0)
    chains.build_chain(chain, planned, Structure.infer(one(0)), source,
                       EpochResources(Seeds.of(planned.source.seed, 0, 0)), [], None, lambda: None)


def test_build_chain_builds_the_stages_in_chain_order():
    planned = every_stage_plan()
    names = [name for name, _ in CHAIN]
    assert planned.stage_names == ["intake", "batch_echo", "augment", "delivery"]
    assert planned.stage_names == sorted(planned.stage_names, key=names.index)
    chain = chains.Chain(mode=planned.checkpoint)
    build(planned, chain)
    try:
        assert [stage.name for stage in chain.stages] == planned.stage_names
        assert sum(len(chain.stages[-1].next(10.0)) for _ in range(3)) == 12, "the chain delivers"
    finally:
        for stage in reversed(chain.stages):
            stage.stop()
        for stage in reversed(chain.stages):
            stage.join(5.0)


@pytest.mark.parametrize("before", ["intake", "delivery"])
def test_build_chain_refuses_a_stage_out_of_chain_order_and_stops_what_it_built(before):
    planned = every_stage_plan()
    built = Fake(before)
    chain = chains.Chain(mode=planned.checkpoint, stages=[built])
    threads_before = dataecho_threads()
    with pytest.raises(RuntimeError, match=rf"stage 'intake' built after '{before}', against CHAIN"):
        build(planned, chain)
    assert [stage.name for stage in chain.stages] == [before], "nothing added after the refusal"
    assert built.stopped and built.joined, "the stages built so far are stopped"
    assert dataecho_threads() == threads_before
