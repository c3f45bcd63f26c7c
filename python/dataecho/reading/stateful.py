"""The own state of a sampler or a map-style dataset that keeps one, saved and
restored as torchdata's ``StatefulDataLoader`` does: an object is *stateful*
when its type has ``state_dict()`` and ``load_state_dict(state)``; a
sampler's iterator may be too (torchdata's ``RandomSampler`` keeps its
generator there).

A sampler's state is taken once its epoch's indices were read (at the epoch's
start where it has a length; as far as they were read, for one without), and
is saved beside the order it gave. A resume uses the saved order, and restores
the sampler to where it stood after giving it (:func:`restored`), so that the
epochs after the resumed one get the indices they would have got: a sampler
whose generator or epoch count moves as it is read goes on as it would have.

A map-style dataset's state is taken from the loader's own dataset object when
a state is taken, and loaded into it before the resumed epoch reads (worker
processes start from that object).
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

__all__ = ["is_stateful", "restored", "sampler_state", "state_of"]


def is_stateful(obj: Any) -> bool:
    """Whether ``obj``'s type has ``state_dict()`` and ``load_state_dict(state)``."""
    kind = type(obj)
    return callable(getattr(kind, "state_dict", None)) and callable(getattr(kind, "load_state_dict", None))


def state_of(obj: Any) -> Any:
    """A copy of ``obj.state_dict()`` (an owner may go on changing the dict it
    hands out), or None where ``obj`` is not stateful."""
    return copy.deepcopy(obj.state_dict()) if is_stateful(obj) else None


def sampler_state(sampler: Any, iterator: Iterator[Any]) -> dict[str, Any] | None:
    """Where ``sampler`` and ``iterator`` (one of its) stand: ``{"sampler": ...,
    "iterator": ...}``, each where it is stateful; None where neither is."""
    state = {key: own for key, own in (("sampler", state_of(sampler)), ("iterator", state_of(iterator)))
             if own is not None}
    return state or None


def restored(sampler: Any, state: Any) -> Iterator[Any]:
    """A new iterator of ``sampler`` where ``state`` (:func:`sampler_state`'s)
    stood: the sampler's state loaded, then ``iter(sampler)``, then the
    iterator's state loaded, as ``StatefulDataLoader`` restores them.

    Raises:
        ValueError: ``state`` holds a state for one that is not stateful.
    """
    if "sampler" in state:
        if not is_stateful(sampler):
            raise ValueError(f"state['stages']['intake']['sampler']: holds a sampler's state, but this loader's "
                             f"sampler ({type(sampler).__name__}) has no load_state_dict")
        sampler.load_state_dict(state["sampler"])
    iterator = iter(sampler)
    if "iterator" in state:
        if not is_stateful(iterator):
            raise ValueError(f"state['stages']['intake']['sampler']: holds a sampler iterator's state, but "
                             f"{type(sampler).__name__}'s iterator has no load_state_dict")
        iterator.load_state_dict(state["iterator"])
    return iterator
