"""Training interrupted and resumed under real frameworks, one process per run:
``python frameworks.py <framework> <out dir> <phase> [<arg>]``.

- framework: ``lightning`` (``fit``), ``hf`` (a ``transformers.Trainer`` with
  ``dataecho.transformers.EchoLoaderCallback``), ``accelerate`` (a loop with
  ``register_for_checkpointing``).
- several ranks: one process per rank, started with ``RANK``, ``LOCAL_RANK``,
  ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT`` set, as torchrun starts
  them; Lightning (``DATAECHO_TEST_DEVICES=2``: ``strategy="ddp"``) then starts
  none itself, and the Trainer and Accelerate join that gloo process group.
- phase ``first``: trains epoch 0 until a checkpoint, then stops; ``arg`` says
  where (``mid``: after STOP batches; ``end``: at the end of the epoch; for
  ``accelerate``: ``<echo factor>:<batches>``). Phase ``resume``: a new
  process resumes from the checkpoint ``arg`` names (``accelerate``: the same
  ``arg``) and trains until the end of epoch 1.

The training step records every batch's ids with its epoch, per rank, in
``<out dir>/<phase>-rank<r>.jsonl`` (:func:`ledger` reads them back). Every
framework trains over :func:`make_loader`, which the tests also run bare for
the batches an uninterrupted run yields.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from support import Records, checked_ids  # noqa: E402

import dataecho  # noqa: E402

N, BATCH, STOP, EPOCHS = 96, 8, 10, 2  # STOP: the batches of epoch 0 trained before a mid-epoch checkpoint


def make_loader(echo: float = 2.0, **kwargs: Any) -> dataecho.EchoLoader:
    """The training loader: N examples of the suite's id/payload scheme, deterministic."""
    return dataecho.EchoLoader(Records(N), batch_size=BATCH, echo_factor=echo, shuffle_buffer=32, seed=5,
                               deterministic=True, num_workers=1, **kwargs)


class Ledger:
    """Appends each training batch's ids (its payloads checked), with its
    epoch, to this run's file for the rank."""

    def __init__(self, out: Path, phase: str) -> None:
        self.out, self.phase, self.epoch = out, phase, 0

    def record(self, rank: int, epoch: int, batch: dict[str, Any]) -> None:
        ids = checked_ids(batch).tolist()
        with open(self.out / f"{self.phase}-rank{rank}.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps({"epoch": int(epoch), "ids": ids}) + "\n")


def ledger(out: Path, phase: str, rank: int = 0) -> dict[int, list[list[int]]]:
    """The batches a run trained on, by epoch, as :class:`Ledger` recorded them."""
    path = out / f"{phase}-rank{rank}.jsonl"
    epochs: dict[int, list[list[int]]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        entry = json.loads(line)
        epochs.setdefault(entry["epoch"], []).append(entry["ids"])
    return epochs


def step_loss(weight: Any, batch: dict[str, Any]) -> Any:
    """A loss that depends on the batch and one weight: every step trains."""
    return (weight * batch["payload"].float().mean()).sum()


def scale_module() -> Any:
    """A model of one weight whose forward is the loss of a batch's payload."""
    import torch

    class Scale(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, payload: Any) -> Any:
            return step_loss(self.weight, {"payload": payload})

    return Scale()


# ---- Lightning ----


def lightning(out: Path, phase: str, arg: str) -> None:
    """``fit`` until a ModelCheckpoint at step STOP (``mid``) or at the end of
    epoch 0 (``end``), or ``fit(ckpt_path=out/arg)`` to the end of epoch 1."""
    import pytorch_lightning as pl
    import torch

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.ledger = Ledger(out, phase)

        def training_step(self, batch: dict[str, Any], batch_index: int) -> Any:
            self.ledger.record(self.global_rank, self.current_epoch, batch)
            return step_loss(self.weight, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    devices = int(os.environ.get("DATAECHO_TEST_DEVICES", "1"))
    common = {"accelerator": "cpu", "devices": devices, "strategy": "ddp" if devices > 1 else "auto", "logger": False,
              "enable_progress_bar": False, "enable_model_summary": False, "default_root_dir": out,
              "num_sanity_val_steps": 0}
    loader = make_loader(output="torch")
    if phase == "first":
        every = {"every_n_train_steps": STOP} if arg == "mid" else {"every_n_epochs": 1}
        checkpoint = pl.callbacks.ModelCheckpoint(dirpath=out / "checkpoints", save_top_k=-1, **every)
        stop = {"max_steps": STOP} if arg == "mid" else {"max_epochs": 1}
        pl.Trainer(callbacks=[checkpoint], **stop, **common).fit(Recorder(), train_dataloaders=loader)
    else:
        trainer = pl.Trainer(max_epochs=EPOCHS, enable_checkpointing=False, **common)
        trainer.fit(Recorder(), train_dataloaders=loader, ckpt_path=str(out / arg))
    leave()


# ---- Hugging Face Trainer ----


class Interrupted(Exception):
    """Stops a run right after a checkpoint, as a preemption would."""


def hf(out: Path, phase: str, arg: str) -> None:
    """``Trainer.train`` with the callback, saving every STOP steps; ``first``
    stops after the first checkpoint; ``resume`` resumes from the folder ``out/arg``."""
    import torch
    import transformers

    from dataecho.transformers import EchoLoaderCallback

    ledger_, rank = Ledger(out, phase), int(os.environ.get("RANK", "0"))
    loader = make_loader(output="torch")  # on several ranks, sharded by the process group the Trainer starts

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, id: Any, payload: Any) -> dict[str, Any]:
            ledger_.record(rank, ledger_.epoch, {"id": id, "payload": payload})
            return {"loss": step_loss(self.weight, {"payload": payload})}

    class Epochs(transformers.TrainerCallback):
        """Tells the ledger the Trainer's epoch (state.epoch is a fraction, reckoned anew on resume)."""

        def on_train_begin(self, args, state, control, **kwargs):
            ledger_.epoch = state.global_step // len(loader) - 1

        def on_epoch_begin(self, args, state, control, **kwargs):
            ledger_.epoch += 1

        def on_save(self, args, state, control, **kwargs):
            if phase == "first":
                raise Interrupted(state.global_step)

    class EchoTrainer(transformers.Trainer):
        def get_train_dataloader(self) -> Any:
            return loader

    args = transformers.TrainingArguments(output_dir=str(out / "hf"), num_train_epochs=EPOCHS, save_steps=STOP,
                                          save_strategy="steps", logging_steps=STOP, learning_rate=0.01,
                                          use_cpu=True, report_to="none", disable_tqdm=True, seed=1)
    trainer = EchoTrainer(model=Model(), args=args, callbacks=[EchoLoaderCallback(), Epochs()])
    try:
        trainer.train(resume_from_checkpoint=str(out / arg) if phase == "resume" else None)
    except Interrupted:
        pass
    leave()


# ---- Accelerate ----


def accelerate(out: Path, phase: str, arg: str) -> None:
    """A loop over ``accelerator.prepare``'d model and optimizer, the loader
    registered for checkpointing; ``arg`` is ``<echo factor>:<batches>``:
    ``first`` saves the state after that many batches of epoch 0 and stops;
    ``resume`` loads it and goes on."""
    import torch
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)  # on several ranks, a gloo process group, by which the loader shards
    ledger_, rank = Ledger(out, phase), accelerator.process_index
    model = scale_module()
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    echo, stop = arg.split(":")
    loader = make_loader(echo=float(echo), output="torch")
    prepared = accelerator.prepare(loader)
    accelerator.register_for_checkpointing(loader)
    if phase == "resume":
        accelerator.load_state(str(out / "accelerate"))
    for epoch in range(loader.next_epoch, EPOCHS):
        loader.set_epoch(epoch)
        for step, batch in enumerate(loader):
            ledger_.record(rank, epoch, batch)
            accelerator.backward(model(batch["payload"]))
            optimizer.step()
            optimizer.zero_grad()
            if phase == "first" and step + 1 == int(stop):
                accelerator.save_state(str(out / "accelerate"))  # the main process's loader state alone
                (out / f"prepare-rank{rank}.json").write_text(json.dumps({"unchanged": prepared is loader}))
                leave()
                return
    leave()


def leave() -> None:
    """Ends a rank of a job of several once every rank is done, without
    tearing down: destroying a DDP model's gloo process group while a gloo
    thread still frees a tensor deadlocks or aborts the process at random
    (pytorch/pytorch#56297, seen here in ~ProcessGroupGloo from ~Reducer).
    A job of one process returns."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # every rank has written its files
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


FRAMEWORKS = {"lightning": lightning, "hf": hf, "accelerate": accelerate}

if __name__ == "__main__":
    framework, where, phase_ = sys.argv[1:4]
    FRAMEWORKS[framework](Path(where), phase_, sys.argv[4] if len(sys.argv) > 4 else "")
