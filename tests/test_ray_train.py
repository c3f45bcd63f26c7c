"""Ray Train: a ``TorchTrainer`` on a local cluster of two nodes, whose train
loop wraps ``ray.train.get_dataset_shard("train")`` in an ``EchoLoader``: each
worker echoes its own shard, and with ``echo_factor="auto"`` the workers (the
ranks of the trainer's process group) stay in lockstep."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch")

# Ray Train reads a setting of Ray Data that Ray itself deprecates, and warns of its own future changes.
pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


def train_loop(config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    import dataecho

    shard = ray.train.get_dataset_shard("train")
    loader = dataecho.EchoLoader(shard, batch_size=8, echo_factor=config["echo"], num_workers=1)
    ids, batches = [], 0
    for batch in loader:
        ids += batch["id"].tolist()
        batches += 1
    rank = ray.train.get_context().get_world_rank()
    Path(config["out"], f"{config['name']}-{rank}.json").write_text(
        json.dumps({"ids": ids, "batches": batches, "world_size": dist.get_world_size()}))


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    # Logical CPUs: a train worker on each node, and room beside them for the
    # trainer's own actors and Ray Data's reading tasks.
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3})
    cluster.add_node(num_cpus=3)
    # The train loop is this module's: the workers import it from here.
    path = os.pathsep.join([str(Path(__file__).parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.mark.parametrize("echo", [2, "auto"])
def test_a_torch_trainer_echoes_each_workers_shard(cluster, tmp_path, echo):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    name = f"echo-{echo}"
    trainer = TorchTrainer(train_loop, train_loop_config={"echo": echo, "out": str(tmp_path), "name": name},
                           datasets={"train": ray.data.range(400)},
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False,
                                                        resources_per_worker={"CPU": 1}),
                           run_config=RunConfig(storage_path=str(tmp_path / "results"), name=name))
    trainer.fit()
    workers = [json.loads((tmp_path / f"{name}-{rank}.json").read_text()) for rank in range(2)]
    seen = [Counter(w["ids"]) for w in workers]
    assert all(w["world_size"] == 2 for w in workers)
    assert not set(seen[0]) & set(seen[1]) and set(seen[0]) | set(seen[1]) == set(range(400)), "disjoint shards"
    if echo == 2:
        assert all(set(s.values()) == {2} for s in seen), "every row of a shard twice"
    else:
        assert workers[0]["batches"] == workers[1]["batches"], "as many batches on every worker"
        assert all(min(s.values()) >= 1 for s in seen)
