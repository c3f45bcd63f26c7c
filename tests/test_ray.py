"""Ray Data as the upstream: an EchoLoader over a Ray Dataset and over the
per-worker DataIterators of a split, against a local Ray instance. Ray runs in a
subprocess, so that its processes and warnings stay out of the other tests."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("ray.data", reason="ray is not installed (pip install 'dataecho[ray]')")

SCRIPT = textwrap.dedent(
    """
    import json
    import threading
    from collections import Counter

    import numpy as np
    import ray

    import dataecho

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        def decode(row):
            return {"id": row["id"], "x": np.full(3, row["id"], np.float32)}

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
)


@pytest.mark.timeout(240)
def test_echo_loader_over_a_ray_dataset_and_its_split():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=200,
        env={**__import__("os").environ, "RAY_DEDUP_LOGS": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"},
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-5000:]
    import json

    report = json.loads(lines[0][len("REPORT "):])
    assert report["epochs"] == [[True, [2]], [True, [2]]], "every row twice, each epoch"
    assert report["shards"] == [150, 150] and report["disjoint"]
    assert "worker_type" in report["process"]
