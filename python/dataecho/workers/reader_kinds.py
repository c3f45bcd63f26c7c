"""The kinds of reader (dataecho.workers.readers), by ``WorkersSpec.kind``: a
new kind is a module exporting its ``KIND``, and one line here."""

from __future__ import annotations

from . import inline_reader, process_readers, thread_readers
from .readers import Kind
from .spec import WorkersSpec

__all__ = ["KINDS", "kind_of"]

KINDS: dict[str, Kind] = {
    "inline": inline_reader.KIND,
    "thread": thread_readers.KIND,
    "process": process_readers.KIND,
}


def kind_of(spec: WorkersSpec) -> Kind:
    """The kind of reader ``spec`` names."""
    return KINDS[spec.kind]
