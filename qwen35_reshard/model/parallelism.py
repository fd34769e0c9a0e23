"""The layout a split is made for: pipeline stages, the expert-parallel group of each stage and
the nodes it spans, the server, the layers per stage, the redundant experts. One validated,
immutable :class:`Parallelism` that every entry point takes (the command, the library, verify,
the servers' path), so each checks a layout once, the same way, and names the caller's own
parameter when it refuses one (``pp`` in the library, ``--pp`` on the command line: see
:func:`qwen35_reshard.errors.param`).

What needs the model (the layer count a partition must sum to, the expert count a server's
placement must divide) is checked when the layout meets the checkpoint (:meth:`Parallelism.sizes`,
and the expert placement of :mod:`qwen35_reshard.model.experts`); everything else here, before
anything is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..errors import BadInput, param
from ..format.identity import RunIdentity
from .experts import check_nodes, node_ranks
from .runtimes import check_partition, check_runtime, default_partition, launch_env, parse_partition

BALANCED = "balanced"  # partition="balanced": the split whose fullest stage holds the fewest bytes
SGLANG = "sglang"  # the one server with an initial expert location file (--init-expert-location)


@dataclass(frozen=True)
class Parallelism:
    """How a model is served: the layout a split is made for.

    Attributes:
        pp: pipeline stages (the servers' ``--pp-size`` / ``--pipeline-parallel-size``).
        runtime: ``"sglang"`` or ``"vllm"``, the server whose split and placement rules apply.
        partition: decoder layers per stage (a tuple; ``"15,15,15,15"`` is parsed into one),
            ``"balanced"`` (chosen from the checkpoint's bytes, see :mod:`qwen35_reshard.plan.balance`),
            or None for the runtime's own split.
        ep: expert-parallel ranks of each stage (1: no expert parallelism). The EP group lives
            inside one pipeline stage, as both servers build it.
        nodes: the nodes each stage's EP group spans; node ``k`` of a stage hosts EP ranks
            ``[k * ep / nodes, (k + 1) * ep / nodes)``, so ``nodes`` divides ``ep``.
        redundant_experts: extra physical expert slots per layer (vLLM's EPLB
            ``num_redundant_experts``, SGLang's ``--ep-num-redundant-experts``).
        init_expert_location: SGLang's ``--init-expert-location``: each MoE layer's physical slot ->
            logical expert map (``physical_to_logical_map``), or None for its trivial location.

    Example:
        >>> Parallelism(pp=2, partition="5,3", runtime="vllm").partition
        (5, 3)
        >>> Parallelism(pp=2, ep=8, nodes=2).node_ep_ranks(1)
        range(4, 8)
        >>> Parallelism(pp=2, ep=6, nodes=4)
        Traceback (most recent call last):
        ...
        qwen35_reshard.errors.BadInput: ep=6 does not divide evenly over nodes=4: ...
    """

    pp: int = 1
    runtime: str = SGLANG
    partition: tuple[int, ...] | str | None = None
    ep: int = 1
    nodes: int = 1
    redundant_experts: int = 0
    init_expert_location: tuple[tuple[int, ...], ...] | None = None

    def __post_init__(self) -> None:
        _positive("pp", self.pp)
        check_runtime(self.runtime)
        object.__setattr__(self, "partition", _partition(self.partition, self.pp))
        _positive("ep", self.ep)
        _positive("nodes", self.nodes)
        if self.nodes > 1 and self.ep == 1:
            raise BadInput(f"{param('nodes')} spans an expert-parallel group: add {param('ep')}")
        check_nodes(self.ep, self.nodes)
        if not _is_int(self.redundant_experts) or self.redundant_experts < 0:
            raise BadInput(f"{param('redundant_experts')} must be 0 or more, got {self.redundant_experts!r}")
        if self.redundant_experts and self.ep == 1:
            raise BadInput(
                f"{param('redundant_experts')} are slots of an expert-parallel group: add {param('ep')}"
            )
        if self.init_expert_location is not None:
            object.__setattr__(self, "init_expert_location", _location(self))

    @classmethod
    def recorded(
        cls, record: RunIdentity, location: tuple[tuple[int, ...], ...] | None = None
    ) -> Parallelism:
        """The layout a split's manifests record (its run identity; SGLang's initial expert
        ``location``, which the identity records by digest, from a node's manifest): what a
        repair rewrites the split for."""
        ep = dict(ep=record.ep, nodes=record.nodes, redundant_experts=record.redundant_experts)
        return cls(record.pp, record.runtime, tuple(record.partition), **ep, init_expert_location=location)

    @property
    def expert_parallel(self) -> bool:
        """Whether the split is one directory per node holding the node's experts (``ep > 1``)."""
        return self.ep > 1

    @property
    def nnodes(self) -> int:
        """Nodes of the whole deployment: every stage's EP group spans ``nodes`` of them (the
        servers' ``--nnodes``)."""
        return self.pp * self.nodes

    @property
    def ranks_per_node(self) -> int:
        """EP ranks each node hosts."""
        return self.ep // self.nodes

    def node_ep_ranks(self, node: int) -> range:
        """The EP ranks node ``node`` of a stage (0 to ``nodes - 1``) hosts.

        Example:
            >>> Parallelism(pp=2, ep=16, nodes=4).node_ep_ranks(3)
            range(12, 16)
        """
        return node_ranks(self.ep, self.nodes, node)

    def sizes(self, num_layers: int) -> list[int]:
        """Decoder layers per stage for a model of ``num_layers``: the partition given, checked
        against it, or the runtime's own split. A ``"balanced"`` partition is chosen from the
        checkpoint first (:meth:`with_partition`)."""
        if self.partition == BALANCED:
            raise BadInput(
                f"{param('partition', BALANCED)} is chosen from the checkpoint's bytes: pass the "
                "layout through qwen35_reshard.choose (or reshard) first"
            )
        if self.partition is None:
            return default_partition(num_layers, self.pp, self.runtime)
        sizes = list(self.partition)
        check_partition(sizes, pp=self.pp, num_layers=num_layers)
        return sizes

    def with_partition(self, sizes: Sequence[int]) -> Parallelism:
        """This layout with its layers per stage fixed to ``sizes`` (a balanced choice, or the
        runtime's split made explicit)."""
        return replace(self, partition=tuple(sizes))

    def launch_env(self, num_layers: int) -> str:
        """The environment assignment that makes the server use exactly this layout's split."""
        return launch_env(self.runtime, self.sizes(num_layers))

    def server_flags(self) -> str:
        """The server flags an expert-parallel split's node directories were cut for ('' without
        expert parallelism): a server started with other EP settings places other experts, which
        its node's directory does not hold. ``"$LOC"`` stands for the ``init_expert_location``
        file this split was given (SGLang reads the same JSON). Flag names as the servers spell
        them (SGLang 0.5.23 ``--ep-size`` within ``--tp-size``, ``ep_size * moe_dp_size <=
        tp_size``; vLLM 0.32.0 ``ep = dp * tp``, EPLB's ``num_redundant_experts``).

        Example:
            >>> Parallelism(ep=4, nodes=2, redundant_experts=4).server_flags()
            '--tp-size 4 --ep-size 4 --ep-num-redundant-experts 4'
            >>> Parallelism(ep=4, nodes=2, runtime="vllm").server_flags()
            '--enable-expert-parallel --data-parallel-size 4 --data-parallel-size-local 2'
        """
        ep, spare = self.ep, self.redundant_experts
        if not self.expert_parallel:
            return ""
        if self.runtime == SGLANG:
            flags = [f"--tp-size {ep} --ep-size {ep}"]
            flags += [f"--ep-num-redundant-experts {spare}"] if spare else []
            flags += ['--init-expert-location "$LOC"'] if self.init_expert_location is not None else []
            return " ".join(flags)
        flags = [f"--enable-expert-parallel --data-parallel-size {ep}"]
        flags += [f"--data-parallel-size-local {self.ranks_per_node}"]
        flags += [f"""--enable-eplb --eplb-config '{{"num_redundant_experts":{spare}}}'"""] if spare else []
        return " ".join(flags)


def layout_of(layout: Parallelism | None, **given: object) -> Parallelism:
    """``layout``, or the one the keyword arguments ``given`` build (those not None): a library
    call takes either, never both, so that one object carries the layout everywhere.

    Args:
        layout: the caller's layout object, or None.
        **given: the caller's separate layout parameters (``pp=``, ``runtime=``, ...); None
            means not given.

    Returns:
        The layout.

    Raises:
        BadInput: neither given (naming ``pp``), both given (naming them), or a ``layout``
            that is no :class:`Parallelism`; as :class:`Parallelism` for bad values.

    Example:
        >>> layout_of(None, pp=4, runtime="vllm", partition=None).runtime
        'vllm'
    """
    passed = {k: v for k, v in given.items() if v is not None}
    if layout is None:
        if "pp" not in passed:
            raise BadInput(
                f"{param('pp')} is needed: the number of pipeline stages (or pass {param('layout')})"
            )
        return Parallelism(**passed)  # type: ignore[arg-type]
    if not isinstance(layout, Parallelism):
        raise BadInput(f"{param('layout')} must be a Parallelism, got {type(layout).__name__}")
    if passed:
        names = " and ".join(param(k) for k in passed)
        raise BadInput(f"{param('layout')} already says the layout: drop {names}, or put them in it")
    return layout


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(name: str, value: object) -> None:
    if not _is_int(value) or value < 1:
        raise BadInput(f"{param(name)} must be at least 1, got {value!r}")


def _partition(partition: object, pp: int) -> tuple[int, ...] | str | None:
    """``partition`` as the layout holds it: None, ``"balanced"``, or ``pp`` positive layer counts."""
    if partition is None or partition == BALANCED:
        return partition
    if isinstance(partition, str):
        return tuple(parse_partition(partition, pp=pp))
    if not isinstance(partition, Sequence) or not all(map(_is_int, partition)):
        raise BadInput(
            f"{param('partition', partition)} must be layer counts, one per stage, or {BALANCED!r}"
        )
    check_partition(list(partition), pp=pp)
    return tuple(partition)


def _location(layout: Parallelism) -> tuple[tuple[int, ...], ...]:
    """SGLang's initial expert location as rows of tuples (the layout is hashable). What needs
    the model (a row per layer, ``E + R`` slots each) is checked by
    :func:`~qwen35_reshard.model.experts.expert_placement`."""
    if layout.ep == 1:
        raise BadInput(
            f"{param('init_expert_location')} places experts over an expert-parallel group: add {param('ep')}"
        )
    if layout.runtime != SGLANG:
        raise BadInput(
            f"{param('init_expert_location')} is SGLang's; drop it, or use {param('runtime', SGLANG)}"
        )
    try:
        return tuple(tuple(row) for row in layout.init_expert_location)  # type: ignore[union-attr]
    except TypeError as e:
        raise BadInput(
            f"{param('init_expert_location')} must be rows of expert ids (its physical_to_logical_map)"
        ) from e
