"""Classify a Hugging Face tensor name of a Qwen3.5 MoE checkpoint by what owns it.

Decisions come from the name alone, never from file names or shard numbers: a decoder
layer's id is parsed out of ``layers.N.``; every other tensor must match a known role or the
run fails, so nothing is dropped or misplaced silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Roles of non-layer tensors; "layer" is the role of decoder-layer tensors.
LAYER = "layer"
EMBED = "embed"
NORM = "norm"
LM_HEAD = "lm_head"
MTP = "mtp"
VISUAL = "visual"
# The vision tower's position embedding: SGLang builds it on the first rank only (the rest of the
# tower on every rank), so it needs a role of its own.
VISUAL_POS_EMBED = "visual.pos_embed"

# model.language_model.* for the multimodal release, model.* for text-only saves and
# Qwen3-Next. Layer ids have no leading zeros, so each id has exactly one spelling.
_LAYER_PREFIX = r"model\.(?:language_model\.)?layers\.(?:0|[1-9][0-9]*)\."
_ROLE_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.embed_tokens.", EMBED),
    ("model.embed_tokens.", EMBED),
    ("model.language_model.norm.", NORM),
    ("model.norm.", NORM),
    ("lm_head.", LM_HEAD),
    ("mtp.", MTP),
    ("model.visual.pos_embed.", VISUAL_POS_EMBED),
    ("model.visual.", VISUAL),
)
# After a "\n", the prefix that decides a name's role, if any: a decoder layer's first, then the
# others in order (the first alternative that matches wins). Matched against the names joined
# by "\n", it classifies a whole checkpoint in one pass in C: one match per name.
_KEY_AFTER_NEWLINE = re.compile(
    "\n(" + "|".join([_LAYER_PREFIX, *(re.escape(p) for p, _ in _ROLE_PREFIXES)]) + ")?"
)


@dataclass(frozen=True)
class Role:
    """What owns a tensor: ``kind`` is one of the role constants; ``layer`` is set for LAYER."""

    kind: str
    layer: int | None = None


def classify(name: str) -> Role | None:
    """Return the role of tensor ``name``, or None when no rule covers it."""
    return _key_role(_KEY_AFTER_NEWLINE.match("\n" + name).group(1) or "")


def classify_all(tensor_names: list[str]) -> tuple[list[str], dict[str, Role | None]]:
    """Classify many names at once: each name's key (the prefix that decides its role, ""
    when none does) and the role of each distinct key (None for "").

    ``classify`` name by name makes a call per tensor (~190,000 in a 397B FP8); this is one
    regex pass, and callers work per key (a few hundred), not per tensor.
    """
    keys: list[str] = []
    shared = {}.setdefault  # one string per distinct key
    for start in range(0, len(tensor_names), _CLASSIFY_CHUNK):
        chunk = tensor_names[start : start + _CLASSIFY_CHUNK]
        # One match per "\n": as many as names unless a name holds one (then one by one).
        found = _KEY_AFTER_NEWLINE.findall("\n" + "\n".join(chunk))
        if len(found) != len(chunk):
            found = [_KEY_AFTER_NEWLINE.match("\n" + n).group(1) or "" for n in chunk]
        keys += map(shared, found, found)
    return keys, {key: _key_role(key) for key in set(keys)}


# Names classified per regex pass. Why not all at once: the joined names and a key string per
# name would be held together, ~60 MB for the largest checkpoints (~290,000 tensors); per chunk
# they are a few hundred KB, and each key is kept once.
_CLASSIFY_CHUNK = 4096


_KIND_OF_PREFIX = dict(_ROLE_PREFIXES)
_KIND_ROLES = {kind: Role(kind) for _, kind in _ROLE_PREFIXES}


def _key_role(key: str) -> Role | None:
    # Not cached across calls: a cache would keep keys made amid a plan's ~290,000 transient
    # ones, each pinning the block of memory around it once the plan frees the rest.
    if not key:
        return None
    kind = _KIND_OF_PREFIX.get(key)
    return _KIND_ROLES[kind] if kind is not None else Role(LAYER, int(key.rsplit(".", 2)[1]))
