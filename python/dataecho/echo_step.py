"""The echo step of a composed pipeline: an ``EchoLoader`` over an upstream
iterator that has a state of its own, read in the caller's thread
(``num_workers=0``, as a pipeline step wants; with ``"auto"``, on one thread
of its own: see EchoStep), one epoch at a time.
dataecho.grain and dataecho.nodes wrap it in their library's protocol.

The upstream is given to the loader as a restartable iterable
(dataecho.reading.restart): as the loader reads it, it marks the upstream's
state before each chunk, and its state names where the upstream can restart.
The step's state keeps the upstream's beside its own, never inside:

    upstream  the upstream's state (what its ``get_state``/``state_dict``
              gave) where the step's reading must begin again: before the
              earliest example its own state names, or where it stood, if it
              names none yet; the libraries nest it under their own key
    echo      the step's own, of one structure throughout the step's life
              (Grain asks for that: a checkpointer may rely on it): ``epoch``
              (an int), ``ended`` (a bool: it yielded its last example) and
              ``loader`` (a str: the EchoLoader's state,
              dataecho.pipeline.checkpoint, in JSON with sorted keys; ``null``
              once ended), whose intake's ``restart`` keeps the upstream
              state's ``position`` alone. The loader's state changes shape as
              examples come and go (lists that grow and shrink, None before the
              first): as one string it changes only in value.

What is exact: a fixed or fractional ``echo_factor`` over a deterministic
upstream (one that yields the same examples again from the same state)
resumes with exactly the examples, echoes and order the uninterrupted step
would have yielded. ``"auto"`` repeats while the consumer would wait, which is
timing: its state says how far the upstream was read, the examples then
resident in the echo buffer are not delivered again, and the order after a
resume is another.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any, Callable, Iterator

import numpy as np

from .loader import EchoLoader

__all__ = ["EchoStep", "Upstream", "check_options"]


class Upstream:
    """An upstream iterator with a state of its own, as a restartable iterable
    (dataecho.reading.restart): iterating it goes on from where it stands.

    Args:
        iterator: the upstream iterator (a Grain ``DatasetIterator``, a torchdata ``BaseNode``).
        get_state: its state now.
        set_state: puts it in a state ``get_state`` gave.
    """

    def __init__(self, iterator: Iterator[Any], get_state: Callable[[], Any],
                 set_state: Callable[[Any], Any]) -> None:
        self._iterator, self._get_state, self._set_state = iterator, get_state, set_state

    def __iter__(self) -> Iterator[Any]:
        return self._iterator

    def state(self) -> Any:
        """The upstream's state now, copied: reading on must not change a mark."""
        return copy.deepcopy(self._get_state())

    def state_of(self, iterator: Iterator[Any]) -> Any:
        return self.state()

    def iter_from(self, state: Any) -> Iterator[Any]:
        # A copy: an upstream may keep what it is given, and change it as it reads.
        self._set_state(copy.deepcopy(state))
        return self._iterator


class EchoStep:
    """An EchoLoader over an :class:`Upstream`, one epoch at a time, whose
    state keeps the upstream's beside its own (see the module docstring).

    Args:
        upstream: the upstream.
        **options: EchoLoader's keywords (``batch_size``, ``echo_factor``,
            ``shuffle_buffer``, ``seed``, ...). Reading is local to this
            process (never sharded: shard upstream), in the caller's thread
            (``num_workers=0``), or with ``"auto"`` on one reading thread.

    Raises:
        TypeError, ValueError: a bad option, named as EchoLoader names it.
    """

    def __init__(self, upstream: Upstream, **options: Any) -> None:
        self._upstream = upstream
        # "auto" repeats while the consumer would wait, which shows only while
        # reading goes on beside it: one reading thread then, the upstream's
        # only user. Else the consumer's thread reads, when it asks.
        workers = 1 if options.get("echo_factor") == "auto" else 0
        self.loader = EchoLoader(upstream, num_workers=workers, rank=0, world_size=1, **options)
        self.epoch, self.begun = 0, False
        self._ended = False
        self._batches: Any = None  # the loader's epoch being read, once the first example is asked for
        # A state restored and not read on from yet: state() gives it back as it
        # came (Grain checks that), not as the loader's load normalized it.
        self._restored: tuple[Any, dict[str, Any]] | None = None

    def begin(self, epoch: int, restart: Callable[[], Any] | None = None) -> None:
        """Starts epoch ``epoch`` (its echo seeds) from where the upstream stands.

        Args:
            epoch: the epoch's number.
            restart: puts the upstream where the epoch begins (a node's
                ``reset(None)``), called once the epoch being read has stopped:
                its reading thread (``"auto"``) would take the new epoch's
                first examples.
        """
        self.close()
        if restart is not None:
            restart()
        self.loader.set_epoch(epoch)
        self.epoch, self.begun, self._ended = epoch, True, False
        self._restored = None

    def next(self) -> Any:
        """The next example (``batch_size=None``) or batch.

        Raises:
            StopIteration: the epoch has ended.
        """
        if self._ended:
            raise StopIteration
        if self._batches is None:
            self._batches, self._restored = iter(self.loader), None
        try:
            return next(self._batches)
        except StopIteration:
            self._ended, self._batches = True, None
            raise

    def state(self) -> tuple[Any, dict[str, Any]]:
        """(the upstream's state, the step's own): see the module docstring.
        A state just restored is given back as it came, until the next example.

        Raises:
            ValueError: a step whose state cannot be saved mid-epoch (an
                ``augment`` that does not take ``rng``), saying why.
        """
        if self._restored is not None:
            upstream, own = self._restored
            return copy.deepcopy(upstream), dict(own)
        loader = None if self._ended else self.loader.state_dict()
        restart = (loader["stages"] or {}).get("intake", {}).get("restart") if loader else None
        if restart is None:  # nothing of this epoch read yet (or all of it): where the upstream stands
            upstream = self._upstream.state()
        else:
            upstream = restart["state"]
            loader = _with_restart(loader, {"position": restart["position"]})
        return upstream, {"epoch": self.epoch, "ended": self._ended,
                          "loader": json.dumps(loader, sort_keys=True, default=_plain_leaf)}

    def restore(self, upstream: Any, own: Any, where: str) -> None:
        """Resumes from ``state()``'s result; ``where`` names ``own`` in messages.

        Raises:
            TypeError, ValueError: a state this step could not have saved, or
                one of a step with other options that decide its examples (named).
        """
        epoch, ended, loader = _checked(own, where)
        stages = loader.get("stages") if loader is not None else None
        intake = stages.get("intake") if isinstance(stages, dict) else None
        restart = intake.get("restart") if isinstance(intake, dict) else None
        if restart is not None and not isinstance(restart, dict):
            raise ValueError(f"{where}['loader']: expected its ['stages']['intake']['restart'] to be a dict "
                             f"with 'position'")
        # The epoch being read stops first: its reading thread ("auto") would
        # otherwise read on from wherever the upstream is put next.
        self.close()
        self._restored = None
        if restart is not None:  # the loader restarts the upstream there as it resumes
            loader = _with_restart(loader, {"position": restart.get("position"), "state": upstream})
        if loader is not None:
            self.loader.load_state_dict(loader)  # checked first: a state refused changes nothing
        if restart is None:  # the step's reading begins where the upstream is put now
            self._upstream.iter_from(upstream)
        self.epoch, self.begun, self._ended = epoch, True, ended
        self._restored = copy.deepcopy(upstream), {"epoch": epoch, "ended": ended, "loader": own["loader"]}

    def close(self, _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
        """Stops the epoch being read, if any (the loader keeps its memory for the next)."""
        batches, self._batches = self._batches, None
        # At interpreter exit (a library's iterator closed from its __del__, its
        # module's globals perhaps gone: hence the bound default) the epoch is
        # left to stop itself as it is collected (Epoch.__del__).
        if batches is not None and not _finalizing():
            batches.close()


def check_options(options: dict[str, Any]) -> None:
    """Checks an echo step's EchoLoader keywords now, where the step is
    declared, rather than when its first iterator starts.

    Raises:
        TypeError, ValueError: a bad option, named as EchoLoader names it.
    """
    EchoStep(Upstream(iter(()), dict, lambda state: None), **options).loader.close()


def _checked(own: Any, where: str) -> tuple[int, bool, dict[str, Any] | None]:
    """(epoch, ended, the EchoLoader's state parsed) of an echo step's own state.

    Raises:
        ValueError: ``own`` is not such a state (``where`` names it).
    """
    if not isinstance(own, dict) or not {"epoch", "ended", "loader"} <= set(own):
        raise ValueError(f"{where}: expected the echo step's state, a dict with 'epoch', 'ended' and 'loader'")
    epoch, ended, text = own["epoch"], own["ended"], own["loader"]
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0 or not isinstance(ended, bool):
        raise ValueError(f"{where}: expected an int 'epoch' >= 0 and a bool 'ended', got {epoch!r}, {ended!r}")
    if not isinstance(text, str):
        raise ValueError(f"{where}['loader']: expected the EchoLoader's state as a JSON string, as the echo's "
                         f"state gives it, got {type(text).__name__}")
    try:
        loader = json.loads(text)
    except ValueError as error:
        raise ValueError(f"{where}['loader']: not the EchoLoader's state in JSON ({error})") from None
    if loader is not None and not isinstance(loader, dict):
        raise ValueError(f"{where}['loader']: expected an EchoLoader state (a JSON object) or null, "
                         f"got {type(loader).__name__}")
    return epoch, ended, loader


def _with_restart(loader: dict[str, Any], restart: dict[str, Any]) -> dict[str, Any]:
    """An EchoLoader state with its intake's ``restart`` replaced (copying what changes)."""
    stages = loader["stages"]
    return {**loader, "stages": {**stages, "intake": {**stages["intake"], "restart": restart}}}


def _plain_leaf(value: Any) -> Any:
    """A leaf JSON has no type for, in plain values (``json.dumps``'s
    ``default``): arrays become lists, NumPy scalars Python numbers.

    Raises:
        TypeError: a value that is neither.
    """
    if isinstance(value, (np.ndarray, np.generic)):
        return value.tolist()
    raise TypeError(f"an echo state holds plain values and arrays, not {type(value).__name__}")
