"""Which routed experts each expert-parallel (EP) rank, and so each node, starts with under each
server's rules: the servers' expert placement as data (model/runtimes.py holds the PP rules).

Both servers number *physical* expert slots ``0 .. E+R-1`` (``E`` routed experts, ``R``
redundant ones for load balancing) and give EP rank ``j`` a contiguous block of them; each
slot holds one *logical* expert (the checkpoint's ``experts.{e}``). A node needs exactly the
logical experts of its ranks' slots. Read from vLLM 0.32.0 and SGLang 0.5.23, and checked against
their own functions over a grid of sizes (tests/engine/test_expert_placement_servers.py):

- vLLM (``determine_expert_map``, linear: Qwen3.5 builds its MoE without expert groups, so a
  requested ``round_robin`` falls back to linear): ``E+R`` slots, ``(E+R) // ep`` per rank, the
  remainder one each to the first ranks. Slot ``p`` holds logical ``p % E``
  (``EplbState.build_initial_global_physical_to_logical_map``: ``[0..E) + [i % E for i < R]``).
  Redundant experts need EPLB, which refuses ``(E+R) % ep != 0`` and an EP group of one.
  Where EPLB later moves experts it sends them between GPUs, never from disk. The MTP drafter is
  built from the target's config (``_create_draft_vllm_config``), so its MoE layer places experts
  as the decoder layers do (read, not run: vLLM's EPLB needs CUDA).
- SGLang (``ExpertLocationMetadata.init_trivial``, ``FusedMoE._map_global_expert_id_to_local_expert_id``):
  ``(E+R) / ep`` slots per rank, ``(E+R) % ep == 0`` asserted; slot ``p`` holds logical
  ``p % E``, or what ``--init-expert-location`` says per layer (``physical_to_logical_map``
  ``[num_hidden_layers][E+R]``), so layers may differ. The MTP draft's MoE uses no expert
  location (``FusedMoE.uses_expert_location`` is off for a draft): its slot ``p`` holds
  logical ``p`` for ``p < E``, nothing beyond. With an all-to-all backend (DeepEP) the loader
  fills only the nearest slot of a logical expert held twice on one rank
  (``_compute_logical_to_all_physical_map``): the rank's set of logical experts is the same.
- Nodes: node ``k`` of ``N`` runs EP ranks ``[k*ep/N, (k+1)*ep/N)`` (vLLM's data-parallel ranks
  and SGLang's ranks are numbered node by node); ``ep % N == 0``, or nodes would run
  different GPU counts of one EP group, which neither server's launch supports.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..errors import JSON_ERRORS, BadInput, param
from . import names
from .modules import EXPERT, FUSED_EXPERTS
from .runtimes import check_runtime
from .schema import SCALE_SUFFIX

# SGLang's --init-expert-location default: slot p holds logical p % E.
TRIVIAL = "trivial"


class MoeLayer(NamedTuple):
    """A MoE layer: decoder layer ``index``, or MTP layer ``index`` (``mtp.layers.{index}``)."""

    index: int
    mtp: bool = False


@dataclass(frozen=True)
class ExpertPlacement:
    """The logical experts each EP rank starts with, by one server's rules. Build it with
    :func:`expert_placement`, which refuses what the server refuses.

    Attributes:
        runtime: ``vllm`` or ``sglang``.
        num_experts: routed experts per layer (``num_experts`` of the text config), ``E``.
        ep: EP ranks in the group (one pipeline stage's; PP is not part of EP), ``ep``.
        redundant: redundant expert slots (vLLM ``num_redundant_experts`` of
            ``--eplb-config``, SGLang ``--ep-num-redundant-experts``), ``R``.
        location: SGLang's ``physical_to_logical_map`` from ``--init-expert-location``, one
            row of ``E+R`` logical ids per decoder layer; None: the initial/trivial map.

    Example:
        >>> p = expert_placement("vllm", num_experts=10, ep=4)
        >>> [p.experts(0, rank) for rank in range(4)]
        [(0, 1, 2), (3, 4, 5), (6, 7), (8, 9)]
        >>> sorted(p.node_experts(0, node=1, nodes=2))
        [6, 7, 8, 9]
    """

    runtime: str
    num_experts: int
    ep: int
    redundant: int = 0
    location: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)

    @property
    def physical(self) -> int:
        """Physical expert slots in the EP group, ``E + R``."""
        return self.num_experts + self.redundant

    def slots(self, ep_rank: int) -> range:
        """The physical slots of EP rank ``ep_rank``: contiguous; vLLM gives the remainder
        one each to the first ranks (SGLang has none)."""
        if not 0 <= ep_rank < self.ep:
            raise BadInput(f"EP rank {ep_rank} is not in 0..{self.ep - 1} ({param('ep', self.ep)})")
        base, rem = divmod(self.physical, self.ep)
        start = ep_rank * base + min(ep_rank, rem)
        return range(start, start + base + (ep_rank < rem))

    def experts(self, layer: int | MoeLayer, ep_rank: int) -> tuple[int, ...]:
        """Logical expert ids of EP rank ``ep_rank``'s physical slots, in slot order, in MoE
        ``layer`` (an int: decoder layer; a :class:`MoeLayer` for MTP). A logical id may repeat
        (redundant slots); a slot a server leaves empty (SGLang's MTP past ``E``) is left out."""
        layer = layer if isinstance(layer, MoeLayer) else MoeLayer(layer)
        slots = self.slots(ep_rank)
        if layer.mtp and self.runtime == "sglang":
            return tuple(p for p in slots if p < self.num_experts)
        if self.location is not None and not layer.mtp:
            if not 0 <= layer.index < len(self.location):
                raise BadInput(
                    f"layer {layer.index} is not in the {len(self.location)} layers of "
                    f"{param('init_expert_location')}"
                )
            row = self.location[layer.index]
            return tuple(row[p] for p in slots)
        return tuple(p % self.num_experts for p in slots)

    def node_experts(self, layer: int | MoeLayer, node: int, nodes: int) -> frozenset[int]:
        """The logical experts node ``node`` of ``nodes`` must hold in ``layer``: the union of its
        EP ranks' (:func:`node_ranks`)."""
        return frozenset().union(*(self.experts(layer, r) for r in node_ranks(self.ep, nodes, node)))

    def describe(self) -> dict:
        """Plain JSON-ready data for a manifest: runtime, experts, ep, redundant, and the
        location rows (None for the initial map)."""
        rows = None if self.location is None else [list(r) for r in self.location]
        return {
            "runtime": self.runtime,
            "num_experts": self.num_experts,
            "ep": self.ep,
            "redundant_experts": self.redundant,
            "location": rows,
        }


def expert_placement(
    runtime: str,
    *,
    num_experts: int,
    ep: int,
    redundant: int = 0,
    location: Sequence[Sequence[int]] | None = None,
    num_layers: int | None = None,
) -> ExpertPlacement:
    """The placement of ``runtime`` for this EP group; refuses a layout the server refuses.

    Args:
        runtime: ``vllm`` or ``sglang``.
        num_experts: routed experts per layer, ``E``.
        ep: EP ranks in the group.
        redundant: redundant expert slots ``R`` (vLLM: EPLB's ``num_redundant_experts``; SGLang:
            ``--ep-num-redundant-experts``).
        location: SGLang only: the ``physical_to_logical_map`` rows of ``--init-expert-location``
            (see :func:`read_expert_location`); None: the trivial map.
        num_layers: the model's decoder layers; required with ``location`` (one row each).

    Returns:
        The :class:`ExpertPlacement`.

    Raises:
        BadInput: one line naming ``ep``, ``redundant_experts`` or ``init_expert_location``.

    Example:
        >>> p = expert_placement("sglang", num_experts=8, ep=4, redundant=4)
        >>> [p.experts(0, rank) for rank in range(4)]
        [(0, 1, 2), (3, 4, 5), (6, 7, 0), (1, 2, 3)]
    """
    check_runtime(runtime)
    if num_experts < 1:
        raise BadInput(f"the model has {num_experts} routed experts; expert parallelism needs at least one")
    if ep < 1:
        raise BadInput(f"{param('ep', ep)} must be at least 1")
    if redundant < 0:
        raise BadInput(f"{param('redundant_experts', redundant)} must be 0 or more")
    physical = num_experts + redundant
    if runtime == "vllm" and redundant:
        # vllm/config/parallel.py: redundant experts need EPLB, which needs an EP group of more
        # than one rank; fused_moe/layer.py: "EPLB currently only supports even distribution".
        if ep == 1:
            raise BadInput(
                f"{param('redundant_experts', redundant)} needs vLLM's EPLB, which needs an EP group of "
                f"more than one rank; raise {param('ep')} or drop {param('redundant_experts')}"
            )
        if physical % ep:
            raise _uneven("vLLM's EPLB", num_experts, redundant, ep)
    if runtime == "sglang" and physical % ep:
        # sglang/srt/eplb/expert_location.py: assert num_physical_experts % ep_size == 0.
        raise _uneven("SGLang", num_experts, redundant, ep)
    rows = None
    if location is not None:
        if runtime != "sglang":
            raise BadInput(f"{param('init_expert_location')} is SGLang's; vLLM has no such setting")
        rows = _checked_location(location, num_experts=num_experts, physical=physical, num_layers=num_layers)
    return ExpertPlacement(runtime, num_experts, ep, redundant, rows)


def _uneven(server: str, num_experts: int, redundant: int, ep: int) -> BadInput:
    physical, need = num_experts + redundant, -num_experts % ep
    # Numbers stand apart from the parameters: a server's operator reads a parameter as a phrase.
    return BadInput(
        f"{server} needs its {physical} expert slots ({num_experts} experts plus {redundant} redundant) "
        f"to divide evenly over {ep} expert-parallel ranks; set {param('redundant_experts')} to {need} "
        f"(or that plus a multiple of {ep}), or change {param('ep')}"
    )


def check_nodes(ep: int, nodes: int) -> None:
    """Refuse a node count that does not split the EP group evenly (each node runs ``ep/nodes``
    ranks: vLLM's ``--data-parallel-size-local``, SGLang's GPUs per node).

    Args:
        ep: EP ranks in the group.
        nodes: nodes the group spans.

    Returns:
        None: ``nodes`` splits the group evenly.

    Raises:
        BadInput: one line naming ``nodes`` (below 1) or ``ep`` and ``nodes`` (uneven).

    Example:
        >>> check_nodes(32, 4)
        >>> check_nodes(32, 3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        qwen35_reshard.errors.BadInput: ep=32 does not divide evenly over nodes=3: ...
    """
    if nodes < 1:
        raise BadInput(f"{param('nodes', nodes)} must be at least 1")
    if ep % nodes:
        raise BadInput(
            f"{param('ep', ep)} does not divide evenly over {param('nodes', nodes)}: every node runs "
            f"the same number of EP ranks; use a node count dividing {ep}"
        )


def node_ranks(ep: int, nodes: int, node: int) -> range:
    """The EP ranks node ``node`` of ``nodes`` runs: ``[node*ep/nodes, (node+1)*ep/nodes)``.

    Args:
        ep: EP ranks in the group.
        nodes: nodes the group spans.
        node: the node, 0 to ``nodes - 1``.

    Returns:
        Its EP ranks, contiguous.

    Raises:
        BadInput: as :func:`check_nodes`, or ``node`` out of range.

    Example:
        >>> node_ranks(32, 4, 1)
        range(8, 16)
    """
    check_nodes(ep, nodes)
    if not 0 <= node < nodes:
        raise BadInput(f"{param('node', node)} is not in 0..{nodes - 1} ({param('nodes', nodes)})")
    per = ep // nodes
    return range(node * per, (node + 1) * per)


def read_expert_location(value: str) -> list[list[int]] | None:
    """SGLang's ``--init-expert-location`` value as it reads it: ``trivial`` (None), a ``.json``
    file, or inline JSON; the ``physical_to_logical_map`` rows it holds, unchecked (see
    :func:`expert_placement`).

    Refused: a ``.pt`` file (never unpickled: convert it to JSON), and ``logical_count``, from
    which SGLang computes a placement with its EPLB algorithm at start (not reproduced here).

    Args:
        value: the flag's value, as given to SGLang.

    Returns:
        The map's rows (one per decoder layer), or None for ``trivial``.

    Raises:
        BadInput: one line naming ``init_expert_location``: unreadable, not JSON, a ``.pt``
            file, ``logical_count``, or keys other than ``physical_to_logical_map``.

    Example:
        >>> read_expert_location('{"physical_to_logical_map": [[1, 0], [0, 1]]}')
        [[1, 0], [0, 1]]
    """
    flag = param("init_expert_location", value)
    if value == TRIVIAL:
        return None
    if value.endswith(".pt"):
        raise BadInput(
            f"{flag}: a .pt file is a pickle, which this tool never loads; save its "
            'physical_to_logical_map as JSON ({"physical_to_logical_map": [[...], ...]}) and pass that '
            "file, which SGLang reads the same"
        )
    if value.endswith(".json"):
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BadInput(f"{flag}: cannot read the file ({e.__class__.__name__}: {e})") from e
    else:
        text = value
    try:
        data = json.loads(text)
    except JSON_ERRORS as e:
        raise BadInput(f"{flag}: not JSON ({e}); give a .json file or inline JSON, as SGLang takes") from e
    if not isinstance(data, dict):
        raise BadInput(f"{flag}: expected a JSON object with physical_to_logical_map")
    if "logical_count" in data and "physical_to_logical_map" not in data:
        raise BadInput(
            f"{flag} gives logical_count, from which SGLang computes the placement with its EPLB "
            "algorithm at start, which this tool does not reproduce; give the physical_to_logical_map "
            "SGLang computed (its expert-location dump) instead"
        )
    if set(data) != {"physical_to_logical_map"}:
        raise BadInput(
            f"{flag}: expected exactly the key physical_to_logical_map, found "
            f"{', '.join(sorted(map(str, data)))}"
        )
    return data["physical_to_logical_map"]


def _checked_location(
    location: Sequence[Sequence[int]], *, num_experts: int, physical: int, num_layers: int | None
) -> tuple[tuple[int, ...], ...]:
    """The rows as tuples; refuses a map SGLang would misread or fail on."""
    flag = param("init_expert_location")
    if num_layers is None:
        raise BadInput(f"{flag} needs the model's layer count to check its rows")
    if not isinstance(location, Sequence) or len(location) != num_layers:
        got = len(location) if isinstance(location, Sequence) else type(location).__name__
        raise BadInput(
            f"{flag}: physical_to_logical_map must have one row per decoder layer ({num_layers}), got {got}"
        )
    rows = []
    for layer, row in enumerate(location):
        if not isinstance(row, Sequence) or len(row) != physical:
            got = len(row) if isinstance(row, Sequence) else type(row).__name__
            raise BadInput(
                f"{flag}: row {layer} must list {physical} physical experts ({num_experts} plus the "
                f"redundant ones, {param('redundant_experts')}), got {got}"
            )
        if not all(type(x) is int and 0 <= x < num_experts for x in row):
            raise BadInput(f"{flag}: row {layer} holds a value that is no expert id in 0..{num_experts - 1}")
        missing = set(range(num_experts)).difference(row)
        if missing:
            # SGLang cannot route to a logical expert without a slot (its dispatch map fails).
            raise BadInput(f"{flag}: row {layer} gives logical expert {min(missing)} no physical slot")
        rows.append(tuple(row))
    return tuple(rows)


# Routed-expert tensor names, as both servers spell them: parsed here, where the writer's plan
# and the stage checks (verify, the loader) both read them.
EXPERTS = "mlp.experts."  # a MoE block's routed experts, relative to its decoder layer
MTP_LAYERS = "mtp.layers."
# The packed weight of each quantization set (the first part of every scheme), and BF16's.
WEIGHT_SUFFIXES = frozenset({"weight", "weight_packed", "qweight"})
_FUSED = frozenset({*FUSED_EXPERTS, *(f + SCALE_SUFFIX for f in FUSED_EXPERTS)})


class ExpertTensor(NamedTuple):
    """What a routed-expert tensor's name says.

    Attributes:
        layer: its MoE layer.
        expert: the global (logical) expert id; None for a fused tensor of every expert.
        part: the name after ``mlp.experts.`` (fused: ``gate_up_proj``, ``down_proj``, with
            ``_scale_inv`` for block FP8) or after ``mlp.experts.{e}.`` (``gate_proj.weight``,
            ``down_proj.weight_scale_inv``, ...).
    """

    layer: MoeLayer
    expert: int | None
    part: str

    @property
    def heavy(self) -> bool:
        """A per-expert packed weight: what a node holds for its own experts only."""
        return self.expert is not None and self.part.rpartition(".")[2] in WEIGHT_SUFFIXES


def expert_tensor(name: str) -> ExpertTensor | None:
    """The MoE layer, expert and part of a routed-expert tensor; None for any other tensor.

    Decoder layers are parsed by model/names.py (``model.language_model.layers.N.`` or
    ``model.layers.N.``), MTP's as ``mtp.layers.K.``.

    Args:
        name: a tensor name.

    Returns:
        What the name says, or None for a tensor that is no routed expert's.

    Raises:
        BadInput: a name under ``mlp.experts.`` that is neither form (the servers load neither).

    Example:
        >>> expert_tensor("model.language_model.layers.3.mlp.experts.17.up_proj.weight")
        ExpertTensor(layer=MoeLayer(index=3, mtp=False), expert=17, part='up_proj.weight')
        >>> expert_tensor("mtp.layers.0.mlp.experts.gate_up_proj")
        ExpertTensor(layer=MoeLayer(index=0, mtp=True), expert=None, part='gate_up_proj')
    """
    return expert_tensors([name])[0]


def expert_tensors(tensor_names: Sequence[str]) -> list[ExpertTensor | None]:
    """:func:`expert_tensor` of each name, at once: one regex pass of model/names.py over all
    of them, then a few string operations per name (~1.7 s per million names). Parse a stage's
    names once and hand the result to
    :func:`~qwen35_reshard.plan.experts.nodes_expert_tensors` (``parsed=``) for all its nodes.

    Args:
        tensor_names: tensor names, e.g. a stage's.

    Returns:
        :func:`expert_tensor` of each name, in their order.

    Raises:
        BadInput: as :func:`expert_tensor`.

    Example:
        >>> [w and (w.expert, w.heavy) for w in expert_tensors(
        ...     ["lm_head.weight", "model.layers.1.mlp.experts.4.down_proj.weight",
        ...      "model.layers.1.mlp.experts.4.down_proj.weight_scale_inv"])]
        [None, (4, True), (4, False)]
    """
    tensor_names = list(tensor_names)
    keys, roles = names.classify_all(tensor_names)
    layers: dict[str, MoeLayer] = {}  # key (a decoder layer's prefix) -> its MoE layer
    for key, role in roles.items():
        if role is not None and role.kind == names.LAYER:
            layers[key] = MoeLayer(role.layer)
    ids: dict[str, int | None] = {}  # "17" -> 17, the few hundred spellings met, parsed once
    parts: set[str] = set()  # per-expert parts met and found valid ("gate_proj.weight", ...)
    out: list[ExpertTensor | None] = []
    for name, key in zip(tensor_names, keys, strict=True):
        layer = layers.get(key)
        if layer is not None:
            rest = name[len(key) :]
        elif name.startswith(MTP_LAYERS):
            index, _, rest = name[len(MTP_LAYERS) :].partition(".")
            k = _index(index)
            layer = None if k is None else MoeLayer(k, mtp=True)
        if layer is None or not rest.startswith(EXPERTS):
            out.append(None)
            continue
        rest = rest[len(EXPERTS) :]
        if rest in _FUSED:
            out.append(ExpertTensor(layer, None, rest))
            continue
        head, _, part = rest.partition(".")
        if head not in ids:
            ids[head] = _index(head)
        expert = ids[head]
        if part not in parts:
            proj, _, suffix = part.partition(".")
            if expert is None or proj not in EXPERT or not suffix:
                raise BadInput(
                    f"tensor {name!r}: not a routed-expert tensor the servers load (mlp.experts.{{e}}."
                    "{gate,up,down}_proj.<suffix>, or fused gate_up_proj/down_proj)"
                )
            parts.add(part)
        elif expert is None:
            raise BadInput(f"tensor {name!r}: expert id {head!r} is not a number as the servers spell it")
        out.append(ExpertTensor(layer, expert, part))
    return out


def _index(text: str) -> int | None:
    """A layer or expert id as the servers' names spell it: decimal digits, no leading zero."""
    if not (text.isascii() and text.isdigit()) or (text[0] == "0" and len(text) > 1):
        return None
    return int(text)


def experts_by_layer(tensors: Mapping[str, object]) -> dict[MoeLayer, set[int]]:
    """The per-expert ids found under each MoE layer of ``tensors`` (names), for a check that
    a node holds every expert it must (the servers notice no missing local expert).

    Args:
        tensors: a mapping keyed by tensor name (a manifest's or an index's tensors).

    Returns:
        MoE layer -> the experts with a packed weight there (scales alone do not count).

    Raises:
        BadInput: as :func:`expert_tensor`.

    Example:
        >>> experts_by_layer({"mtp.layers.0.mlp.experts.7.up_proj.weight": 0,
        ...                   "mtp.layers.0.mlp.experts.2.up_proj.weight_scale_inv": 0})
        {MoeLayer(index=0, mtp=True): {7}}
    """
    found: dict[MoeLayer, set[int]] = {}
    for what in expert_tensors(list(tensors)):
        if what is not None and what.expert is not None and what.heavy:
            found.setdefault(what.layer, set()).add(what.expert)
    return found
