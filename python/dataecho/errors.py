"""Exceptions raised by dataecho."""

from __future__ import annotations

__all__ = ["BufferClosed", "stop_iteration_error"]


class BufferClosed(RuntimeError):
    """Raised by ``put``/``put_many`` on a buffer whose input has been closed."""


def stop_iteration_error(stop: StopIteration, where: str = "source, transform or augment") -> RuntimeError:
    """The error that a StopIteration raised by user code becomes (its cause):
    raised in the training loop as it is, it would end the epoch silently,
    short of examples (as in a generator, PEP 479)."""
    error = RuntimeError(
        f"{where} raised StopIteration (a next() on an exhausted iterator, say); in a data pipeline it would "
        "end the epoch silently, short of examples, so it is an error here, as in a generator"
    )
    error.__cause__ = stop
    return error
