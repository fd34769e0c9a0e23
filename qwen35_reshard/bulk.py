"""Building and reading named tuples in bulk, at C speed, the collector paused around
them, and what they freed handed back: the tricks the hot loops share.

A 397B FP8 checkpoint has ~190,000 tensors; the source, the planner and the manifest make
or read one named tuple per tensor, so a Python-level call per tensor shows in the plan time.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import repeat
from operator import itemgetter
from typing import Any, TypeVar

T = TypeVar("T", bound=tuple)


def make_tuple(cls: type[T], values: Iterable[Any]) -> T:
    """``cls(*values)`` for a named tuple ``cls``, without its Python-level ``__new__``."""
    return tuple.__new__(cls, values)


def make_tuples(cls: type[T], rows: Iterable[Iterable[Any]]) -> Iterator[T]:
    """``cls(*row)`` for every row: ``tuple.__new__`` mapped over the rows, all in C."""
    return map(tuple.__new__, repeat(cls), rows)


def field_getters(cls: type[tuple], *fields: str) -> tuple[itemgetter, ...]:
    """A getter of each named field of the named tuple ``cls``.

    By position (an ``itemgetter``: faster than the field's attribute over a whole column),
    the position looked up from the field's name, so no caller depends on the field order.
    """
    return tuple(itemgetter(cls._fields.index(f)) for f in fields)  # type: ignore[attr-defined]


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector, if on, for the duration; the caller's state after.

    Why: reading, planning and checking make a few objects per tensor, none of them cyclic, and
    each collection they trigger walks every object of the process (in a server that has built
    its model, millions). A caller that had disabled the collector keeps it disabled; nothing is
    frozen (the CLI's own process keeps its collector off: see ``cli.process``).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def return_freed_memory() -> None:
    """Hand the heap memory this process has freed back to the operating system, where the C
    library can: glibc's ``malloc_trim(0)``; elsewhere nothing.

    Why: glibc keeps freed heap memory for the process's own later use, so a server rank's
    planning (per-tensor objects of a whole checkpoint, freed once its stage is known) would
    stay in the rank's RSS while its weights load: with the largest shapes (~290,000 tensors)
    ~60 MB of ~120 MB. A call costs ~10 ms.

    Example:
        >>> return_freed_memory()
    """
    import ctypes  # only here: the package's readers do not load ctypes for this

    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)
