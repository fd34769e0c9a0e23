"""A pipeline rank's stage of an UNSPLIT checkpoint, for a server's loader (no split beforehand).

    layout = Parallelism(pp=4, runtime="vllm", partition=(15, 15, 15, 15))
    served = server_stage("Qwen/Qwen3.5-397B-A17B", layout, rank=2)
    model.load_weights(served.stage.iter_weights())

What the servers' ``qwen35-stages`` loaders (:mod:`.vllm`, :mod:`.sglang`) call
when the model they are given is not a split. ``partition`` is the layers per stage the server
itself computed (its ``get_pp_indices``, partition variable included), so the stage is the one
a split with the same settings would hold, placed by the same planner:

- a Hub repo id: resolved to its commit, then built into the stage cache
  ``CACHE/models--org--name/<commit>/<runtime>-pp<N>-<partition>/pp<rank>`` by the library's
  own split (``reshard(..., ranks=[rank])``), which fetches only the stage's byte ranges (and
  the shards' headers), and opened and checked as any split's stage (``open_stage``). The
  next start finds it complete and fetches nothing but the revision's commit. Commit and
  partition are in the key: a stage of another commit or partition is never opened.
- an object-storage URI (``s3://bucket/prefix``): the same, the listing's identity (the sha256
  of every object's ETag) in the place of the commit:
  ``CACHE/s3/<bucket>/<prefix>/<listing>/<runtime>-pp<N>-<partition>/pp<rank>``.
- a local directory (or Hugging Face cache folder): read in place, only the stage's tensors,
  from the source shards' own memory maps (no copy); each shard's size and header are checked
  again before it is read. With ``copy=True`` (a network filesystem) the stage is built into
  ``CACHE/local/<fingerprint>/<runtime>-pp<N>-<partition>`` first, the source's fingerprint
  (config, index, every shard's size and header) in the key. That key does not tell apart
  checkpoints of one layout (training steps written to one path): the stage is always
  checked against the source by the split, kept when unchanged, replaced when not.

Several ranks of one node share the cache as several runs share one OUT (see
:mod:`qwen35_reshard.write.claims`): each builds its own stage, a stage another rank is building is waited
for and not built twice; a stage is opened only once its manifest is written, so nothing a
killed or failed start left is ever loaded.

``CACHE`` is ``QWEN35_RESHARD_STAGE_CACHE``, or ``$HF_HOME/qwen35-stages`` (``~/.cache/
huggingface/qwen35-stages``); ``QWEN35_RESHARD_STAGE_COPY=1`` asks for ``copy``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from ..api import reshard
from ..bulk import collector_paused, return_freed_memory
from ..errors import ReshardError
from ..format.identity import location_sha256
from ..format.names import CACHE_REPO_PREFIX, STAGE_MANIFEST, node_dirname, stage_dirname
from ..loader import Stage, StageError, open_stage
from ..model.parallelism import Parallelism
from ..model.runtimes import runtime_of
from ..plan.nodes import Nodes
from ..source.checkpoint import source_identity
from ..source.hub.cache import HubSettings
from ..source.hub.store import open_hub
from ..source.open import is_repo_id, open_model
from ..source.s3.store import is_s3_uri, open_s3
from ..write.claims import in_use
from ..write.journal import set_aside
from ..write.options import WriteOptions
from .inplace import in_place_stage, resolved, stage_layers
from .terms import STAGE_CACHE_ENV, cache_error, for_operator

STAGE_COPY_ENV = "QWEN35_RESHARD_STAGE_COPY"
CACHE_DIRNAME = "qwen35-stages"  # under HF_HOME, beside huggingface_hub's own hub/ and assets/
LOCAL_DIRNAME = "local"  # stages built from local directories, keyed by the source's fingerprint
S3_DIRNAME = "s3"  # stages of object storage, keyed by bucket, prefix and listing
FINGERPRINT_CHARS = 16

USER_AGENT = "qwen35-stages/pp{rank}"  # each rank's Hub requests, told apart in the Hub's logs

# How a stage was obtained, as ServedStage.how says it.
FETCHED, CACHED, IN_PLACE, BUILT, REPAIRED = "fetched", "cached", "in place", "built", "repaired"


@dataclass(frozen=True)
class ServedStage:
    """The stage a rank loads, and how it got it: ``how`` is FETCHED (built from the Hub by
    this start), CACHED (found complete in the stage cache), IN_PLACE (read from the local
    source's own files) or BUILT (built from a local source into the cache); ``where`` is the
    stage cache's run directory (None in place); ``fetched_bytes`` what this start fetched."""

    stage: Stage
    how: str
    source: str
    where: Path | None
    fetched_bytes: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        """One line for the server's log."""
        where = f" in {self.where}" if self.where is not None else ""
        got = f", {self.fetched_bytes:,} bytes fetched" if self.how in (FETCHED, REPAIRED) else ""
        return f"{self.source}: stage {self.stage.rank} {self.how}{where}{got} ({self.seconds:.1f} s)"


def stage_cache_root(env: Mapping[str, str] | None = None) -> Path:
    """Where stages of unsplit checkpoints are kept: ``QWEN35_RESHARD_STAGE_CACHE``, else
    ``$HF_HOME/qwen35-stages``."""
    env = os.environ if env is None else env
    given = env.get(STAGE_CACHE_ENV)
    if given:
        return Path(given).expanduser()
    from huggingface_hub import constants as hf

    return Path(hf.HF_HOME).expanduser() / CACHE_DIRNAME


def copy_asked(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``QWEN35_RESHARD_STAGE_COPY`` asks for a local directory's stage to be built
    in the cache first."""
    value = (os.environ if env is None else env).get(STAGE_COPY_ENV, "")
    return value.strip().lower() in ("1", "true", "yes", "on")


def cache_key(layout: Parallelism) -> str:
    """The split's layout (its partition resolved) as a directory name: ``vllm-pp2-5-3``; under
    expert parallelism its EP size and nodes, redundant experts and SGLang's initial location
    too (``sglang-pp2-5-3-ep16-n2-r16-loc3f2a...``): a node of another EP layout holds other
    experts.

    Example:
        >>> cache_key(Parallelism(pp=2, runtime="vllm", partition=(5, 3), ep=4, nodes=2))
        'vllm-pp2-5-3-ep4-n2'
    """
    key = f"{layout.runtime}-pp{layout.pp}-{'-'.join(map(str, layout.partition))}"
    if layout.expert_parallel:
        key += f"-ep{layout.ep}-n{layout.nodes}"
        if layout.redundant_experts:
            key += f"-r{layout.redundant_experts}"
        if layout.init_expert_location is not None:
            key += f"-loc{location_sha256(layout.init_expert_location)[:FINGERPRINT_CHARS]}"
    return key


def server_stage(
    model: str | os.PathLike[str],
    layout: Parallelism,
    *,
    rank: int,
    node: int = 0,
    revision: str | None = None,
    token: str | None = None,
    cache: str | os.PathLike[str] | None = None,
    copy: bool = False,
    user_agent: str | None = None,
) -> ServedStage:
    """Pipeline rank ``rank``'s stage of the unsplit ``model``, opened and checked.

    Args:
        model: a Hub repo id (``org/name``), an ``s3://bucket/prefix`` URI, a checkpoint
            directory or a Hugging Face cache folder (``models--org--name``).
        layout: the deployment's layout: its runtime (whose placement rules apply) and its
            decoder layers per stage, as the server computed them.
        rank: the server's pipeline rank.
        node: under expert parallelism (``layout.ep``), the node of the stage whose experts the
            rank loads, the node's slice only: read in place, or the split's node directory
            (``pp{r}-node{k}``, ``node{k}``) in the stage cache, keyed by the EP layout.
        revision, token: for a repo id (``revision`` also picks a cache folder's snapshot).
        cache: the stage cache (default :func:`stage_cache_root`).
        copy: a local directory's stage is built in the cache first rather than read in place.
        user_agent: appended to the User-Agent of every Hub request.

    Returns:
        A :class:`ServedStage`: the :class:`~qwen35_reshard.loader.Stage` and how it was obtained.

    Raises:
        StageError: in one line: the Hub's error, a full disk, a stage cache another run
            holds, a damaged stage; nothing half-written is ever opened.

    Example:
        >>> from qwen35_reshard.model.parallelism import Parallelism
        >>> from qwen35_reshard.servers.unsplit import server_stage
        >>> served = server_stage(MODEL, Parallelism(pp=2, runtime="vllm", partition=(4, 4)), rank=1)
        >>> served.how, served.stage.start_layer, served.stage.end_layer
        ('in place', 4, 8)
    """
    started = time.monotonic()
    partition = resolved(layout)
    if not 0 <= rank < len(partition):
        raise StageError(f"pipeline rank {rank} is outside the partition {partition}")
    root = Path(cache) if cache is not None else stage_cache_root()
    name = os.fspath(model)
    settings = HubSettings(revision=revision, token=token, user_agent=user_agent)
    try:
        if is_s3_uri(name):
            listed = open_s3(name, user_agent=user_agent)
            if revision is not None and revision != listed.commit:
                raise StageError(
                    f"pipeline rank {rank}: {name}: the objects changed since pipeline rank 0 listed them "
                    f"(listing {revision[:12]} there, {listed.commit[:12]} here); start the deployment "
                    "again once the upload is complete"
                )
            where, commit = listed.where, listed.commit
            out = root / S3_DIRNAME / where.bucket / (where.prefix or "_") / commit
            unpinned = replace(settings, revision=None)  # the listing pins the objects: their ETags
            key = out / cache_key(layout)
            served = _cached_or_built(name, key, layout, rank, node, hub=unpinned, commit=commit)
        elif is_repo_id(name):
            repo = open_hub(name, settings)
            out = root / f"{CACHE_REPO_PREFIX}{repo.repo_id.replace('/', '--')}" / repo.commit
            pinned = replace(settings, revision=repo.commit)
            key = out / cache_key(layout)
            served = _cached_or_built(name, key, layout, rank, node, hub=pinned, commit=repo.commit)
        else:
            served = _from_local(name, settings, root, layout, rank, node=node, copy=copy)
    except ReshardError as e:  # in the operator's terms; a StageError of this rank says so already
        said = for_operator(e)
        raise StageError(said if isinstance(e, StageError) else f"pipeline rank {rank}: {said}") from e
    except OSError as e:  # a cache cannot be created or written (a full disk, permissions): say which
        raise StageError(f"pipeline rank {rank}: {name}: {cache_error(e, root)}") from e
    served.stage.check(len(partition), *stage_layers(partition, rank), pp_rank=rank, runtime=layout.runtime)
    return_freed_memory()  # what planning held, freed by now, before the server loads the weights
    return ServedStage(
        served.stage, served.how, name, served.where, served.fetched_bytes, time.monotonic() - started
    )


def pinned_commit(model: str, revision: str | None, token: str | None) -> str | None:
    """The commit that ``revision`` (default ``main``) of the Hub repo ``model`` points to now,
    which every rank of a deployment serves; for an ``s3://`` URI the identity of its objects'
    listing (rank 0 lists once; every other rank's listing must be the same); None for a local
    directory or cache folder.

    Raises:
        StageError: the Hub's answer (an unknown repo or revision, a refused token), in one line.

    Example:
        >>> pinned_commit("Qwen/Qwen3.5-35B-A3B", "main", None)  # doctest: +SKIP
        '0a1b2c...'
    """
    if is_s3_uri(model):
        try:
            return open_s3(model, user_agent=USER_AGENT.format(rank=0)).commit
        except ReshardError as e:
            raise StageError(for_operator(e)) from e
    if not is_repo_id(model):
        return None
    settings = HubSettings(revision=revision, token=token, user_agent=USER_AGENT.format(rank=0))
    try:
        return open_hub(model, settings).commit
    except ReshardError as e:
        raise StageError(for_operator(e)) from e




def _from_local(
    model: str,
    settings: HubSettings,
    root: Path,
    layout: Parallelism,
    rank: int,
    *,
    node: int = 0,
    copy: bool = False,
) -> ServedStage:
    """The stage of the local checkpoint ``model``: read in place (node ``node``'s slice under
    expert parallelism), or (``copy``) built into the stage cache ``root`` first. Its own
    function so that the checkpoint read here (a few hundred bytes a tensor, ~290,000 tensors
    at the largest shapes) is freed on return."""
    if not copy:
        with collector_paused():  # as reshard and open_stage read and plan: see bulk.collector_paused
            ckpt, _ = open_model(model, settings)
            return ServedStage(in_place_stage(ckpt, layout, rank, node), IN_PLACE, model, None)
    ckpt, _ = open_model(model, settings)
    fingerprint = source_identity(ckpt)["fingerprint"][:FINGERPRINT_CHARS]
    out = root / LOCAL_DIRNAME / fingerprint / cache_key(layout)
    source = os.fspath(ckpt.root)
    del ckpt  # the split reads the checkpoint again: not held twice
    return _built_from_local(source, out, layout, rank, node)


def _cached_or_built(
    model: str,
    out: Path,
    layout: Parallelism,
    rank: int,
    node: int,
    *,
    hub: HubSettings,
    commit: str,
) -> ServedStage:
    """The stage of the Hub repo ``model`` at ``commit`` in the cache's run directory ``out``
    (whose key names the commit): opened if complete, else built there first (only this
    rank's stage; a stage another rank is building is waited for). A stage that does not open
    (a data file a load found damaged and set aside, or one deleted) is REPAIRED: the split
    run again keeps its intact files and fetches the rest."""
    how, fetched, stage = FETCHED, 0, None
    dirname = _dirname(layout, rank, node)
    if (out / dirname / STAGE_MANIFEST).is_file():
        try:
            stage, how = _open_in_use(out, dirname), CACHED
        except StageError:
            how = REPAIRED
    if stage is None:
        result = reshard(model, out, layout, hub=hub, **_only(layout, rank, node))
        fetched = (result.fetch or {}).get("fetched_bytes", 0)
        stage = _open_in_use(out, dirname)
    recorded = stage.manifest.source.get("commit")
    if recorded != commit:  # the key names the commit: only a moved directory
        raise StageError(
            f"{stage.display} was built from commit {recorded}, not {commit}: remove it from the stage cache"
        )
    stage = _served_from_cache(stage, f"fetches it again from {model}")
    return ServedStage(stage, how, model, out, fetched)


def _built_from_local(model: str, out: Path, layout: Parallelism, rank: int, node: int) -> ServedStage:
    """The stage of the local checkpoint ``model`` in the cache's run directory ``out``, always
    through the split (``reshard(..., ranks=[rank])``), never opened on sight: the key (the
    source's fingerprint: layout and headers, no tensor bytes) is shared by every checkpoint of
    the layout, e.g. each training step written to one path. The split keeps a stage whose
    source is unchanged (its files' stamps, else their bytes hashed) and replaces one built
    from other bytes (``overwrite``: the cache is ours, a server user cannot pass it); several
    ranks share one build by the concurrent-build rules."""
    result = reshard(model, out, layout, write=WriteOptions(overwrite=True), **_only(layout, rank, node))
    index = rank * layout.nodes + node if layout.expert_parallel else rank
    built = result.written is not None and index in result.written.built
    opened = _open_in_use(out, _dirname(layout, rank, node))
    stage = _served_from_cache(opened, f"copies it again from {model}")
    return ServedStage(stage, BUILT if built else CACHED, model, out)


def _dirname(layout: Parallelism, rank: int, node: int) -> str:
    """The directory of the rank's stage (``ppN``) or, under expert parallelism, of its node."""
    return node_dirname(rank, node, layout.pp) if layout.expert_parallel else stage_dirname(rank)


def _only(layout: Parallelism, rank: int, node: int) -> dict[str, object]:
    """What :func:`~qwen35_reshard.api.reshard` builds of the split for this rank: its stage, or
    its node's directory (the servers' node rank among ``pp * nodes``)."""
    if layout.expert_parallel:
        return {"node": Nodes(node_rank=rank * layout.nodes + node)}
    return {"ranks": [rank]}


def _open_in_use(out: Path, dirname: str) -> Stage:
    """The directory ``dirname`` (a stage's, a node's) of the cache's run directory ``out``,
    recorded as used by this server while it runs (so that ``qwen35-reshard cache rm`` leaves it:
    :func:`~qwen35_reshard.write.claims.in_use`; not where the cache is read-only) BEFORE it is
    opened: ``cache rm`` looks for users once more just before it deletes, so no stage this
    server opened can be deleted under it."""
    with contextlib.suppress(OSError):
        in_use(out / dirname)
    return open_stage(out / dirname)


def _served_from_cache(stage: Stage, again: str) -> Stage:
    """``stage`` of the stage cache (opened by :func:`_open_in_use`), set to have a data file
    its load finds damaged set aside (:func:`~qwen35_reshard.write.journal.set_aside`), so that
    the next start ``again`` (says how: fetches it from the Hub, copies it) rewrites that file
    alone."""

    def damaged(file: str) -> str:
        try:
            set_aside(stage.path, file)
        except OSError as e:
            return (
                f"it could not be removed from the stage cache ({e.strerror or e}): remove "
                f"{stage.path} (the stage cache is set by {STAGE_CACHE_ENV}) and start the server again"
            )
        return f"it was removed from the stage cache, and the next start of the server {again}"

    return replace(stage, on_damaged=damaged)


def for_server(
    model: str,
    layout: Parallelism,
    *,
    rank: int,
    node: int = 0,
    revision: str | None,
    token: str | None,
    log: Callable[[str], None],
) -> Stage:
    """What a server's ``qwen35-stages`` loader does for an unsplit ``model``: say the opt-in
    and the partition (where it comes from: a partition variable that differs between nodes
    shows here, and keys the cache apart) and, under expert parallelism, the node and its EP
    ranks in the server's log, then :func:`server_stage` with the cache and ``copy`` of the
    environment and the rank in the User-Agent.

    Raises:
        StageError: as :func:`server_stage`; its line is logged first.
    """
    var = runtime_of(layout.runtime).partition_env
    given = os.environ.get(var)
    partition = resolved(layout)
    start, end = stage_layers(partition, rank)
    root = stage_cache_root()
    log(
        f"qwen35-stages: {model} is not a split: pipeline rank {rank} of {len(partition)} loads its "
        f"stage (layers [{start}, {end}) of partition {','.join(map(str, partition))}, "
        f"{f'{var}={given}' if given else f'{var} unset'}) of the unsplit checkpoint, stage cache {root}"
    )
    if layout.expert_parallel:
        ranks = layout.node_ep_ranks(node)
        log(
            f"qwen35-stages: {model}: expert parallelism {layout.ep} over {layout.nodes} node(s) per stage "
            f"({layout.runtime}'s placement, {layout.redundant_experts} redundant): this is node {node}, "
            f"EP ranks [{ranks.start}, {ranks.stop}): it loads that node's experts only"
        )
    try:
        served = server_stage(
            model,
            layout,
            rank=rank,
            node=node,
            revision=revision,
            token=token,
            cache=root,
            copy=copy_asked(),
            user_agent=USER_AGENT.format(rank=rank),
        )
    except StageError as e:
        log(f"qwen35-stages: error: {e}")
        raise
    log(f"qwen35-stages: {served.describe()}")
    return served.stage
