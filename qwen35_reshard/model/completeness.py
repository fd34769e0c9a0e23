"""Compare a checkpoint's (or a stage's) tensors with its schema: what is missing, what has
another shape, and the one-line refusal of ``check_complete``."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import compress
from operator import attrgetter
from typing import Protocol

from ..errors import BadInput
from ..format.names import CONFIG_NAME

_SHAPE = attrgetter("shape")


class Schema(Protocol):
    """What of ``schema.Schema`` the comparison reads (schema.py imports this module)."""

    names: list[str]
    shapes: list[tuple[int, ...] | None]
    problems: list[tuple[str, str]]
    found: list[object]
    looked_up_in: Mapping[str, object] | None

    def method_of(self, name: str, tensors: Mapping[str, object]) -> str | None: ...


def compare(
    required: Mapping[str, tuple[int, ...] | None], tensors: Mapping[str, object]
) -> tuple[list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """What of ``required`` is not in ``tensors`` (name -> anything with a ``shape``), in model
    order, and which present tensors have another shape: ``(missing, [(name, expected, found), ...])``."""
    return _compare(list(required), list(required.values()), tensors)


def compare_schema(
    required: Schema, tensors: Mapping[str, object], keep: list[bool] | None = None
) -> tuple[list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """:func:`compare` for a :class:`Schema`, using what its walk found when it looked in
    ``tensors`` (nothing looked up twice); ``keep``: a flag per name, to compare only the
    names flagged (a stage's share of the other parts)."""
    names, shapes = required.names, required.shapes
    found = required.found if required.looked_up_in is tensors else None
    if keep is not None:
        names, shapes = list(compress(names, keep)), list(compress(shapes, keep))
        found = list(compress(found, keep)) if found is not None else None
    return _compare(names, shapes, tensors, found)


def _compare(
    names: list[str],
    wants: list[tuple[int, ...] | None],
    tensors: Mapping[str, object],
    found: list[object] | None = None,
) -> tuple[list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """``found``: the tensor under each name, when already looked up in ``tensors``."""
    if found is None:
        found = list(map(tensors.get, names))
    if None not in found:  # the common case, one comparison: every tensor, as tuples of the same ints
        shapes = list(map(_SHAPE, found))
        if None in wants:  # a shape the config cannot tell: whatever is found
            wants = [s if w is None else w for w, s in zip(wants, shapes, strict=True)]
        if shapes == wants:
            return [], []
    missing = [n for n, t in zip(names, found, strict=True) if t is None]
    wrong = [
        (n, want, t.shape)
        for n, want, t in zip(names, wants, found, strict=True)
        if want is not None and t is not None and tuple(t.shape) != want
    ]
    return missing, wrong


def check_complete(required: Schema, tensors: Mapping[str, object], where: str) -> None:
    """Refuse, in one line, tensors ``required`` that ``tensors`` (name -> anything with a
    ``shape``) lacks or has in another shape.

    ``where`` names the checkpoint (or stage) in the message.
    """
    missing, wrong = compare_schema(required, tensors)
    if missing:
        method = required.method_of(missing[0], tensors)
        part = f", part of {method}" if method else ""
        raise BadInput(
            f"{where}: lacks tensor {missing[0]!r}{part}, which {CONFIG_NAME} requires "
            f"({others(len(missing) - 1)} missing); a server would leave it unloaded: the checkpoint is "
            "incomplete, download or convert it again"
        )
    if wrong:
        name, want, found = wrong[0]
        raise BadInput(
            f"{where}: tensor {name!r} has shape {list(found)} but {CONFIG_NAME} implies {list(want)} "
            f"({others(len(wrong) - 1)} with a wrong shape); the config and the weights do not match"
        )
    if required.problems:
        name, why = required.problems[0]
        raise BadInput(
            f"{where}: tensor {name!r} {why} ({others(len(required.problems) - 1)} such); the quantization "
            "config and the weights do not match"
        )


def others(n: int) -> str:
    """'1 other' or 'N others', for messages that name the first of several."""
    return f"{n} other" if n == 1 else f"{n} others"
