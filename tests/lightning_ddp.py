"""A Lightning job with ``strategy="ddp"`` on two CPU ranks, fed by an
``EchoLoader`` built before the process group exists and handed to
``Trainer.fit``: ``python lightning_ddp.py <out dir> <echo_factor>``. Lightning
starts the second rank by running this script again; each rank writes the ids
it trained on to ``<out dir>/rank<r>.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch

import dataecho


class Ids(pl.LightningModule):
    """A model of one weight whose training steps record their batches' ids."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.seen: list[int] = []

    def training_step(self, batch, batch_index):
        self.seen += batch["id"].tolist()
        return (self.weight * batch["x"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    out, echo = Path(sys.argv[1]), sys.argv[2]
    dataset = [{"id": i, "x": np.full(4, i, dtype=np.float32)} for i in range(400)]
    loader = dataecho.EchoLoader(dataset, batch_size=8, echo_factor=float(echo) if echo != "auto" else echo,
                                 output="torch", num_workers=1)
    model = Ids()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, train_dataloaders=loader)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    (out / f"rank{rank}.json").write_text(json.dumps({"ids": model.seen, "world_size": loader.world_size}))


if __name__ == "__main__":
    main()
