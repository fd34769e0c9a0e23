"""A node directory of an expert-parallel split (issue 42): its name and its experts, checked as
the stage reader checks the rest of a stage (one checker behind verify and the loader)."""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import ReshardError
from ..format.names import CONFIG_NAME, STAGE_MANIFEST, is_split_dirname, node_dir_of
from ..model import schema
from ..model.experts import EXPERTS, MoeLayer, expert_placement, expert_tensors
from ..model.modules import EXPERT
from .findings import DIFFERENT, MISSING, REBUILD, Finding
from .manifest import StageManifest

ROUTER = "mlp.gate.weight"  # a MoE layer's router, relative to its layer: every MoE layer has one
_MTP_ROUTER = re.compile(r"mtp\.layers\.[0-9]+\." + re.escape(ROUTER))


def split_dirs(run_dir: Path) -> list[Path]:
    """Every directory of a split in ``run_dir``: stages' (``ppN``) and nodes' alike.

    Raises:
        OSError: ``run_dir`` cannot be listed.
    """
    return [p for p in sorted(run_dir.iterdir()) if is_split_dirname(p.name) and p.is_dir()]


def node_dirs(run_dir: Path, nodes: int) -> dict[int, Path]:
    """The node directories (``pp{r}-node{k}``, ``node{k}``) in ``run_dir`` by their index in a
    split of ``nodes`` nodes per stage (``r * nodes + k``); one of a node beyond ``nodes`` by a
    negative index of its own (no node of the split: left over from another)."""
    found, beyond = {}, -1
    for p in sorted(run_dir.iterdir()):
        at = node_dir_of(p)
        if at is None or not p.is_dir():
            continue
        if at[1] < nodes:
            found[at[0] * nodes + at[1]] = p
        else:
            found[beyond], beyond = p, beyond - 1
    return dict(sorted(found.items()))


def node_dir_problems(root: Path, display: str, m: StageManifest) -> list[Finding]:
    """A directory named as a node (``pp{r}-node{k}``, ``node{k}``) holds that node's manifest."""
    named = node_dir_of(root)
    mine = (m.rank, m.node.node) if m.node is not None else None
    if named is None or named == mine:
        return []
    where = f"stage {m.rank}" if mine is None else f"node {mine[1]} of stage {mine[0]}"
    why = (
        f"{display} holds {where} of its split, not node {named[1]} of stage {named[0]}: it was moved "
        f"or belongs to another split; {REBUILD}"
    )
    return [Finding(DIFFERENT, why, STAGE_MANIFEST)]


def expert_problems(
    display: str, m: StageManifest, config: dict, missing: list[str]
) -> tuple[list[str], list[Finding]]:
    """A node directory holds, for every MoE layer of its stage, each projection of every
    logical expert its EP ranks start with under the recorded layout's placement. The servers
    do not notice a missing one (their completeness checks are per parameter): it would be
    served as uninitialised memory.

    Returns:
        ``missing`` (what the model's schema lacks in the stage) without the experts' weights,
        which a node holds for its own experts only, and the problems with its experts.
    """
    missing = [n for n, w in zip(missing, expert_tensors(missing), strict=True) if not (w and w.heavy)]
    n = m.node
    try:
        placement = expert_placement(
            m.runtime, num_experts=schema.text_config(config).get("num_experts") or 0, ep=n.ep,
            redundant=n.redundant_experts, location=n.expert_location,
            num_layers=schema.text_config(config).get("num_hidden_layers"),
        )  # fmt: skip
    except ReshardError as e:
        why = f"{display}: its recorded expert layout does not fit {CONFIG_NAME}: {e}"
        return missing, [Finding(DIFFERENT, why, STAGE_MANIFEST)]
    held: dict[tuple[MoeLayer, int], set[str]] = {}
    for w in expert_tensors(list(m.tensors)):
        if w is not None and w.heavy:
            held.setdefault((w.layer, w.expert), set()).add(w.part.partition(".")[0])
    lm = schema.language_model_prefix(config)
    prefixes = {f"layers.{i}": f"{lm}layers.{i}." for i in range(m.start_layer, m.end_layer)}
    # MTP layers from the stage's own routers, as decoder layers from its range: a manifest that
    # leaves one out must not leave its experts unchecked.
    mtp = {name.removesuffix(f".{ROUTER}") for name in m.tensors if _MTP_ROUTER.fullmatch(name)}
    prefixes |= {label: f"{label}." for label in sorted(mtp | {x for x in n.experts if x.startswith("mtp.")})}
    # Every MoE layer of the stage (its router is there), and every one the manifest records.
    moe = [label for label, p in prefixes.items() if f"{p}{ROUTER}" in m.tensors]
    problems = []
    for label in [*moe, *(label for label in n.experts if label not in moe)]:
        layer = _moe_layer(label)
        if layer is None or label not in prefixes:
            why = f"{display}: {label!r} is no MoE layer of stage {m.rank}; {REBUILD}"
            problems.append(Finding(DIFFERENT, why, STAGE_MANIFEST))
            continue
        want = placement.node_experts(layer, n.node, n.nodes)
        if set(n.experts.get(label, ())) != want:
            problems.append(Finding(
                DIFFERENT, f"{display}: the experts it records for {label} are not the ones node {n.node} "
                f"of {n.nodes} starts with under {m.runtime}'s placement; {REBUILD}", STAGE_MANIFEST,
            ))  # fmt: skip
        for e in sorted(want):
            lacking = [p for p in EXPERT if p not in held.get((layer, e), ())]
            if lacking:
                problems.append(Finding(
                    MISSING, f"{display} lacks expert {e} of {label} ({', '.join(lacking)}), which its EP "
                    f"ranks {n.ep_ranks[0]}-{n.ep_ranks[-1]} load; a server would serve it uninitialised: "
                    f"{REBUILD}", STAGE_MANIFEST, f"{prefixes[label]}{EXPERTS}{e}.{lacking[0]}",
                ))  # fmt: skip
    return missing, problems


def _moe_layer(label: str) -> MoeLayer | None:
    """The MoE layer a manifest's label (``layers.N``, ``mtp.layers.K``) names."""
    mtp = label.startswith("mtp.")
    head, _, index = label.removeprefix("mtp.").partition(".")
    ok = head == "layers" and index.isascii() and index.isdigit()
    return MoeLayer(int(index), mtp=mtp) if ok else None
