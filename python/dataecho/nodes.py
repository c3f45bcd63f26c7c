"""Echo as a ``torchdata.nodes`` node: :class:`Echo` repeats the examples of
its source node through dataecho's echo buffer, in a pipeline such as::

    node = torchdata.nodes.ParallelMapper(IterableWrapper(records), decode, num_workers=4)
    node = dataecho.nodes.Echo(node, echo_factor=2, batch_size=256, output="torch")
    loader = torchdata.nodes.Loader(node)

It is built on ``EchoLoader`` (dataecho.echo_step), reading its source in the
thread that iterates it. Importing this module imports torchdata (and torch);
``import dataecho`` does not.
"""

from __future__ import annotations

from typing import Any, Callable

from torchdata.nodes import BaseNode

from .echo_step import EchoStep, Upstream

__all__ = ["Echo"]


class Echo(BaseNode):
    """Repeats the examples of ``source`` through an echo buffer (data echoing).

    Examples from ``source`` enter a shuffle buffer of ``shuffle_buffer``
    examples and come out one by one, each ``echo_factor`` times, reshuffled,
    as the source yielded them (so ``Batcher`` composes after it); with
    ``batch_size`` it yields the batches the buffer assembles natively
    (stacked leaves; no example twice in a batch while a batch of them is
    resident, which ``"auto"`` may not keep once the loop outruns the
    source). ``reset()`` starts the next epoch, with new echo seeds: it stops
    the epoch being read, then resets the source. The source is read in the
    thread that calls ``next()``; with ``"auto"``, on one thread of the
    node's own (whether the loop would wait shows only while reading goes on
    beside it).

    Its state (``state_dict()``) nests the source's, as torchdata's nodes do:
    ``{"source": ..., "echo": ...}``:

    - ``source``: the source node's own ``state_dict()``, taken before the
      earliest example the echo state names (or where the source stood,
      before the epoch's first example or after its last);
    - ``echo``: the node's own, ``{"epoch": int, "ended": bool, "loader":
      str}``, of one structure at every item: ``loader`` is the EchoLoader's
      state as one JSON string (the RNG counter, and the examples resident in
      the buffer and in batches on their way, named by their position in the
      source's iteration, with their remaining echoes; never the examples
      themselves: see dataecho.echo_step), since its shape changes as
      examples come and go.

    ``reset(state)`` resets the source to its state and reads it from there up
    to where the echo state stood, keeping the examples it names: for a
    deterministic source, a fixed or fractional ``echo_factor`` resumes
    exactly. ``"auto"`` echoes by timing: a resume goes on from where the
    source had been read, and the examples resident then are not delivered
    again.

    A state costs about 0.3 us per resident example: a ``Prefetcher`` or
    ``ParallelMapper`` after the echo takes one per item it passes on (its
    ``snapshot_frequency``), so put them upstream of it, or raise that.

    Args:
        source: the ``BaseNode`` whose examples are echoed.
        echo_factor: deliveries per example: a number >= 1 (fractional:
            ``floor(e)`` or ``floor(e) + 1`` each) or ``"auto"`` (repeats only
            while the consumer would wait, up to about ``max_echo``).
        shuffle_buffer: examples the echo buffer holds.
        seed: seeds the shuffle and the echo counts, with the epoch.
        batch_size: None yields examples one by one; an int yields native batches.
        output: ``"numpy"`` or ``"torch"`` (tensors over the batch memory).
        max_echo, drop_last, augment, ragged, ragged_bytes, padding: as
            ``EchoLoader``'s (``augment`` runs on every repeat anew; it must
            take ``rng`` for a state to be saved mid-epoch).

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
    """

    SOURCE_KEY = "source"
    ECHO_KEY = "echo"

    def __init__(self, source: BaseNode, echo_factor: float | str = 2, shuffle_buffer: int = 4096, seed: int = 0,
                 batch_size: int | None = None, *, max_echo: float = 4.0, drop_last: bool = False,
                 output: str = "numpy", augment: Callable[..., Any] | None = None, ragged: Any = None,
                 ragged_bytes: int | None = None, padding: int | str | None = None) -> None:
        super().__init__()
        if not isinstance(source, BaseNode):
            raise TypeError(f"source: expected a torchdata.nodes.BaseNode (an iterable: wrap it in "
                            f"IterableWrapper), got {type(source).__name__}")
        self.source = source
        options = dict(echo_factor=echo_factor, shuffle_buffer=shuffle_buffer, seed=seed, batch_size=batch_size,
                       max_echo=max_echo, drop_last=drop_last, output=output, augment=augment, ragged=ragged,
                       ragged_bytes=ragged_bytes, padding=padding)
        # Checks the options now; the loader is made once, and its echo buffer's memory serves every epoch.
        self._step = EchoStep(Upstream(source, source.state_dict, source.reset), **options)

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        super().reset(initial_state)
        if initial_state is None:
            # The source is reset only once the epoch being read has stopped (begin's `restart`).
            self._step.begin(self._step.epoch + 1 if self._step.begun else 0, lambda: self.source.reset(None))
            return
        if not isinstance(initial_state, dict) or not {self.SOURCE_KEY, self.ECHO_KEY} <= set(initial_state):
            raise ValueError(f"initial_state: expected a dict with {self.SOURCE_KEY!r} and {self.ECHO_KEY!r}, as "
                             f"state_dict() gives, got {initial_state!r:.80}")
        self._step.restore(initial_state[self.SOURCE_KEY], initial_state[self.ECHO_KEY],
                           f"initial_state[{self.ECHO_KEY!r}]")

    def next(self) -> Any:
        return self._step.next()

    def get_state(self) -> dict[str, Any]:
        source, echo = self._step.state()
        return {self.SOURCE_KEY: source, self.ECHO_KEY: echo}
