"""EchoLoader under real clients: Hugging Face datasets (map-style and
iterable), a Lightning Trainer, a torch IterableDataset that shards itself, and
the epoch rule on two ranks. Each test counts every example it was given. The clients are in the test
extra: a missing one fails the import, it is never skipped.

Covered elsewhere, and not repeated here: a torch IterableDataset sharding itself
across worker processes (test_process_workers.py::
test_a_torch_iterable_dataset_shards_itself_with_torch_worker_info), and ranks
on one permutation over epochs 0-2 with a peek before set_epoch
(test_dataloader_habits.py::test_set_epoch_keeps_ranks_on_one_permutation_despite_an_extra_iter).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Iterable

import client_sources
import datasets
import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import torch_sources
from support import PAYLOAD, Records, checked_ids, drain, payload_of

import dataecho

HF_ROWS = 300


def delivered(batches: Iterable[dict[str, Any]]) -> Counter:
    """How often each id came, every payload checked against its id."""
    seen: Counter = Counter()
    drain(batches, seen)
    return seen


# ---- Hugging Face datasets ----


@pytest.fixture(scope="module")
def hf_dataset():
    """A Hugging Face Dataset in memory: an int64 ``id`` column, and ``x``, the
    id's payload (support.payload_of) as a float32 sequence."""
    ids = np.arange(HF_ROWS)
    return datasets.Dataset.from_dict({"id": ids, "x": payload_of(ids).astype(np.float32)})


def hf_batches(batches: Iterable[Any], columns: list[str], array_type: type) -> tuple[Counter, int]:
    """Checks batches of the ``hf_dataset``: a dict of the dataset's columns, each
    an `array_type`, ``x`` the payload of its row's id.

    Returns:
        How often each id came, and the number of batches.
    """
    seen: Counter = Counter()
    count = 0
    for count, batch in enumerate(batches, 1):
        assert list(batch) == columns, f"batch keys {list(batch)}, the dataset's columns {columns}"
        assert all(isinstance(column, array_type) for column in batch.values()), [type(c) for c in batch.values()]
        ids, x = np.asarray(batch["id"]), np.asarray(batch["x"])
        assert ids.dtype == np.int64 and x.dtype == np.float32 and x.shape == (len(ids), PAYLOAD), (ids.dtype, x)
        wrong = ~(x == payload_of(ids)).all(axis=1)
        assert not wrong.any(), f"x does not belong to ids {ids[wrong][:5].tolist()}"
        seen.update(ids.tolist())
    return seen, count


@pytest.mark.parametrize("echo", [1, 2])
@pytest.mark.parametrize("worker_type", ["thread", "process"])
@pytest.mark.parametrize("output", ["numpy", "torch"])
@pytest.mark.parametrize("form", ["numpy", "torch"])
def test_a_hugging_face_dataset_is_read_exactly_in_each_format(hf_dataset, form, output, worker_type, echo, seed):
    dataset = hf_dataset.with_format(form)  # rows as NumPy arrays, or as torch tensors
    loader = dataecho.EchoLoader(dataset, batch_size=32, echo_factor=echo, num_workers=2, worker_type=worker_type,
                                 output=output, shuffle_buffer=64, seed=seed)
    seen, batches = hf_batches(loader, hf_dataset.column_names, torch.Tensor if output == "torch" else np.ndarray)
    assert seen == Counter({i: echo for i in range(HF_ROWS)}), f"not every id exactly {echo} times"
    assert batches == len(loader) == -(-HF_ROWS * echo // 32)


@pytest.mark.parametrize("worker_type", ["thread", "process"])
def test_a_hugging_face_iterable_dataset_is_read_exactly_sharding_itself_in_processes(hf_dataset, worker_type, seed):
    # It reads its shards by torch's get_worker_info(), which dataecho's worker
    # processes fill; a worker reading every shard would deliver each id twice.
    stream = hf_dataset.to_iterable_dataset(num_shards=4).with_format("numpy")
    loader = dataecho.EchoLoader(stream, batch_size=32, echo_factor=1, num_workers=2, worker_type=worker_type, seed=seed)
    seen, _ = hf_batches(loader, hf_dataset.column_names, np.ndarray)
    assert seen == Counter(range(HF_ROWS))


# ---- a Lightning Trainer ----


def lightning_train_loader(seed: int) -> dataecho.EchoLoader:
    """The training loader of the Lightning tests; deterministic: its batches are a
    function of (seed, epoch), whatever its threads do."""
    return dataecho.EchoLoader(Records(256), batch_size=16, echo_factor=2, shuffle_buffer=32, deterministic=True,
                               output="torch", seed=seed)


def lightning_fit(tmp_path: Path, seed: int) -> tuple[Any, dataecho.EchoLoader, dataecho.EchoLoader]:
    """Two epochs of ``Trainer.fit`` on the CPU over EchoLoaders, validating after
    each. Returns the module (client_sources.Regression) and the training and
    validation loaders."""
    train = lightning_train_loader(seed)
    val = dataecho.EchoLoader(Records(64), batch_size=16, echo_factor=1, shuffle=False, output="torch", seed=seed)
    module = client_sources.Regression(lr=0.05)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val)
    return module, train, val


# Lightning 2.6 on torch 2.13 warns from its own pytree helper.
LIGHTNING_LEAFSPEC = r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"


@pytest.mark.filterwarnings(LIGHTNING_LEAFSPEC)
def test_lightning_trains_and_validates_on_every_batch_of_each_epoch(tmp_path, seed):
    module, train, val = lightning_fit(tmp_path, seed)
    assert sorted(module.trained) == [0, 1] and len(train) == 32
    for epoch, batches in module.trained.items():
        assert len(batches) == len(train), f"epoch {epoch}: {len(batches)} training batches"
        assert Counter(i for b in batches for i in b) == Counter({i: 2 for i in range(256)}), f"epoch {epoch}"
    mean_loss = {epoch: np.mean(losses) for epoch, losses in module.losses.items()}
    assert mean_loss[1] < mean_loss[0], mean_loss
    assert module.linear.weight.abs().sum().item() > 0, "the parameters did not change"

    # Validation (shuffle=False, echo 1): the dataset's order, as an evaluation loop needs.
    in_order = [list(range(i, i + 16)) for i in range(0, 64, 16)]
    assert module.sanity == in_order[:2], "Lightning's sanity check takes the first two batches"
    assert sorted(module.validated) == [0, 1]
    for epoch, batches in module.validated.items():
        assert len(batches) == len(val) == 4
        assert batches == in_order, f"validation after epoch {epoch}"


@pytest.mark.filterwarnings(LIGHTNING_LEAFSPEC)
def test_lightning_epochs_are_the_loaders_epochs(tmp_path, seed):
    # Lightning calls loader.sampler.set_epoch(e) before each epoch e, but it
    # makes epoch 0's iterator before the first set_epoch (after one more iter()
    # that checks the loader is iterable). Under torch's DataLoader epoch 0 is
    # still epoch 0: a DistributedSampler's epoch is 0 until set.
    module, train, _ = lightning_fit(tmp_path, seed)
    references = {}
    for epoch in range(3):
        reference = lightning_train_loader(seed)
        reference.set_epoch(epoch)
        references[epoch] = [checked_ids(b).tolist() for b in reference]
    ran = {epoch: [k for k, batches in references.items() if batches == module.trained[epoch]] for epoch in (0, 1)}
    assert ran == {0: [0], 1: [1]}, f"Lightning's epoch -> the loader's epochs it matches: {ran}"
    assert module.trained[0] != module.trained[1] and train.next_epoch == 1


# ---- a torch IterableDataset that shards itself ----


@pytest.mark.parametrize("echo", [1, 2])
def test_a_torch_iterable_dataset_under_thread_workers_is_read_exactly(echo, seed):
    # Thread workers share one iteration of the dataset (torch's get_worker_info()
    # is None there); the transform fans its examples out to both workers.
    loader = dataecho.EchoLoader(torch_sources.ShardedByTorch(400), batch_size=20, echo_factor=echo, num_workers=2,
                                 worker_type="thread", transform=dict, seed=seed)
    seen: Counter = Counter()
    for batch in loader:
        seen.update(batch["id"].tolist())
        assert not batch["workers"].any(), "torch's get_worker_info() is not None in a thread worker"
    assert seen == Counter({i: echo for i in range(400)})


# ---- the epoch rule on two ranks ----


def test_set_epoch_splits_an_epoch_between_two_ranks_even_after_a_peek(seed):
    def ranks() -> list[dataecho.EchoLoader]:
        return [dataecho.EchoLoader(Records(64), batch_size=4, echo_factor=1, shuffle_buffer=4, rank=rank,
                                    world_size=2, seed=seed) for rank in range(2)]

    peeked, plain, unset = ranks(), ranks(), ranks()
    for loader in peeked + plain:
        loader.set_epoch(3)
    checked_ids(next(iter(peeked[0])))  # after set_epoch: a peek at one batch, to log its shapes
    assert [loader.next_epoch for loader in peeked] == [3, 3]
    shares = [delivered(loader) for loader in peeked]
    assert all(set(share.values()) == {1} for share in shares), "an id twice on one rank"
    assert not set(shares[0]) & set(shares[1]), "the ranks overlap"
    assert set(shares[0]) | set(shares[1]) == set(range(64)), "the ranks miss examples"
    assert shares == [delivered(loader) for loader in plain], "the peek moved rank 0 off epoch 3"
    assert set(shares[0]) != set(delivered(unset[0])), "epoch 3 split the dataset as epoch 0 does"


def test_hugging_face_integer_columns_come_as_int64_as_with_format_torch_gives_them():
    # datasets stores input_ids as int32 and attention_mask as int8; a causal LM's loss takes labels=input_ids
    # and wants int64 (torch's "expected target dtype to be Long"), which DataLoader(ds.with_format("torch")) gives.
    features = datasets.Features({"input_ids": datasets.List(datasets.Value("int32")),
                                  "attention_mask": datasets.List(datasets.Value("int8")),
                                  "score": datasets.Value("float64")})
    rows = {"input_ids": [[i, i + 1, i + 2] for i in range(64)], "attention_mask": [[1, 1, 0]] * 64,
            "score": [i / 2 for i in range(64)]}
    dataset = datasets.Dataset.from_dict(rows, features=features)
    batch = next(iter(dataecho.EchoLoader(dataset, batch_size=8, echo_factor=1, output="torch", seed=0)))
    reference = next(iter(torch.utils.data.DataLoader(dataset.with_format("torch"), batch_size=8)))
    for name in ("input_ids", "attention_mask", "score"):
        assert batch[name].dtype == reference[name].dtype, name
    assert batch["input_ids"].dtype == torch.int64 and batch["score"].dtype == torch.float32
    logits = torch.zeros(8, 3, 100)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["input_ids"].flatten())  # int64 targets
