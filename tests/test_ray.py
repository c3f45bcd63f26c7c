"""Ray Data as the upstream (dataecho.reading.ray).

What RayRows reads of a dataset, ``iter_batches`` of NumPy batches, is played
here by ``Blocks`` (no Ray needed): rows, blocks, and EchoLoader's exact
delivery over them. Then an EchoLoader over a real Ray Dataset, over the
per-worker DataIterators of a split, and rows against ``iter_rows``, against a
local Ray instance in a subprocess, so that its processes and warnings stay out
of the other tests.
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

import dataecho
from dataecho.examples.blocks import RowBlock
from dataecho.reading.ray import RayRows
from support import boxes_of, check_exact, checked_ids, name_of, payload_of, run_python, tokens_of

SIZES = (0, 5, 97, 1, 0, 300, 33)  # rows per block: empty, short and long ones
N = sum(SIZES)


def objects(values: list) -> np.ndarray:
    """A 1-D object array of ``values`` (as Ray gives str and variable-length columns)."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def block(ids: np.ndarray) -> dict[str, np.ndarray]:
    """A NumPy batch of the suite's ragged examples: numbers, a tensor, ragged and object columns."""
    return {"id": ids, "payload": payload_of(ids), "tokens": objects([tokens_of(i) for i in ids.tolist()]),
            "boxes": objects([boxes_of(i) for i in ids.tolist()]), "name": objects([name_of(i) for i in ids.tolist()])}


class Blocks:
    """Plays a Ray Dataset: ``iter_batches`` yields NumPy batches (dicts of
    columns) of ``SIZES`` rows, again each epoch."""

    def __init__(self, make=block) -> None:
        self.make, self.calls = make, []

    def iter_batches(self, **options):
        self.calls.append(options)
        bounds = np.cumsum((0,) + SIZES)
        return (self.make(np.arange(a, b, dtype=np.int64)) for a, b in zip(bounds[:-1], bounds[1:]))


def test_rows_are_dicts_of_python_numbers_and_the_columns_items():
    source = Blocks()
    rows = list(RayRows(source))
    assert source.calls == [{"batch_size": None, "batch_format": "numpy", "prefetch_batches": 1}]
    assert [row["id"] for row in rows] == list(range(N))
    for i, row in enumerate(rows):
        assert list(row) == ["id", "payload", "tokens", "boxes", "name"]
        assert type(row["id"]) is int, "numbers as iter_rows gives them"
        assert np.array_equal(row["payload"], payload_of(i)[0]) and np.array_equal(row["tokens"], tokens_of(i))
        assert np.array_equal(row["boxes"], boxes_of(i)) and row["name"] == name_of(i)


@pytest.mark.parametrize("taken", [0, 3, 5, 6, 102, N - 1, N])
def test_blocks_hold_exactly_the_rows_next_has_not_taken(taken):
    rows = iter(RayRows(Blocks()))
    first = [next(rows)["id"] for _ in range(taken)]
    blocks = list(rows.blocks())
    assert all(isinstance(b, RowBlock) and len(b) > 0 for b in blocks), "no empty block"
    rest = [i for b in blocks for i in b.columns["id"].tolist()]
    assert first + rest == list(range(N))
    assert [row["id"] for b in blocks for row in b] == rest


def drain_ids(loader: dataecho.EchoLoader) -> list[int]:
    return [i for batch in loader for i in checked_ids(batch).tolist()]


@pytest.mark.parametrize("options", [{}, {"num_workers": 0}, {"num_workers": 2, "transform": dict}, {"deterministic": True}],
                         ids=["threads", "num_workers=0", "transform", "deterministic"])
def test_every_row_is_delivered_echo_factor_times_each_epoch(options):
    loader = dataecho.EchoLoader(RayRows(Blocks()), batch_size=16, echo_factor=2, shuffle_buffer=64, seed=0,
                                 **options)
    for epoch in range(2):
        check_exact(Counter(drain_ids(loader)), range(N), 2, f"epoch {epoch}: ")


def test_in_order_at_echo_one_delivers_the_reading_order():
    loader = dataecho.EchoLoader(RayRows(Blocks()), batch_size=16, echo_factor=1, shuffle=False)
    assert drain_ids(loader) == list(range(N))


def test_blocks_are_put_without_splitting_them_into_rows(monkeypatch):
    # Only the blocks of the rows that tell the structure (SAMPLE = 8: the
    # first two non-empty blocks) are split into rows, at most once an epoch.
    built = []
    split = RowBlock.__iter__
    monkeypatch.setattr(RowBlock, "__iter__", lambda block: built.append(len(block)) or split(block))
    loader = dataecho.EchoLoader(RayRows(Blocks()), batch_size=16, echo_factor=1, shuffle_buffer=64, seed=0)
    for _ in range(2):
        check_exact(Counter(drain_ids(loader)), range(N), 1)
    assert sum(built) <= 2 * (SIZES[1] + SIZES[2]) < 2 * N


def test_large_rows_arrive_whole_through_blocks():
    # 5,000 bytes a row: large enough to be held, but copied out of the block,
    # which must not stay alive for one row (dataecho.reading.ray).
    def large(ids: np.ndarray) -> dict[str, np.ndarray]:
        return {**block(ids), "image": np.repeat(payload_of(ids), 313, axis=1)[:, :5000]}

    loader = dataecho.EchoLoader(RayRows(Blocks(large)), batch_size=16, echo_factor=2, shuffle_buffer=64, seed=0)
    for epoch in range(2):
        delivered = Counter()
        for batch in loader:
            ids = checked_ids(batch)
            assert np.array_equal(batch["image"], np.repeat(payload_of(ids), 313, axis=1)[:, :5000])
            delivered.update(ids.tolist())
        check_exact(delivered, range(N), 2, f"epoch {epoch}: ")


def test_columns_that_do_not_match_their_fields_go_row_by_row():
    # Later blocks with ids of another integer type: int32 is cast as a
    # column; uint64 (no safe cast to int64) goes as rows of Python ints.
    def mixed(ids: np.ndarray) -> dict[str, np.ndarray]:
        columns = block(ids)
        dtype = {97: np.int32, 300: np.uint64}.get(len(ids), np.int64)
        return {**columns, "id": ids.astype(dtype)}

    loader = dataecho.EchoLoader(RayRows(Blocks(mixed)), batch_size=16, echo_factor=1, shuffle_buffer=64)
    ids = drain_ids(loader)
    check_exact(Counter(ids), range(N), 1)


def test_a_tensor_whose_shape_changes_says_how_to_declare_it_ragged():
    def wider(ids: np.ndarray) -> dict[str, np.ndarray]:
        columns = block(ids)
        return {**columns, "payload": np.zeros((len(ids), 17), np.uint8)} if len(ids) == 300 else columns

    loader = dataecho.EchoLoader(RayRows(Blocks(wider)), batch_size=16, echo_factor=1, shuffle_buffer=64)
    with pytest.raises(ValueError, match=r"ragged=\['payload'\]"):
        drain_ids(loader)


def test_a_resumed_epoch_drops_the_rows_taken_before():
    def loader_over():
        return dataecho.EchoLoader(RayRows(Blocks()), batch_size=10, echo_factor=1, shuffle_buffer=50, seed=3)

    loader = loader_over()
    epoch = iter(loader)
    seen = [i for _ in range(10) for i in checked_ids(next(epoch)).tolist()]
    state = loader.state_dict()
    skip = state["stages"]["intake"]["skip"]
    assert 100 <= skip < N
    resumed = loader_over()
    with pytest.warns(UserWarning, match=f"skips the {skip} examples taken"):  # what it loses, said
        resumed.load_state_dict(state)
    rest = drain_ids(resumed)
    assert sorted(rest) == list(range(skip, N)) and not set(seen) & set(rest)


SCRIPT = """
import json
import os
import threading
from collections import Counter

import numpy as np

import dataecho
from dataecho.reading.ray import RayRows
from support import TESTS, payload_of, tokens_of

# Ray's workers, started by ray.init, import support too (the map functions call it).
os.environ.update(RAY_DEDUP_LOGS="0", RAY_ENABLE_UV_RUN_RUNTIME_ENV="0",
                  PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])))
import ray

ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
ray.data.DataContext.get_current().enable_progress_bars = False
try:
    def decode(row):
        i = row["id"]
        return {"id": i, "x": np.full(3, i, np.float32)}

    ds = ray.data.range(300).map(decode)
    loader = dataecho.EchoLoader(ds, batch_size=16, echo_factor=2, shuffle_buffer=64, seed=0)
    report = {"epochs": []}
    for _ in range(2):
        ids = Counter()
        for batch in loader:
            assert batch["x"].shape[1:] == (3,) and batch["x"].dtype == np.float32
            assert (batch["x"][:, 0] == batch["id"]).all()
            ids.update(batch["id"].tolist())
        report["epochs"].append([sorted(ids) == list(range(300)), sorted(set(ids.values()))])

    # Columns of every kind, in several blocks (the filter empties some), in order.
    def example(row):
        i = row["id"]
        return {"id": i, "half": np.float32(i / 2), "odd": bool(i % 2), "name": f"example {i}",
                "raw": bytes([i % 256]), "payload": payload_of([i])[0], "tokens": tokens_of(i)}

    ray.data.DataContext.get_current().execution_options.preserve_order = True
    kinds = ray.data.range(400, override_num_blocks=8).filter(lambda r: not 100 <= r["id"] < 160).map(example)
    expected = [i for i in range(400) if not 100 <= i < 160]
    old, new = list(kinds.iter_rows()), list(RayRows(kinds))

    def same(a, b):
        if isinstance(a, np.ndarray):
            return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
        return type(a) is type(b) and a == b

    report["rows"] = [len(new) == len(old), all(list(a) == list(b) and all(same(a[k], b[k]) for k in a)
                                                for a, b in zip(old, new))]
    checked = Counter()
    for batch in dataecho.EchoLoader(kinds, batch_size=16, echo_factor=2, shuffle_buffer=64, seed=0):
        for j, i in enumerate(batch["id"].tolist()):
            assert batch["name"][j] == f"example {i}" and batch["raw"][j] == bytes([i % 256])
            assert batch["half"][j] == i / 2 and batch["odd"][j] == bool(i % 2)
            assert np.array_equal(batch["payload"][j], payload_of([i])[0])
            assert np.array_equal(batch["tokens"][j], tokens_of(i)), i
            checked[i] += 1
    report["kinds"] = [sorted(checked) == expected, sorted(set(checked.values()))]
    in_order = dataecho.EchoLoader(kinds, batch_size=16, echo_factor=1, shuffle=False)
    report["in_order"] = np.concatenate([b["id"] for b in in_order]).tolist() == expected

    # Ray Train's get_dataset_shard gives each worker one of these iterators;
    # a split is consumed by all of its workers at once.
    shards = ds.streaming_split(2, equal=True)
    seen = [None, None]

    def train_worker(rank):
        loader = dataecho.EchoLoader(shards[rank], batch_size=10, echo_factor=1, shuffle_buffer=32, seed=1)
        seen[rank] = sorted(np.concatenate([b["id"] for b in loader]).tolist())

    threads = [threading.Thread(target=train_worker, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    report["shards"] = [len(s) for s in seen]
    report["disjoint"] = not set(seen[0]) & set(seen[1])
    try:
        dataecho.EchoLoader(ds, worker_type="process")
    except ValueError as exc:
        report["process"] = str(exc)
    print("REPORT " + json.dumps(report))
finally:
    ray.shutdown()
"""


@pytest.fixture(scope="module")
def ray_report() -> dict:
    pytest.importorskip("ray.data", reason="ray is not installed (pip install 'dataecho[ray]')")
    result = run_python(SCRIPT, timeout=200)
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(lines[0][len("REPORT "):])


@pytest.mark.timeout(240)
def test_echo_loader_over_a_ray_dataset_and_its_split(ray_report):
    assert ray_report["epochs"] == [[True, [2]], [True, [2]]], "every row twice, each epoch"
    assert ray_report["shards"] == [150, 150] and ray_report["disjoint"]
    assert "worker_type" in ray_report["process"]


@pytest.mark.timeout(240)
def test_ray_rows_are_those_of_iter_rows_and_every_kind_of_column_arrives_exact(ray_report):
    assert ray_report["rows"] == [True, True], "same keys, value types and values as iter_rows"
    assert ray_report["kinds"] == [True, [2]], "every row twice, each column's values its own"
    assert ray_report["in_order"], "shuffle=False at echo 1: the dataset's order"
