"""Random checkpoint cases: a loader configuration, a moment a job saves at, a
way the state travels and a job that loads it; and the laws a resume keeps.

A case draws (from its seed): a source (a map-style dataset, an array, an
iterable that can restart, a Grain or torchdata pipeline), a placement (example
echo, fractional, batch echo, ``augment`` on threads or worker processes),
workers, a batch size, ``drop_last``, a world size; a moment (mid-epoch, after
the last batch, after ``break``, after an error in the dataset or in the loop,
after ``set_epoch``); a transport (``torch.save``/``torch.load`` with
``weights_only=True``, or JSON); and who loads (every rank its own state, rank
0's on every rank, the list of every rank's, a job of another world size).

The laws, against the same job run without interruption:

- same world size: every rank's batches, interrupted and resumed, are the
  uninterrupted rank's, exactly; ``len(loader)`` is their number; the next
  epoch is the uninterrupted next epoch;
- another world size: every example of the epoch is delivered its count
  (``floor`` or ``ceil`` of a fractional factor) across the two jobs, a few
  once more to pad the new ranks to equal batch counts (fewer than a batch and
  an entry each), every new rank yields the same number of batches, and that
  is what ``len(loader)`` said; the next epoch is a fresh job's.

``run_case(seed)`` returns a description of the case; it raises
AssertionError, naming the seed and the case, where a law does not hold.
"""

from __future__ import annotations

import io
import json
import random
from collections import Counter
from typing import Any

import numpy as np
from support import InjectedFault, Records, RestartableStream

import dataecho

MOMENTS = ("mid", "last", "break", "error-dataset", "error-loop", "set-epoch")


class _Stop(Exception):
    """The error a case's training loop raises."""


def noisy(example: Any, rng: Any) -> Any:
    return {"id": example["id"] if isinstance(example, dict) else example, "noise": rng.integers(0, 1 << 30)}


def ids(batch: Any) -> list:
    if isinstance(batch, dict):
        if "noise" in batch:
            return list(zip(np.asarray(batch["id"]).reshape(-1).tolist(),
                            np.asarray(batch["noise"]).reshape(-1).tolist()))
        return np.asarray(batch["id"]).reshape(-1).tolist()
    return np.asarray(batch).reshape(-1).tolist()


def example_ids(batches: list) -> list:
    return [row[0] if isinstance(row, tuple) else row for batch in batches for row in batch]


def draw(seed: int) -> dict[str, Any]:
    """A case's configuration, from its seed."""
    rng = random.Random(seed)
    source = rng.choice(["records", "records", "array", "iterable", "grain", "nodes"])
    if source in ("grain", "nodes"):
        return {"seed": seed, "source": source, "n": rng.randrange(20, 200),
                "echo_factor": rng.choice([1, 1.5, 2, 3]), "batch_size": rng.choice([None, 4, 8]),
                "shuffle_buffer": rng.choice([16, 64]), "augment": rng.random() < 0.4,
                "moment": rng.choice(["mid", "start", "last"]), "transport": rng.choice(["torch", "json"]),
                "cut": rng.random()}
    placement = rng.choice(["example", "fractional", "batch", "augment", "augment"] +
                           (["augment-processes"] if source == "records" and rng.random() < 0.3 else []))
    batch = rng.choice([1, 4, 8, 16])
    kwargs: dict[str, Any] = {"batch_size": batch, "seed": rng.randrange(1 << 16), "drop_last": rng.random() < 0.3,
                              "echo_factor": {"fractional": rng.choice([1.5, 2.5])}.get(placement,
                                                                                        rng.choice([1, 2, 3])),
                              "shuffle_buffer": rng.choice([2 * batch, 64, 256]),
                              "num_workers": rng.choice([0, 1, 2])}
    if placement == "batch":
        kwargs.update(echo_at="batch", shuffle_buffer=rng.choice([2, 4, 8]))
    if placement.startswith("augment"):
        kwargs["augment"] = noisy
    if placement == "augment-processes" or (source == "records" and rng.random() < 0.1):
        kwargs.update(worker_type="process", num_workers=2)  # reading (and augment, where given) in processes
    map_style = source != "iterable"
    world = rng.choice([1, 1, 2, 3]) if map_style else 1
    moment = rng.choice(MOMENTS if source == "records" else [m for m in MOMENTS if m != "error-dataset"])
    if moment == "error-dataset":  # fails on the rank whose shard has the record: a job of one rank here
        world = 1
    new_world = world
    if map_style and placement != "batch" and rng.random() < 0.4:
        new_world = rng.choice([w for w in (1, 2, 3, 4, 5) if w != world])
    loads = rng.choice(["own", "rank0", "list"]) if new_world == world else rng.choice(["rank0", "list"])
    return {"seed": seed, "source": source, "n": rng.randrange(20, 300), "placement": placement, "kwargs": kwargs,
            "world": world, "new_world": new_world, "moment": moment, "loads": loads,
            "transport": rng.choice(["torch", "json"]), "cut": rng.random()}


def _source(case: dict[str, Any], fail_at: int | None = None) -> Any:
    n = case["n"]
    if case["source"] == "records":
        return Records(n, fail_at=fail_at)
    if case["source"] == "array":
        return np.arange(n)
    return RestartableStream(n)


def _loader(case: dict[str, Any], rank: int, world: int, fail_at: int | None = None) -> dataecho.EchoLoader:
    extra = {"rank": rank, "world_size": world} if case["source"] != "iterable" else {}
    return dataecho.EchoLoader(_source(case, fail_at), **case["kwargs"], **extra)


def _travel(state: Any, transport: str) -> Any:
    if transport == "json":
        return json.loads(json.dumps(state))
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _interrupted(case: dict[str, Any], rank: int, epoch_len: int) -> tuple[list, Any]:
    """One rank of the interrupted job: (its batches before the save, its state)."""
    moment, world = case["moment"], case["world"]
    cut = max(1, min(epoch_len - 1, int(case["cut"] * epoch_len))) if epoch_len > 1 else epoch_len
    fail_at = None
    if moment == "error-dataset":
        fail_at = int(case["cut"] * case["n"]) % case["n"]
    loader = _loader(case, rank, world, fail_at)
    taken: list = []
    epoch = iter(loader)
    if moment == "set-epoch":  # iter() first, then set_epoch, as Lightning does
        loader.set_epoch(1)
    try:
        for batch in epoch:
            taken.append(ids(batch))
            if moment == "last" and len(taken) == epoch_len:  # before the iterator says it is spent
                return taken, loader.state_dict()
            if moment in ("mid", "set-epoch") and len(taken) == cut:
                return taken, loader.state_dict()
            if moment == "break" and len(taken) == cut:
                break
            if moment == "error-loop" and len(taken) == cut:
                raise _Stop
    except (InjectedFault, _Stop):
        pass
    del epoch
    return taken, loader.state_dict()


def _reference(case: dict[str, Any], world: int, epochs: int, first: int) -> list[list[list]]:
    """Every rank's batches of ``epochs`` uninterrupted epochs from epoch ``first``."""
    out = []
    for rank in range(world):
        loader = _loader(case, rank, world)
        batches = []
        for epoch in range(first, first + epochs):
            loader.set_epoch(epoch)
            batches.append([ids(b) for b in loader])
        out.append(batches)
        loader.close()
    return out


def run_case(seed: int) -> dict[str, Any]:
    """Runs case ``seed`` and checks its laws (see the module docstring)."""
    case = draw(seed)
    try:
        _check(case)
    except AssertionError as error:
        raise AssertionError(f"checkpoint case {seed}: {case}: {error}") from None
    return case


def _check(case: dict[str, Any]) -> None:
    if case["source"] in ("grain", "nodes"):
        _check_pipeline(case)
        return
    world, new_world = case["world"], case["new_world"]
    first = 1 if case["moment"] == "set-epoch" else 0
    reference = _reference(case, world, 2, first)
    saved = [_interrupted(case, rank, len(reference[rank][0])) for rank in range(world)]
    states = [_travel(state, case["transport"]) for _, state in saved]
    epoch = states[0]["epoch"]
    resumed_batches, lengths = [], []
    for rank in range(new_world):
        loader = _loader(case, rank, new_world)
        loaded = states if case["loads"] == "list" else states[rank] if case["loads"] == "own" else states[0]
        loader.load_state_dict(loaded)
        loader.set_epoch(epoch)
        lengths.append(_len(loader))
        rest = [ids(b) for b in loader]
        loader.set_epoch(epoch + 1)
        after = [ids(b) for b in loader]
        resumed_batches.append((rest, after))
        loader.close()
    finished = all(state["stages"] is None for state in states)
    if new_world == world:
        for rank in range(world):
            taken, (rest, after) = saved[rank][0], resumed_batches[rank]
            whole, following = reference[rank]
            if finished and epoch == first + 1:  # saved at the epoch's end: the next epoch follows
                assert taken == whole and rest == following, f"rank {rank}: the next epoch after an epoch-end state"
                continue
            assert taken + rest == whole, f"rank {rank}: interrupted + resumed differs from the uninterrupted epoch"
            assert lengths[rank] in (None, len(whole)), f"rank {rank}: len() {lengths[rank]} != {len(whole)}"
            assert after == following, f"rank {rank}: the next epoch differs"
        return
    _check_elastic(case, reference, saved, resumed_batches, lengths, first, epoch)


def _check_elastic(case: dict[str, Any], reference: list, saved: list, resumed: list, lengths: list,
                   first: int, epoch: int) -> None:
    fresh = _reference(case, case["new_world"], 2, epoch)
    if epoch != first:  # saved at the epoch's end: the new job runs the next epoch afresh
        assert [rest for rest, _ in resumed] == [rank[0] for rank in fresh], "the next epoch on the new world size"
        return
    factor = case["kwargs"]["echo_factor"]
    expected = Counter(example_ids([b for rank in reference for b in rank[0]]))
    got = Counter(example_ids([b for taken, _ in saved for b in taken] + [b for rest, _ in resumed for b in rest]))
    counts = {len(rest) for rest, _ in resumed}
    assert len(counts) == 1, f"new ranks yield {counts} batches"
    taken = len(saved[0][0])
    assert all(length in (None, taken + len(rest)) for length, (rest, _) in zip(lengths, resumed)), \
        f"len() {lengths} against {taken} + {[len(r) for r, _ in resumed]}"
    low, high = int(factor), int(-(-factor // 1))
    missing = [i for i in expected if got[i] < min(low, expected[i])]
    assert not missing or case["kwargs"]["drop_last"], f"examples delivered fewer than {low} times: {missing[:10]}"
    extra = sum(max(0, got[i] - max(expected[i], high)) for i in got)
    bound = case["new_world"] * (case["kwargs"]["batch_size"] + high)
    assert extra <= bound, f"{extra} deliveries beyond the counts (padding bound {bound})"
    assert [after for _, after in resumed] == [rank[1] for rank in fresh], "the next epoch differs from a fresh job's"


def pipeline_step(case: dict[str, Any]) -> tuple[Any, Any, Any]:
    """A pipeline's echo step, fresh: (an iterator over it, its state, load a state into it)."""
    options = {"shuffle_buffer": case["shuffle_buffer"], "seed": 5, "batch_size": case["batch_size"],
               "augment": noisy if case["augment"] else None}
    if case["source"] == "grain":
        import grain

        from dataecho.grain import EchoIterDataset

        parent = grain.MapDataset.range(case["n"]).map(lambda i: {"id": np.int64(i)}).to_iter_dataset()
        iterator = iter(EchoIterDataset(parent, case["echo_factor"], **options))
        return iterator, iterator.get_state, iterator.set_state
    from torchdata.nodes import IterableWrapper, Mapper

    from dataecho.nodes import Echo

    node = Echo(Mapper(IterableWrapper(range(case["n"])), lambda i: {"id": np.int64(i)}), case["echo_factor"],
                **options)
    node.reset()
    return node, node.state_dict, node.reset


def _check_pipeline(case: dict[str, Any]) -> None:
    """A Grain or torchdata pipeline's echo: interrupted, resumed in a fresh
    pipeline from its state, is its uninterrupted epoch."""
    reference, _, _ = pipeline_step(case)
    whole = [ids(item) for item in reference]
    cut = {"start": 0, "last": len(whole)}.get(case["moment"], int(case["cut"] * len(whole)))
    interrupted, state_of, _ = pipeline_step(case)
    taken = [ids(next(interrupted)) for _ in range(cut)]
    state = _travel(state_of(), case["transport"])
    resumed, _, load = pipeline_step(case)
    load(state)
    assert taken + [ids(item) for item in resumed] == whole, f"resumed after element {cut} of {len(whole)}"


def _len(loader: dataecho.EchoLoader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
