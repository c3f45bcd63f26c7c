"""Exceptions raised by dataecho."""

from __future__ import annotations

__all__ = ["BufferClosed"]


class BufferClosed(RuntimeError):
    """Raised by ``put``/``put_many`` on a buffer whose input has been closed."""
