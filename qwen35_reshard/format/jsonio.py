"""Deterministic JSON: the same object always gives the same bytes; and JSON read back, checked.

Objects are indented two levels deep, then one entry per line in compact form: a manifest or
an index has one entry per tensor (~190,000 for a 397B FP8 checkpoint), and json's indenting
encoder is pure Python (seconds), its compact one C.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable, Collection, Iterable, Iterator
from itertools import repeat
from pathlib import Path

import msgspec

from ..errors import JSON_ERRORS, BadInput

# A sha256 digest as the tool writes and accepts it: 64 lowercase hex digits.
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# json's encoder of one string (the C one when available): json.dumps(s, ensure_ascii=False).
json_string: Callable[[str], str] = json.encoder.encode_basestring


def is_uint(v: object) -> bool:
    """A JSON integer (not a bool) that is not negative."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def is_sha256(v: object) -> bool:
    """Whether ``v`` is a sha256 digest as the tool writes it (see :data:`SHA256_HEX`)."""
    return isinstance(v, str) and SHA256_HEX.fullmatch(v) is not None


def dumps(obj: object) -> bytes:
    """Deterministic JSON bytes of ``obj``: :func:`dumps_text` and a newline, UTF-8."""
    return (dumps_text(obj) + "\n").encode("utf-8")


def dumps_text(obj: object) -> str:
    """The deterministic JSON text of ``obj``, without the final newline (see the module)."""
    return _dumps(obj, "", 2)


def compact(obj: object) -> str:
    """``json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))``, by the encoder made once."""
    return "".join(_encode(obj, 0))


def _compact_encoder() -> Callable[[object, int], list[str]]:
    """json's C encoder for :func:`compact`, made once: called as ``encode(obj, 0)``, it
    returns the chunks of the text.

    json.dumps builds a new encoder on every call, which costs more than encoding one small
    manifest entry. Where the C module is missing, json's Python encoder does the same.
    """
    enc = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "))
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return lambda obj, _level: [enc.encode(obj)]
    return make(None, enc.default, json.encoder.encode_basestring, None, ": ", ", ", False, False, True)


_encode = _compact_encoder()


def _all_str(items: Iterable[object]) -> bool:
    """Whether every item is a str; ``str.__instancecheck__`` as map's function makes it one
    C pass rather than a Python call per item (an index has ~190,000)."""
    return all(map(str.__instancecheck__, items))


def _compact_each(values: Collection[object]) -> Iterator[str]:
    """:func:`compact` of each value, in C passes (``map``) rather than a Python call per value."""
    if _all_str(values):
        return map(json_string, values)
    return map("".join, map(_encode, values, repeat(0)))


def _dumps(obj: object, indent: str, depth: int) -> str:
    if not (depth and isinstance(obj, dict) and obj):
        return compact(obj)
    inner = indent + "  "
    if depth == 1 and _all_str(obj):
        # One entry per tensor at this depth (an index's weight_map).
        entries = ",\n".join(
            map(f"{inner}{{}}: {{}}".format, map(json_string, obj), _compact_each(obj.values()))
        )
    else:
        entries = ",\n".join(f"{inner}{compact(k)}: {_dumps(v, inner, depth - 1)}" for k, v in obj.items())
    return f"{{\n{entries}\n{indent}}}"


def parse_json_object(raw: bytes, where: str, loads: Callable[[bytes], object] = json.loads) -> dict:
    """The JSON object in ``raw`` (the file ``where``), parsed by ``loads``.

    Raises:
        ReshardError: ``raw`` is not plain UTF-8 (see :func:`is_plain_utf8`), not valid JSON,
            or not an object.
    """
    if not is_plain_utf8(raw):
        raise BadInput(
            f"{where}: not plain UTF-8 text (UTF-16 or UTF-32, a byte order mark, or bytes that are no "
            "UTF-8), which transformers refuses; save the file as UTF-8 without a byte order mark"
        )
    try:
        obj = loads(raw)
    except JSON_ERRORS as e:
        raise BadInput(f"{where}: not valid JSON ({e}); the file is damaged") from e
    if not isinstance(obj, dict):
        raise BadInput(f"{where}: expected a JSON object")
    return obj


def is_plain_utf8(raw: bytes) -> bool:
    """Whether ``raw`` is JSON text as transformers reads it (``open(encoding="utf-8")``, then
    ``json.loads``): UTF-8, no byte order mark, no NUL. ``json.loads(bytes)`` itself also takes
    UTF-16 and UTF-32 and skips a BOM, so a file it reads may still be refused downstream.

    Example:
        >>> is_plain_utf8(b'{"a": 1}'), is_plain_utf8('{"a": 1}'.encode("utf-16"))
        (True, False)
    """
    if raw.startswith(codecs.BOM_UTF8) or b"\0" in raw:  # NUL: UTF-16/32 text, or no JSON anyway
        return False
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def read_json(path: Path) -> dict | None:
    """The JSON object at ``path``, or None when the file is missing.

    Raises:
        ReshardError: the file is not a JSON object (see :func:`parse_json_object`).
        OSError: the file cannot be read.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    return parse_json_object(raw, str(path))


def load_index(raw: bytes) -> object:
    """``json.loads(raw)`` of a model.safetensors.index.json (raising what it raises), through
    msgspec when its weight_map maps strings to strings (and its metadata, if any, is an object).

    Why: an index has an entry per tensor (~190,000 for a 397B FP8 checkpoint, 20 MB); msgspec
    decodes one of strings about three times faster than json. Anything else is parsed by json,
    whose result the callers check.

    Args:
        raw: the index's bytes.

    Returns:
        What ``json.loads(raw)`` returns (a dict for any index).

    Raises:
        ValueError, RecursionError: ``raw`` is not JSON that json reads (see ``JSON_ERRORS``).
    """
    try:
        index = _INDEX.decode(raw)
    except JSON_ERRORS:  # msgspec's errors are ValueErrors
        return json.loads(raw)
    metadata = {} if index.metadata is msgspec.UNSET else {"metadata": index.metadata}
    return {"weight_map": index.weight_map, **metadata}


class _Index(msgspec.Struct):
    weight_map: dict[str, str]
    metadata: dict[str, object] | msgspec.UnsetType = msgspec.UNSET


_INDEX = msgspec.json.Decoder(_Index)
