"""A split against its source: the plan rebuilt from each stage's recorded settings, every
tensor's placement, every file's layout and every tensor's bytes compared with the source's."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from ..errors import ReshardError
from ..format.names import CLONE, LOCAL_SOURCE
from ..plan.fetch import needed_of
from ..plan.planner import Plan, recorded_plan
from ..source.checkpoint import Checkpoint, SourceTensor, source_fingerprint, source_name
from ..source.remote.checkpoint import remote_header
from ..source.remote.fetch import RemoteFetcher
from ..source.remote.store import Store
from ..stage.findings import DIFFERENT, EXTRA, MISSING
from ..stage.manifest import StageManifest
from ..transfer.copier import Segment, copy_segments
from .report import Add, CheckedStage, VerifyReport, adder
from .stagedir import compare_side_file


def check_against_source(
    ckpt: Checkpoint,
    stages: list[CheckedStage],
    report: VerifyReport,
    chunk_bytes: int,
    repo: Store | None,
) -> None:
    """Placement and bytes of every tensor of ``stages`` (those with a valid manifest) against the source.

    The plan is rebuilt from each stage manifest's settings (pp, runtime, partition, mtp);
    each needed source tensor is hashed once, even when it is replicated on several stages.
    """
    if repo is not None:
        _prepare_remote(repo, ckpt, stages)
    fingerprint = source_fingerprint(ckpt)
    plans: dict[tuple, Plan | None] = {}
    to_compare: list[tuple[CheckedStage, SourceTensor]] = []
    for stage in stages:
        add = adder(report, stage)
        m = stage.manifest
        # After a remote source's files are fetched (_prepare_remote); each damaged one reported once.
        reported = {f.file for f in report.findings_for(stage.summary.stage)}
        for name in ckpt.extra_files:
            if name not in reported:
                compare_side_file(stage, ckpt, name, add)
        if m.source.get("fingerprint") != fingerprint:
            report.not_from_source.append(
                add(
                    DIFFERENT,
                    f"{stage.display} was split from another checkpoint than {ckpt.root} (or the "
                    "source changed since): config, index, shard sizes or headers differ",
                )
            )
        elif ckpt.hub and m.identity and m.identity.source not in (LOCAL_SOURCE, source_name(ckpt)):
            report.not_from_source.append(
                add(
                    DIFFERENT,
                    f"{stage.display} was split from {m.identity.source}, not {source_name(ckpt)}: the "
                    "same layout but other bytes; pass --source with the commit it was split from "
                    "(--revision) to compare it",
                )
            )
        plan = _plan_for(ckpt, m, plans, add, stage.display)
        if plan is None:
            continue
        to_compare += _compare_placement(ckpt, plan, stage, add)
        if _recorded_limits(m) is not None and not report.findings_for(stage.summary.stage):
            _compare_layout(plan, stage, add, repo)
    # Each source tensor hashed once per digest the stages record (one, unless stage-v1 ones).
    wanted: dict[str, dict[str, SourceTensor]] = {}
    for stage, src in to_compare:
        wanted.setdefault(stage.manifest.digest, {})[src.name] = src
    report.source_digests = {
        digest: _hash_source(ckpt, tensors, chunk_bytes, repo, digest) for digest, tensors in wanted.items()
    }
    hashed = {name: src.nbytes for tensors in wanted.values() for name, src in tensors.items()}
    report.source_bytes_hashed = sum(hashed.values())
    for stage, src in to_compare:
        name = src.name
        mine = stage.digests.get(name)
        if mine is not None and mine != report.source_digests[stage.manifest.digest][name]:
            t = stage.manifest.tensors[name]
            if t.digest is not None and t.digest != mine:
                continue  # damaged since it was written: one finding already says so
            intact = t.digest == mine  # the stage holds what it recorded: the source is not its
            why = ", and are the ones its manifest records: the split is of other bytes" if intact else ""
            finding = adder(report, stage)(
                DIFFERENT,
                f"{stage.display}/{t.file}: the bytes of tensor {name!r} differ from the source's "
                f"({src.file}){why}",
                file=t.file,
                tensor=name,
            )
            if intact:
                report.not_from_source.append(finding)


def _plan_for(ckpt: Checkpoint, m: StageManifest, plans: dict, add: Add, display: str) -> Plan | None:
    """The plan the stage's recorded settings give for ``ckpt``; None (with a finding) if none.

    Output file limits are taken from the run identity when it records them (so the exact file
    layout can be compared); older manifests get the defaults, which decide stages alike.
    """
    limits = _recorded_limits(m) or {}
    key = (m.layout, m.mtp, tuple(sorted(limits.items())))
    if key not in plans:
        try:
            plans[key] = recorded_plan(ckpt, m.layout, mtp=m.mtp, **limits)
        except ReshardError as e:
            plans[key] = None
            add(
                DIFFERENT,
                f"{display}: its recorded split (pp={m.pp} {m.runtime} partition "
                f"{list(m.partition)}) does not fit the source: {e}",
            )
    return plans[key]


def _recorded_limits(m: StageManifest) -> dict[str, int] | None:
    """``max_file_bytes`` and ``max_header_bytes`` from the manifest's run identity, if recorded."""
    identity = m.identity
    if identity is None or not (identity.max_file_bytes > 0 and identity.max_header_bytes > 0):
        return None
    return {"max_file_bytes": identity.max_file_bytes, "max_header_bytes": identity.max_header_bytes}


def _compare_layout(plan: Plan, stage: CheckedStage, add: Add, repo: Store | None) -> None:
    """Each data file is the plan's: same name, and header bytes equal to the plan's header.

    With every tensor's bytes checked elsewhere, this makes every byte of every file the one
    the plan dictates. Only for stages that hold exactly the right tensors.
    """
    for f in plan.stages[stage.manifest.index].files:
        path = stage.path / f.name
        where = f"{stage.display}/{f.name}"
        want = f.header
        if f.layout == CLONE:  # a clone's header is its source's own
            want = _source_head(plan.checkpoint, f.source_file, f.data_start, repo)
        try:
            with open(path, "rb") as fh:
                head = fh.read(len(want))
        except FileNotFoundError:
            add(MISSING, f"{where} is missing; the plan lays the stage out in it", file=f.name)
            continue
        if head != want:
            add(
                DIFFERENT,
                f"{where}: header differs from the plan's (other tensors, order or offsets in this file)",
                file=f.name,
            )


def _compare_placement(
    ckpt: Checkpoint, plan: Plan, stage: CheckedStage, add: Add
) -> list[tuple[CheckedStage, SourceTensor]]:
    """Missing, extra and differently shaped tensors; returns the (stage, source tensor) pairs
    to hash (an expert cut from a fused tensor: its byte range of it)."""
    rank = stage.manifest.rank
    expected = {t.name: t.source for t in plan.stages[stage.manifest.index].tensors}
    actual = stage.manifest.tensors
    where = f"pp={plan.pp} {plan.runtime} partition {list(plan.partition)}"
    for name in sorted(expected.keys() - set(actual)):
        add(
            MISSING,
            f"{stage.display} lacks source tensor {name!r}, which the plan ({where}) puts on stage {rank}",
            tensor=name,
        )
    extra = sorted(set(actual) - expected.keys())
    owners: dict[str, list[int]] = {}
    for s in plan.stages if extra else ():
        for t in s.tensors:
            owners.setdefault(t.name, []).append(s.rank)
    for name in extra:
        if name not in ckpt.tensors:
            why = f"the source {ckpt.root} has no such tensor"
        elif name in plan.dropped:
            why = "the split leaves mtp.* out (--no-mtp)"
        else:
            why = f"the plan ({where}) puts it on stage(s) {owners.get(name, [])} only"
        add(EXTRA, f"{stage.display} holds tensor {name!r} but {why}", file=actual[name].file, tensor=name)
    pairs = []
    for name in sorted(expected.keys() & set(actual)):
        src, t = expected[name], actual[name]
        if (src.dtype, tuple(src.shape)) != (t.dtype, t.shape):
            add(
                DIFFERENT,
                f"{stage.display}: tensor {name!r} is {t.dtype} {list(t.shape)} but the "
                f"source's is {src.dtype} {list(src.shape)}",
                file=t.file,
                tensor=name,
            )
        else:
            pairs.append((stage, src))
    return pairs


def _prepare_remote(repo: Store, ckpt: Checkpoint, stages: list[CheckedStage]) -> None:
    """The store's side files into its folder; offline, one line naming every file neither
    local nor kept that comparing ``stages`` (each with a manifest) needs: their shards, the
    side files."""
    needed: dict[str, set[str]] = {}
    for stage in stages:
        for name in stage.manifest.tensors:
            if name in ckpt.tensors:
                needed.setdefault(ckpt.tensors[name].file, set()).add(name)
    fetcher = RemoteFetcher(repo, ckpt, needed)
    try:
        fetcher.prepare()
    finally:
        fetcher.close()


def _source_head(ckpt: Checkpoint, file: str, nbytes: int, repo: Store | None) -> bytes:
    """The first ``nbytes`` (at most its header's) of source shard ``file``; from a remote
    source, the header planning kept (or a local copy's, or ranged reads)."""
    if repo is not None:
        return remote_header(repo, file)[:nbytes]
    with open(ckpt.path(file), "rb") as fh:
        return fh.read(nbytes)


def _hash_source(
    ckpt: Checkpoint, tensors: dict[str, SourceTensor], chunk_bytes: int, repo: Store | None, digest: str
) -> dict[str, str]:
    """The ``digest`` (``format.digest``) of each source tensor of ``tensors`` (by name), each
    shard read once in bounded chunks (from a Hub repo or an object store: only the shards and
    byte ranges of these tensors are fetched)."""
    by_file: dict[str, list[Segment]] = {}
    for name in sorted(tensors):
        t = tensors[name]
        by_file.setdefault(t.file, []).append(Segment(name, t.offset, t.nbytes))
    fetcher = RemoteFetcher(repo, ckpt, needed_of(ckpt, tensors.values())) if repo is not None else None

    def one(file: str) -> dict[str, str]:
        src = fetcher.open(file) if fetcher is not None else str(ckpt.path(file))
        return copy_segments(src, by_file[file], chunk_bytes=chunk_bytes, digest=digest)

    if fetcher is None:
        return {name: d for file in sorted(by_file) for name, d in one(file).items()}
    # Remote shards hashed side by side, as many as the engine's streams: each is read in
    # order (a digest needs it), so the streams go across shards.
    try:
        with ThreadPoolExecutor(max_workers=fetcher.engine.streams) as pool:
            return {name: d for found in pool.map(one, sorted(by_file)) for name, d in found.items()}
    finally:
        fetcher.close()
