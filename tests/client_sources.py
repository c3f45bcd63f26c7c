"""A Lightning module for test_clients.py (imported by module name, so that torch
and Lightning come along only where a test uses them)."""

from __future__ import annotations

from collections import defaultdict

import pytorch_lightning as pl
import torch
from support import PAYLOAD, checked_ids

# What the module learns: a fixed linear function of the example's payload.
TARGET_WEIGHTS = torch.linspace(-1.0, 1.0, PAYLOAD)


class Regression(pl.LightningModule):
    """A Linear layer, starting at zero, that learns TARGET_WEIGHTS from batches of
    support's id/payload examples, and notes the ids of every batch it trains or
    validates on, by epoch.

    Attributes:
        trained, validated: epoch -> the ids of each batch, in the order taken.
        sanity: the ids of the batches of Lightning's sanity check (before epoch 0).
        losses: epoch -> the training loss of each batch.
    """

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.linear = torch.nn.Linear(PAYLOAD, 1)
        torch.nn.init.zeros_(self.linear.weight)  # no draw from torch's global generator
        torch.nn.init.zeros_(self.linear.bias)
        self.trained: defaultdict[int, list[list[int]]] = defaultdict(list)
        self.validated: defaultdict[int, list[list[int]]] = defaultdict(list)
        self.sanity: list[list[int]] = []
        self.losses: defaultdict[int, list[float]] = defaultdict(list)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        x = batch["payload"].float() / 211  # payload bytes are below 211
        return torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), x @ TARGET_WEIGHTS)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.trained[self.current_epoch].append(checked_ids(batch).tolist())
        loss = self.loss(batch)
        self.losses[self.current_epoch].append(loss.item())
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        seen = self.sanity if self.trainer.sanity_checking else self.validated[self.current_epoch]
        seen.append(checked_ids(batch).tolist())
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)
