"""Echo as a Grain transformation: :class:`EchoIterDataset`, an ``IterDataset``
whose iterator repeats the examples of its parent's through dataecho's echo
buffer, in a Grain pipeline such as::

    ds = (grain.MapDataset.source(source).shuffle(seed=0).map(decode)
          .to_iter_dataset())
    ds = dataecho.grain.EchoIterDataset(ds, echo_factor=2).batch(256)

It is built on ``EchoLoader`` (dataecho.echo_step), reading its parent in the
thread that iterates it. Importing this module imports Grain; ``import
dataecho`` does not.
"""

from __future__ import annotations

from typing import Any, Callable

import grain

from .echo_step import EchoStep, Upstream, check_options

__all__ = ["EchoIterDataset"]


class EchoIterDataset(grain.IterDataset):
    """Repeats the examples of ``parent`` through an echo buffer (data echoing).

    Examples from the parent's iterator enter a shuffle buffer of
    ``shuffle_buffer`` examples and come out one by one, each ``echo_factor``
    times, reshuffled, as the parent yielded them (so Grain's own ``.batch()``
    composes after it). With ``batch_size`` it yields the batches the buffer
    assembles natively instead (stacked NumPy leaves; no example twice in a
    batch while a batch of them is resident, which ``"auto"`` may not keep
    once the loop outruns the parent), faster than ``.batch()`` after
    one-by-one examples. The parent is read in the thread that iterates; with
    ``"auto"``, on one thread of the iterator's own (whether the loop would
    wait shows only while reading goes on beside it).

    Its iterator's ``get_state()`` is ``{"parent": ..., "echo": ...}``, of
    one structure from before the first element to after the last (as Grain
    asks):

    - ``parent``: the parent iterator's own ``get_state()``, taken before the
      earliest example the echo state names (or where the parent stood, before
      the first example or after the last);
    - ``echo``: the echo step's own, ``{"epoch": int, "ended": bool,
      "loader": str}``: ``loader`` is the EchoLoader's state as one JSON
      string (its RNG counter, and the examples resident in the buffer and in
      batches on their way, named by their position in the parent's
      iteration, with their remaining echoes; never the examples themselves:
      see dataecho.echo_step), since its shape changes as examples come and go.

    ``set_state()`` puts the parent in its state and reads it from there up to
    where the echo state stood, keeping the examples it names: for a
    deterministic parent (one that yields the same examples again from the
    same state), a fixed or fractional ``echo_factor`` resumes exactly.
    ``"auto"`` echoes by timing: a resume goes on from where the parent had
    been read, and the examples resident then are not delivered again.

    ``get_state()`` costs about 0.3 us and 15 bytes of JSON per resident
    example: Grain's ``mp_prefetch`` takes one per element, so put it upstream
    of the echo (where the slow work is), not after it.

    Args:
        parent: the ``grain.IterDataset`` whose examples are echoed (a
            ``MapDataset`` after ``.to_iter_dataset()``).
        echo_factor: deliveries per example: a number >= 1 (fractional:
            ``floor(e)`` or ``floor(e) + 1`` each) or ``"auto"`` (repeats only
            while the consumer would wait, up to about ``max_echo``).
        shuffle_buffer: examples the echo buffer holds.
        seed: seeds the shuffle and the echo counts.
        batch_size: None yields examples one by one; an int yields native batches.
        max_echo: with ``"auto"``, the most deliveries per example (about).
        drop_last: with ``batch_size``, drop the last short batch.
        augment: per-example function run on every repeat anew (after the echo);
            ``augment(example, rng=...)`` where it takes ``rng`` (needed to save
            a state mid-iteration).
        ragged, ragged_bytes, padding: leaves of varying length (see ``EchoLoader``).

    Raises:
        TypeError, ValueError: a bad argument, named in the message.
    """

    def __init__(self, parent: grain.IterDataset, echo_factor: float | str = 2, shuffle_buffer: int = 4096,
                 seed: int = 0, batch_size: int | None = None, *, max_echo: float = 4.0, drop_last: bool = False,
                 augment: Callable[..., Any] | None = None, ragged: Any = None, ragged_bytes: int | None = None,
                 padding: int | str | None = None) -> None:
        if not isinstance(parent, grain.IterDataset):
            hint = " (call .to_iter_dataset() on it first)" if isinstance(parent, grain.MapDataset) else ""
            raise TypeError(f"parent: expected a grain.IterDataset{hint}, got {type(parent).__name__}")
        super().__init__(parent)
        self._options = dict(echo_factor=echo_factor, shuffle_buffer=shuffle_buffer, seed=seed,
                             batch_size=batch_size, max_echo=max_echo, drop_last=drop_last, augment=augment,
                             ragged=ragged, ragged_bytes=ragged_bytes, padding=padding)
        check_options(self._options)

    def __iter__(self) -> grain.DatasetIterator:
        return _EchoDatasetIterator(self._parent.__iter__(), self._options)

    def __str__(self) -> str:
        options = self._options
        return (f"EchoIterDataset(echo_factor={options['echo_factor']!r}, shuffle_buffer={options['shuffle_buffer']}, "
                f"seed={options['seed']}, batch_size={options['batch_size']})")


class _EchoDatasetIterator(grain.DatasetIterator):
    """The iterator of an :class:`EchoIterDataset` (its docstring says what its state holds)."""

    def __init__(self, parent: grain.DatasetIterator, options: dict[str, Any]) -> None:
        super().__init__(parent)
        self._step = EchoStep(Upstream(parent, parent.get_state, parent.set_state), **options)
        self._step.begin(0)

    def __next__(self) -> Any:
        self._assert_not_closed()
        return self._step.next()

    def get_state(self) -> dict[str, Any]:
        parent, echo = self._step.state()
        return {"parent": parent, "echo": echo}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or not {"parent", "echo"} <= set(state):
            raise ValueError(f"state: expected a dict with 'parent' and 'echo', as get_state() gives, "
                             f"got {state!r:.80}")
        self._step.restore(state["parent"], state["echo"], "state['echo']")

    def close(self) -> None:
        self._step.close()
        super().close()

    def __str__(self) -> str:
        return "EchoDatasetIterator"
