"""Checkpoints of an ``EchoLoader`` under Hugging Face's ``Trainer``.

:class:`EchoLoaderCallback` saves the loader's ``state_dict()`` in every
checkpoint folder the ``Trainer`` writes and loads it when
``train(resume_from_checkpoint=...)`` resumes, so that the resumed run yields
exactly the batches the uninterrupted one would have::

    from dataecho.transformers import EchoLoaderCallback

    trainer = EchoTrainer(model, args, callbacks=[EchoLoaderCallback()])  # get_train_dataloader: the loader

The ``Trainer`` itself would skip the batches already trained on by rebuilding
a torch ``DataLoader`` from the loader's arguments (accelerate's
``skip_first_batches``), which bypasses the echo; the callback sets
``args.ignore_data_skip`` so that it skips nothing, and the loader resumes
itself. Importing this module imports transformers; ``import dataecho`` does
not.

Where the state goes: one file per process, ``dataecho_loader_<rank>.json``,
in the checkpoint folder beside the ``Trainer``'s own per-process
``rng_state_<rank>.pth``. Each rank resumes from its own where the job has
the world size that saved it (exact for every kind of source), else from rank
0's (dataecho.pipeline.progress.replay works out each rank's position). Not in
``trainer_state.json``: only the main process writes that, indented.
"""

from __future__ import annotations

import inspect
import json
import os
import warnings
from typing import Any

import transformers
from transformers.trainer_utils import get_last_checkpoint

from .loader import EchoLoader

__all__ = ["EchoLoaderCallback", "STATE_FILE"]

STATE_FILE = "dataecho_loader_{rank}.json"


class EchoLoaderCallback(transformers.TrainerCallback):
    """Saves an ``EchoLoader``'s position in every ``Trainer`` checkpoint, and
    resumes the loader from it, mid-epoch, exactly.

    - ``on_save`` (every process, after the ``Trainer`` wrote
      ``<output_dir>/checkpoint-<global step>``): this process's
      ``loader.state_dict()`` into that folder.
    - ``on_train_begin`` of a resumed run (the ``Trainer`` has loaded
      ``trainer_state.json``, so ``global_step > 0``): the state saved in the
      folder ``train(resume_from_checkpoint=...)`` names, wherever it is, into
      the loader (rank 0's where the job's world size changed).
    - ``args.ignore_data_skip = True`` as the ``Trainer`` is built (and again
      at ``on_train_begin``, for a callback added later): the ``Trainer`` then
      skips no batches; the loader, resumed, yields only the rest of the epoch.

    Args:
        loader: the training ``EchoLoader``; None: the ``Trainer``'s
            ``train_dataloader`` (what ``get_train_dataloader`` returned).

    Raises:
        TypeError: (at ``on_train_begin``) no loader given and the ``Trainer``'s
            training loader is not an ``EchoLoader``.
        ValueError: a saved state of another step than the checkpoint's.
    """

    def __init__(self, loader: EchoLoader | None = None) -> None:
        self.loader = loader

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The Trainer decides what to skip before on_train_begin, from this flag.
        args.ignore_data_skip = True

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        args.ignore_data_skip = True  # a callback added later: the Trainer reads the flag again as an epoch starts
        loader = self.training_loader(kwargs.get("train_dataloader"))
        if state.global_step == 0:
            return  # a fresh run: a loaded TrainerState has the step it was saved at
        folder = resumed_from(args, state)
        saved = read_states(folder, args.process_index, args.world_size)
        if saved is None:
            warnings.warn(f"EchoLoaderCallback: no loader state in {folder} (saved without this callback?): "
                          "the loader starts the resumed epoch again from its first batch", stacklevel=2)
            return
        step, states = saved
        if step != state.global_step:
            raise ValueError(f"EchoLoaderCallback: the loader state in {folder} is of step {step}, "
                             f"its trainer_state.json of step {state.global_step}")
        loader.load_state_dict(states)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = self.training_loader(kwargs.get("train_dataloader"))
        folder = os.path.join(args.output_dir, state.trial_name or "", f"checkpoint-{state.global_step}")
        write_state(folder, args.process_index, args.world_size, state.global_step, loader.state_dict())

    def training_loader(self, train_dataloader: Any) -> EchoLoader:
        """The loader given, else the Trainer's training loader if it is an EchoLoader."""
        loader = self.loader if self.loader is not None else train_dataloader
        if not isinstance(loader, EchoLoader):
            raise TypeError(f"EchoLoaderCallback: the Trainer trains on a {type(loader).__name__}, "
                            "not an EchoLoader: return the EchoLoader from get_train_dataloader, or pass it "
                            "as EchoLoaderCallback(loader)")
        return loader


def resumed_from(args: Any, state: Any) -> str:
    """The checkpoint folder ``Trainer.train`` resumes from: its argument
    ``resume_from_checkpoint``, read from the innermost ``train`` frame of a
    ``Trainer`` (where ``train`` has resolved ``True`` to the last checkpoint),
    for the folder may be anywhere; where there is none, the folder of the
    loaded step in ``output_dir``."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "train" and isinstance(frame.f_locals.get("self"), transformers.Trainer):
                folder = frame.f_locals.get("resume_from_checkpoint")
                if folder is True:  # an override of train that has not resolved it yet
                    folder = get_last_checkpoint(args.output_dir)
                if isinstance(folder, (str, os.PathLike)):
                    return os.fspath(folder)
                break
            frame = frame.f_back
    finally:
        del frame  # a frame held here would keep the Trainer's locals alive
    return os.path.join(args.output_dir, state.trial_name or "", f"checkpoint-{state.global_step}")


def write_state(folder: str, rank: int, world_size: int, step: int, loader_state: dict[str, Any]) -> None:
    """Writes one process's loader state (plain values) into a checkpoint
    folder as JSON, atomically: a crash while writing leaves the previous file
    or none."""
    record = {"global_step": step, "rank": rank, "world_size": world_size, "loader": loader_state}
    os.makedirs(folder, exist_ok=True)  # another process may not have created it yet
    path = os.path.join(folder, STATE_FILE.format(rank=rank))
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def read_state(folder: str, rank: int) -> dict[str, Any] | None:
    """The record ``write_state`` wrote for ``rank`` in ``folder``, or None."""
    path = os.path.join(folder, STATE_FILE.format(rank=rank))
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_states(folder: str, rank: int, world_size: int) -> tuple[int, Any] | None:
    """(step, what ``loader.load_state_dict`` takes) for ``rank`` of a job of
    ``world_size``: the state this rank saved where the saving job had the same
    world size, else rank 0's (any rank's state resumes every rank of a job of
    any world size where reading is deterministic; ``load_state_dict`` says
    where it cannot). None: the folder has no loader state."""
    record = read_state(folder, rank) if _saved_world(folder) == world_size else None
    record = record or read_state(folder, 0)
    return None if record is None else (record["global_step"], record["loader"])


def _saved_world(folder: str) -> int | None:
    record = read_state(folder, 0)
    return None if record is None else record["world_size"]
