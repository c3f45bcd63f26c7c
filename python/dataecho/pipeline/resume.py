"""Loading a checkpoint into a loader: the configuration and plan that resume
it, the state checked against them (dataecho.pipeline.checkpoint), and what a
resume that cannot be exact would lose, said at load time."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np

from .chain import state_checks
from .checkpoint import check_state
from .elastic import redistributed
from .plan import Plan, plan

__all__ = ["resumed"]


def resumed(config: Any, planned: Plan, state: Any) -> tuple[Any, Plan, dict[str, Any]]:
    """(configuration, plan, checked state) that resume ``state``: a loader
    that drew its own seed (none given) takes the state's, so that a job
    restarted with the same arguments resumes as StatefulDataLoader does.

    Args:
        config: the loader's ``LoaderConfig``.
        planned: its plan.
        state: what ``state_dict()`` returned.

    Raises:
        TypeError, ValueError: a state that is not one, or was saved by a
            loader with other arguments that decide the batches (named).
    """
    if isinstance(state, (list, tuple)):  # every rank's state, of a job of any world size
        state = redistributed(list(state), config, _checked_old)
    saved = state.get("config") if isinstance(state, dict) else None
    if not config.seed_given and isinstance(saved, dict) and saved.get("seed") not in (None, config.seed):
        config = config.with_seed(saved["seed"])
        planned = plan(config)
    checked = check_state(state, config.fingerprint(), state_checks(planned),
                          functools.partial(_saved_order, planned.source.order), planned.checkpoint)
    if planned.checkpoint == "skip" and checked["stages"] is not None:
        warnings.warn(
            f"load_state_dict: this loader reads an iterable in no fixed order (deterministic=False, or a Ray "
            f"dataset), so resuming skips the {checked['stages']['intake']['skip']} examples taken from it "
            f"before the state was saved, those taken but not yet delivered (resident in the echo buffer, or "
            f"in batches on their way) included; with deterministic=True a resume delivers exactly the "
            f"examples not yet delivered", UserWarning, stacklevel=3)
    return config, planned, checked


def _checked_old(state: dict, config: Any) -> tuple[dict, np.ndarray]:
    """One rank's state of a job being resumed under another world size,
    checked as a loader of ``config`` (that rank) would; and the order it read."""
    planned = plan(config)
    if planned.checkpoint != "exact" or planned.source.order is None or planned.reads_batches:
        raise ValueError("load_state_dict: resuming mid-epoch under another world size needs exact states of "
                         "single examples: a map-style dataset read in a deterministic order (the default), "
                         "without a batch_sampler")
    order_of = functools.partial(_saved_order, planned.source.order)
    checked = check_state(state, config.fingerprint(), state_checks(planned), order_of, planned.checkpoint)
    return checked, order_of(checked["epoch"], checked["stages"]["intake"].get("order"))


def _saved_order(order: Any, epoch: int, saved: np.ndarray | None) -> np.ndarray | None:
    """The order of the epoch a state resumes: the one it saved (a sampler's or
    a batch sampler's, never drawn again: a RandomSampler would give another;
    one spread over another world size), else a map-style source's own; None
    for an iterable."""
    if order is None:
        return None
    if not order.sampled and saved is None:
        return order.order(epoch)
    if saved is None:
        raise ValueError("state['stages']['intake']['order']: missing; a state of a loader with a sampler or a "
                         "batch_sampler saves its order")
    if len(saved) and saved.max() >= len(order.dataset):
        raise ValueError("state['stages']['intake']['order']: indices beyond the dataset")
    return saved
