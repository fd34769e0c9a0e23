"""Classify a Hugging Face tensor name of a Qwen3.5 MoE checkpoint by what owns it.

Decisions come from the name alone, never from file names or shard numbers: a decoder
layer's id is parsed out of ``layers.N.``; every other tensor must match a known role or the
run fails, so nothing is dropped or misplaced silently.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache

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
_LAYER_RE = re.compile(r"^model\.(?:language_model\.)?layers\.(0|[1-9][0-9]*)\.")
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


@dataclass(frozen=True)
class Role:
    """What owns a tensor: ``kind`` is one of the role constants; ``layer`` is set for LAYER."""

    kind: str
    layer: int | None = None


def classify(name: str) -> Role | None:
    """Return the role of tensor ``name``, or None when no rule covers it."""
    m = _LAYER_RE.match(name)
    if m:
        return _layer_role(m.group(1))
    for prefix, kind in _ROLE_PREFIXES:
        if name.startswith(prefix):
            return _KIND_ROLES[kind]
    return None


@cache
def _layer_role(layer_id: str) -> Role:
    # One Role per layer id, shared: classify runs for every tensor (~190,000 in a 397B FP8),
    # and callers work per distinct role.
    return Role(LAYER, int(layer_id))


_KIND_ROLES = {kind: Role(kind) for _, kind in _ROLE_PREFIXES}  # shared, as the layers' are
