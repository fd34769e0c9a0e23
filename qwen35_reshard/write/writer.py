"""Execute a plan: write each selected stage's directory, crash-safe and resumable.

Every file is written under a temporary name, flushed and renamed. A stage's manifest and
then its index are written last, after its data is durable, so a run killed at any point
leaves no stage that looks complete. Finished data files are journaled with their digests,
so running the same command again keeps them and redoes only the rest.

Block sharing (``reflink``: "auto", "always" or "never", as ``cp --reflink``): when OUT can
share blocks with the source (probed once per run by sharing one block), a CLONE file is
made with ``FICLONE`` and the aligned middle of each ALIGNED run with ``FICLONERANGE``:
nothing is read or written for those bytes. The split then does not read them at all, so the
manifest records no sha256 for the tensors of CLONE and ALIGNED files (``null``; a CLONE of a
Hugging Face cache blob records the blob's sha256 as the file's); ``verify --source`` proves
their bytes against the source. Where OUT cannot share, everything is copied and hashed as
usual, the same bytes land in the same files, and every tensor has its digest.

Durability (see :class:`_Durability`): a run that copies fsyncs each file it finished; a run
that shares blocks writes mostly metadata and makes a whole batch durable with one
``syncfs`` of OUT's filesystem instead. Either way the order is the same: a file's bytes are
durable before its final name is; a stage's data files, journal removal, side files and
manifest are durable before its index is; every index before the run manifest.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import stat
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import JSON_ERRORS, ReshardError, param
from ..format.identity import describe_differences
from ..format.jsonio import dumps
from ..format.names import (
    ALIGNED,
    CLONE,
    CONFIG_NAME,
    INDEX_NAME,
    JOURNAL,
    PARTIAL_SUFFIX,
    RUN_MANIFEST,
    RUN_MARKER,
    STAGE_DIR,
    STAGE_MANIFEST,
)
from ..plan.planner import OutputFile, Plan, StagePlan
from ..stage.findings import Finding
from ..stage.manifest import stage_is_complete
from ..stage.reader import read_run_record
from ..transfer import copier
from ..transfer import reflink as reflinks
from ..transfer.copier import RangeSource, Segment, copy_segments, drop_pages, pwrite_all
from ..units import format_bytes
from .manifest import ManifestDraft, run_identity, run_manifest, stage_index, stage_manifest

REFLINK_MODES = ("auto", "always", "never")
DEFAULT_WORKERS = 2  # source shards copied at once: the library's default and the CLI's
# Copied bytes a run that syncs its filesystem whole may hold unfinished (lost to a crash).
PROGRESS_BYTES = 1 << 30
# Non-weight files (config, tokenizer) up to this size are read once for all their copies.
SIDE_FILE_IN_MEMORY = 64 << 20


class Reporter:
    """Progress callbacks of a write; the default reports nothing. May be called from threads."""

    def start(self, total_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def stage_done(self, stage: StagePlan) -> None: ...


@dataclass
class WriteResult:
    """What a write did: stages built now, stages already complete, bytes copied and shared."""

    built: list[int] = field(default_factory=list)
    already_complete: list[int] = field(default_factory=list)
    files_kept: int = 0
    bytes_copied: int = 0  # bytes of the data files written by copying
    bytes_shared: int = 0  # bytes of the data files sharing the source's blocks (never read)
    sharing: bool = False  # OUT could share blocks with the source
    complete: list[int] = field(default_factory=list)  # every stage of the split complete in OUT now

    @property
    def nothing_to_do(self) -> bool:
        return not self.built


@dataclass(frozen=True)
class OutState:
    """What a write of a plan does in OUT, decided before anything is written (:func:`assess_out`).

    ``action`` is "new" (OUT is absent or empty), "complete" (nothing to do), "resume" (an
    unfinished run with the same settings: its finished stages and data files are kept) or
    "replace" (a split made with other settings, replaced as ``overwrite`` allows).
    """

    action: str
    complete: tuple[int, ...] = ()  # stages of the split (selected or not) already complete
    kept: dict[int, dict[str, dict[str, str | None]]] = field(default_factory=dict)  # rank -> file -> digests
    differences: str = ""  # "replace": the settings that differ, old -> new

    @property
    def files_kept(self) -> int:
        return sum(len(files) for files in self.kept.values())


@dataclass
class _OpenFile:
    stage: StagePlan
    plan: OutputFile
    tmp: Path
    final: Path
    fd: int
    pending_sources: set[str]


def write_plan(
    plan: Plan,
    out_dir: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    workers: int = DEFAULT_WORKERS,
    reporter: Reporter | None = None,
    open_source: Callable[[str], str | RangeSource] | None = None,
    reflink: str = "auto",
) -> WriteResult:
    """Write the stages ``plan.ranks`` of ``plan`` under ``out_dir``.

    Resumes an interrupted run with the same settings; refuses a non-empty ``out_dir``
    holding anything else unless ``overwrite``. ``workers`` source shards are copied at
    once, each read by exactly one worker. ``open_source(file)`` gives the source of a data
    file that still has bytes to copy (a local path or a range source; it may download the
    file first); by default each file is read from the checkpoint's directory. ``reflink`` is
    "auto" (share the source's blocks where the filesystem can), "always" (refuse to run where
    it cannot) or "never" (copy).
    """
    if reflink not in REFLINK_MODES:
        raise ReshardError(f"reflink must be one of {', '.join(REFLINK_MODES)}, not {reflink!r}")
    reporter = reporter or Reporter()
    out = Path(out_dir)
    identity = run_identity(plan)
    try:
        state = assess_out(plan, out, overwrite=overwrite)
        created = _make_out(out)
        # Left if a run was killed between its last two steps. Only then is a finished split
        # written to: on a read-only filesystem, unlinking even a missing file fails.
        if state.action == "complete" and (out / RUN_MARKER).exists():
            _remove(out / RUN_MARKER)
    except OSError as e:  # OUT cannot be created or read: nothing was written
        raise _write_error(e, out, 0) from e

    result = WriteResult(complete=list(state.complete))
    result.already_complete = [s.rank for s in plan.selected if s.rank in state.complete]
    todo = [s for s in plan.selected if s.rank not in state.complete]
    if state.action == "complete":
        return result

    to_write = [(s, f) for s in todo for f in s.files if f.name not in state.kept.get(s.rank, {})]
    digests: dict[int, dict[str, str | None]] = {}
    needed = 0
    # What this run adds before its first data file, so that a run that cannot start (a
    # read-only or full OUT, no permission, no sharing where it is required) leaves OUT as it
    # found it: every check comes before anything is removed, the old run record last of all.
    created += [out / name for name in (RUN_MARKER, *(s.dirname for s in todo)) if not (out / name).exists()]
    try:
        # Sharing needs the source on this machine: not for a source read from the Hub.
        result.sharing = open_source is None and _can_share(plan, out, to_write, reflink)
        shared = sum(f.shareable_bytes for _, f in to_write) if result.sharing else 0
        side_copies = len(todo) + 1  # each stage's, and OUT's own
        needed = sum(f.size for _, f in to_write) - shared + side_copies * _side_file_bytes(plan)
        replaced = state.action == "replace"
        _check_free_space(out, needed, freed=_split_bytes(out) if replaced else 0)
        if replaced:
            created = [p for p in created if p != out / RUN_MARKER]  # the old split's record, until replaced
            _clear_split(out)
        marker = {"identity": identity.to_json(), "source_files": _source_stamps(plan)}
        _write_atomic(out / RUN_MARKER, dumps(marker), sync_dir=False)
        for stage in todo:
            kept = state.kept.get(stage.rank, {})
            _resume_stage(out / stage.dirname, stage, kept)
            digests[stage.rank] = {t: d for file in kept.values() for t, d in file.items()}
            result.files_kept += len(kept)
        created = []  # from here on, finished files are kept for the next run to resume
        _remove(out / RUN_MANIFEST)

        durable = _Durability(out, whole_fs=result.sharing)
        # The marker must be in place before any data file is; when synced whole, the barrier
        # before the first data file gets its name covers it.
        durable.dirs([out], lazy=True)
        deferred: list[tuple[Path, Path]] = []
        prepared: list[_Prepared] = []
        result.bytes_copied, result.bytes_shared = _copy_files(
            plan,
            out,
            to_write,
            digests,
            workers,
            reporter,
            open_source,
            share=result.sharing,
            durable=durable,
            deferred=deferred,
            # What needs no digest is written while the workers copy.
            meanwhile=lambda: prepared.append(_prepare_stages(plan, out, todo, side_files_of_out=True)),
        )
        result.complete = sorted({*state.complete, *(s.rank for s in todo)})
        # OUT itself is the model path of `vllm serve OUT --load-format qwen35-stages`: vLLM reads
        # the config and the tokenizer there (and refuses a split for SGLang in the plugin, with
        # the shim's message), each rank's weights from OUT/pp{rank}.
        _finish_stages(
            plan,
            out,
            todo,
            digests,
            durable,
            prepared[0],  # made by _copy_files' meanwhile
            run_record=dumps(run_manifest(plan, result.complete)),
            data=deferred,
        )
        for stage in todo:
            result.built.append(stage.rank)
            reporter.stage_done(stage)
    except OSError as e:  # a full disk, a file-size limit, ... while writing anything
        raise _write_error(e, out, needed) from e
    finally:
        # Whatever stopped the run (Ctrl-C, SIGTERM, a full disk), leave no temporary file.
        _remove_partials(out, todo)
        _undo(created)
    return result


def repair_files(
    plan: Plan,
    out_dir: str | os.PathLike[str],
    files: dict[int, set[str]],
    *,
    rewrite_run_manifest: bool = False,
    workers: int = DEFAULT_WORKERS,
    reporter: Reporter | None = None,
) -> list[str]:
    """Rewrite from the source exactly ``files`` of a finished split in ``out_dir``.

    ``files`` maps a stage rank to names in its directory: its data files (rewritten from the
    plan), or its index, manifest, config.json or another side file (then the stage's
    non-weight files, manifest and index are written again, the manifest's digests taken from
    the data files, and those that are not the source's rewritten too). ``rewrite_run_manifest``
    rewrites ``reshard.json`` too. Every other file is left untouched; each rewritten one is
    replaced atomically, so a stage whose manifest and index are intact stays consistent
    throughout. Returns the paths rewritten, relative to OUT.
    """
    reporter = reporter or Reporter()
    out = Path(out_dir)
    to_write: list[tuple[StagePlan, OutputFile]] = []
    redo_meta: list[StagePlan] = []
    done: list[str] = []
    stages = [plan.stages[r] for r in sorted(files)]
    digests: dict[int, dict[str, str | None]] = {s.rank: {} for s in stages}
    try:
        # Temporaries left by an earlier run are replaced, never written through (one may be a
        # symlink out of OUT), as a resumed split clears them.
        _remove_partials(out, stages)
        for stage in stages:
            stage_dir = out / stage.dirname
            names = files[stage.rank]
            data = [f for f in stage.files if f.name in names]
            stage_dir.mkdir(exist_ok=True)
            if names - {f.name for f in stage.files}:
                redo_meta.append(stage)
                _remove(stage_dir / INDEX_NAME)  # not a complete-looking stage while it is mended
                # The new manifest records the digests of the data files kept, which nothing
                # vouched for (a damaged manifest is no measure): a file is kept only if its
                # header and tensors are the plan's and the source's, else it is rewritten too.
                for f in stage.files:
                    if f.name not in names:
                        found = _source_digests(plan, stage_dir / f.name, f)
                        data += [f] if found is None else []
                        digests[stage.rank].update(found or {})
            to_write += [(stage, f) for f in data]
            done += [f"{stage.dirname}/{f.name}" for f in data]
        # Mended files are copied, not shared: their bytes are read and get their digests.
        durable = _Durability(out, whole_fs=False)
        _copy_files(plan, out, to_write, digests, workers, reporter, share=False, durable=durable)
        for stage in stages:
            stage_dir = out / stage.dirname
            if stage in redo_meta:
                meta = (*plan.checkpoint.extra_files, STAGE_MANIFEST, INDEX_NAME)
                done += [f"{stage.dirname}/{n}" for n in meta]
            else:
                _remove(stage_dir / JOURNAL)  # a finished stage holds none
        _finish_stages(plan, out, redo_meta, digests, durable, _prepare_stages(plan, out, redo_meta))
        if rewrite_run_manifest:
            complete = [s.rank for s in plan.stages if stage_is_complete(out / s.dirname)]
            _write_atomic(out / RUN_MANIFEST, dumps(run_manifest(plan, complete)))
            done.append(RUN_MANIFEST)
        _fsync_dir(out)
    except OSError as e:
        raise _write_error(e, out, 0) from e
    finally:
        _remove_partials(out, stages)
    return done


def _source_digests(plan: Plan, path: Path, f: OutputFile) -> dict[str, str | None] | None:
    """sha256 of each tensor of the stage's data file ``path`` when the file is ``f`` exactly:
    its size and header the plan's, each tensor's bytes its source's. None otherwise (also
    when it is missing or short)."""
    if not _matches(path, f, _header(plan, f)):
        return None
    segments = [Segment(t.name, f.data_start + t.out_offset, t.source.nbytes) for t in f.tensors]
    by_source: dict[str, list[Segment]] = {}
    for t in f.tensors:
        by_source.setdefault(t.source.file, []).append(Segment(t.name, t.source.offset, t.source.nbytes))
    try:
        found = copy_segments(str(path), segments)
        want = {}
        for file, of_source in by_source.items():
            want.update(copy_segments(str(plan.checkpoint.path(file)), of_source))
    except (OSError, ReshardError):  # changed since it was measured: rewritten all the same
        return None
    return found if found == want else None


def check_out_dir(model_dir: Path, out_dir: Path) -> None:
    """Refuse an OUT that is MODEL itself or lies inside it."""
    model, out = model_dir.resolve(), out_dir.resolve()
    if out == model or out.is_relative_to(model):
        raise ReshardError(
            f"{param('out_dir')} {out_dir} is inside {param('model_dir')} {model_dir}; choose an output "
            "directory outside the checkpoint"
        )


def _can_share(plan: Plan, out: Path, to_write: list[tuple[StagePlan, OutputFile]], reflink: str) -> bool:
    """Whether this run shares blocks; refuses ``reflink="always"`` where OUT cannot."""
    shareable = [f.source_file for _, f in to_write if f.layout in (CLONE, ALIGNED)]
    if reflink == "never" or not to_write or (not shareable and reflink == "auto"):
        return False
    src = plan.checkpoint.path(shareable[0] if shareable else plan.checkpoint.files[0])
    ok = reflinks.probe(src, out)
    if not ok and reflink == "always":
        raise ReshardError(
            f"{param('out_dir')} {out} cannot share blocks with {src} (another filesystem, or one "
            f"without reflinks such as ext4 or tmpfs) and {param('reflink', 'always')} forbids "
            f"copying; use {param('reflink', 'auto')} to copy where sharing is impossible, or an "
            "output directory on the checkpoint's XFS/Btrfs filesystem"
        )
    return ok and bool(shareable)


def assess_out(plan: Plan, out_dir: str | os.PathLike[str], *, overwrite: bool = False) -> OutState:
    """What writing ``plan`` into ``out_dir`` would do there, without writing anything.

    The one decision both a real run (:func:`write_plan`) and a preview (``plan``, ``--dry-run``)
    take: raises ReshardError where a run refuses (OUT is a file, holds files this tool did not
    write, or a split made with other settings and not ``overwrite``).
    """
    out = Path(out_dir)
    check_out_dir(plan.checkpoint.root, out)
    try:
        return _assess_out(plan, out, overwrite)
    except OSError as e:  # e.g. OUT or a stage directory unreadable: as the real run says it
        raise _write_error(e, out, 0) from e


def _assess_out(plan: Plan, out: Path, overwrite: bool) -> OutState:
    if out.exists() and not out.is_dir():
        raise ReshardError(f"{param('out_dir')} {out} exists and is not a directory")
    if not out.exists():
        parent = next(p for p in out.absolute().parents if p.exists())
        if not parent.is_dir():
            raise ReshardError(
                f"{param('out_dir')} {out} cannot be created: {parent} is not a directory; choose "
                "another path"
            )
    # A run killed while writing its marker or run manifest, or while probing for sharing, leaves
    # only temporary files: ours, never worth keeping, and they must not make OUT look foreign.
    entries = sorted(p for p in out.iterdir() if not _run_temporary(p.name)) if out.is_dir() else []
    if not entries:
        return OutState("new")
    identity = run_identity(plan)
    record = read_run_record(out, str(out))
    if isinstance(record, Finding):
        raise ReshardError(record.message)
    recorded = record[1] if record is not None else None
    if recorded != identity:
        foreign = [
            p.name
            for p in entries
            if not (STAGE_DIR.fullmatch(p.name) and p.is_dir())
            and p.name not in (RUN_MARKER, RUN_MANIFEST, *plan.checkpoint.extra_files)
        ]
        if foreign or recorded is None:
            name = foreign[0] if foreign else entries[0].name
            raise ReshardError(
                f"{param('out_dir')} {out} holds {name!r}, which qwen35-reshard did not write; it is "
                "never deleted for you: choose an empty or new directory"
            )
        differences = describe_differences(recorded, identity)
        if not overwrite:
            raise ReshardError(
                f"{param('out_dir')} {out} holds a split made with other settings ({differences}); "
                f"choose another directory, or pass {param('overwrite', True)} to replace that split"
            )
        return OutState("replace", differences=differences)
    changed = _changed_source_files(plan, out) if record[0] == RUN_MARKER else []
    if changed:
        differences = f"source {changed[0]} changed since the interrupted run started"
        if not overwrite:
            raise ReshardError(
                f"{param('out_dir')} {out} holds an interrupted split of {plan.checkpoint.display}, and "
                f"{changed[0]} changed since it started: the files it finished hold the old bytes; "
                f"pass {param('overwrite', True)} to split again from the start"
            )
        return OutState("replace", differences=differences)
    complete = tuple(s.rank for s in plan.stages if stage_is_complete(out / s.dirname, identity))
    if all(s.rank in complete for s in plan.selected) and (out / RUN_MANIFEST).exists():
        return OutState("complete", complete)
    kept = {
        s.rank: _keepable(plan, out / s.dirname, s)
        for s in plan.selected
        if s.rank not in complete and (out / s.dirname).is_dir()
    }
    return OutState("resume", complete, {rank: files for rank, files in kept.items() if files})


def _source_stamps(plan: Plan) -> dict:
    """What tells that the source's bytes changed while its sizes, index and config did not (the
    run identity's fingerprint): each shard's size and modification time, or a Hub commit."""
    ckpt = plan.checkpoint
    if ckpt.hub is not None:
        return {"commit": ckpt.hub.get("commit")}
    return {f: [st.st_size, st.st_mtime_ns] for f in ckpt.files for st in [os.stat(ckpt.path(f))]}


def _changed_source_files(plan: Plan, out: Path) -> list[str]:
    """Source files (or the Hub commit) that changed since the interrupted run in ``out`` began;
    none when its marker records no stamps."""
    recorded = json.loads((out / RUN_MARKER).read_bytes()).get("source_files")
    if not isinstance(recorded, dict):
        return []
    now = _source_stamps(plan)
    return [name for name in sorted({*recorded, *now}) if recorded.get(name) != now.get(name)]


def _make_out(out: Path) -> list[Path]:
    """Create OUT if needed, without the temporary run files a killed run may have left.

    Returns the directories created (OUT and any missing parents, outermost first).
    """
    created = _make_dirs(out)
    for p in list(out.iterdir()):
        if _run_temporary(p.name):
            _remove(p)
    return created


def _run_temporary(name: str) -> bool:
    """A temporary file a killed run may leave in OUT itself: its marker's or run manifest's, or
    the probe for sharing."""
    ours = {f".{n}{PARTIAL_SUFFIX}" for n in (RUN_MARKER, RUN_MANIFEST)}
    return name in ours or (name.startswith(reflinks.PROBE_PREFIX) and name.endswith(PARTIAL_SUFFIX))


def _stage_dirs(out: Path) -> list[Path]:
    """The stage directories in OUT (``ppN``; real directories, not links to elsewhere)."""
    return [
        p for p in sorted(out.iterdir()) if STAGE_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink()
    ]


def _split_bytes(out: Path) -> int:
    """Disk bytes of the split in OUT that a replacing run deletes (its stage directories)."""
    sizes = (f.lstat() for d in _stage_dirs(out) for f in d.iterdir())
    return sum(st.st_blocks * 512 for st in sizes if stat.S_ISREG(st.st_mode))


def _clear_split(out: Path) -> None:
    """Delete the split with other settings that OUT holds (``assess_out`` said "replace")."""
    entries = sorted(out.iterdir())
    # The old split stays recorded, by a run marker, until its last file is gone (the new run's
    # marker then replaces it): a run killed while deleting leaves what the next run still sees
    # as a split with other settings, not files "qwen35-reshard did not write".
    record = read_run_record(out, str(out))
    if isinstance(record, tuple) and record[0] == RUN_MANIFEST:
        _write_atomic(out / RUN_MARKER, dumps({"identity": record[1].to_json()}))
    # What makes a directory look complete goes first, so that a run killed while deleting
    # leaves no run manifest and no stage index beside half-deleted data.
    _remove(out / RUN_MANIFEST)
    for p in _stage_dirs(out):
        _remove(p / INDEX_NAME)
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.name not in (RUN_MANIFEST, RUN_MARKER):
            p.unlink()


def _make_dirs(path: Path) -> list[Path]:
    """``mkdir -p path``, returning the directories it created, outermost first."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    created = []
    try:
        for d in reversed(missing):
            d.mkdir()
            created.append(d)
    except OSError:
        _undo(created)
        raise
    return created


def _undo(created: list[Path]) -> None:
    """Remove what a run that could not start created (files and empty directories), newest first."""
    for p in reversed(created):
        try:
            p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        except OSError:
            pass  # not empty (another writer?) or already gone: leave it


def _keepable(plan: Plan, stage_dir: Path, stage: StagePlan) -> dict[str, dict[str, str | None]]:
    """The data files of an unfinished stage that an earlier run finished (journaled, and they
    fit the plan), with their tensors' digests. Reads only."""
    journal = _read_journal(stage_dir / JOURNAL)
    kept: dict[str, dict[str, str | None]] = {}
    for f in stage.files:
        entry = journal.get(f.name)
        if entry is None or set(entry) != {t.name for t in f.tensors}:
            continue
        # A CLONE's header is its source's own: from the Hub it is not read just to compare.
        header = b"" if f.layout == CLONE and plan.checkpoint.hub is not None else _header(plan, f)
        if _matches(stage_dir / f.name, f, header):
            kept[f.name] = entry
    return kept


def _resume_stage(stage_dir: Path, stage: StagePlan, kept: dict[str, dict[str, str | None]]) -> None:
    """Prepare an unfinished stage: keep the ``kept`` data files, clear what will be rewritten."""
    stage_dir.mkdir(exist_ok=True)
    # Index first: without it no server loads the directory. Without config.json neither
    # does one that globs *.safetensors, while files are being replaced.
    for name in (INDEX_NAME, STAGE_MANIFEST, CONFIG_NAME):
        _remove(stage_dir / name)
    planned = {f.name for f in stage.files}
    for p in sorted(stage_dir.iterdir()):
        if p.name not in kept and (p.name.endswith(PARTIAL_SUFFIX) or p.name in planned):
            p.unlink()


def _matches(path: Path, f: OutputFile, header: bytes) -> bool:
    """A finished file of an earlier run fits the plan: same size, same ``header`` bytes."""
    try:
        with open(path, "rb") as fh:
            return os.fstat(fh.fileno()).st_size == f.size and fh.read(len(header)) == header
    except OSError:
        return False


def _header(
    plan: Plan, f: OutputFile, open_source: Callable[[str], str | RangeSource] | None = None
) -> bytes:
    """The bytes before ``f``'s data buffer: the plan's, or for a CLONE its source's own
    (read from ``open_source(file)`` when given, as the data is)."""
    if f.layout != CLONE:
        return f.header
    src = open_source(f.source_file) if open_source is not None else str(plan.checkpoint.path(f.source_file))
    if not isinstance(src, str | os.PathLike):
        buf = memoryview(bytearray(f.data_start))
        src.readinto(buf, 0)
        return bytes(buf)
    with open(src, "rb") as fh:
        return fh.read(f.data_start)


def _read_journal(path: Path) -> dict[str, dict[str, str]]:
    entries: dict[str, dict[str, str]] = {}
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        return entries
    for line in lines:
        try:
            rec = json.loads(line)
            entries[rec["file"]] = rec["digests"]
        except (*JSON_ERRORS, KeyError, TypeError):
            continue  # a line torn by a crash (bytes of any kind): that file is simply redone
    return entries


def _side_file_bytes(plan: Plan) -> int:
    """Bytes of config.json and the other non-weight files that every stage gets a copy of."""
    root = plan.checkpoint.root
    return sum(os.path.getsize(root / name) for name in plan.checkpoint.extra_files)


def _check_free_space(out: Path, needed: int, *, freed: int = 0) -> None:
    """Refuse a run that needs more than OUT's free space (plus ``freed``: what it deletes first)."""
    free = shutil.disk_usage(out).free + freed
    if needed > free:
        raise ReshardError(
            f"{param('out_dir')} {out} has {format_bytes(free)} free but this run writes "
            f"{format_bytes(needed)}; free {format_bytes(needed - free)} or choose another directory"
        )


def _copy_files(
    plan: Plan,
    out: Path,
    to_write: list[tuple[StagePlan, OutputFile]],
    digests: dict[int, dict[str, str | None]],
    workers: int,
    reporter: Reporter,
    open_source: Callable[[str], str | RangeSource] | None = None,
    *,
    share: bool,
    durable: _Durability,
    deferred: list[tuple[Path, Path]] | None = None,
    meanwhile: Callable[[], None] | None = None,
) -> tuple[int, int]:
    """Copy (or share) the data of ``to_write``, one worker per source shard; fills ``digests``.

    Returns how many of the files' bytes were copied and how many share the source's blocks.
    When the filesystem is synced whole and ``deferred`` is given, the files finished last are
    left under their temporary names, closed, their (temporary, final) names added to it: the
    stages' first barrier makes them durable with everything else. ``meanwhile()`` runs in
    this thread while the workers copy.
    """
    opened: list[_OpenFile] = []
    segments: dict[str, dict[str, Segment]] = {}
    share_fds: dict[str, set[int]] = {}
    shared = [0]
    lock = threading.Lock()

    def on_shared(n: int) -> None:
        with lock:
            shared[0] += n

    stop = threading.Event()
    try:
        for stage, f in to_write:
            stage_dir = out / stage.dirname
            tmp = stage_dir / f".{f.name}{PARTIAL_SUFFIX}"
            if share and f.layout == CLONE and _clone(plan, f, tmp):
                o = _OpenFile(stage, f, tmp, stage_dir / f.name, os.open(tmp, os.O_RDONLY), set())
                opened.append(o)
                digests[stage.rank].update(dict.fromkeys(f.tensor_names))
                on_shared(f.size)
                continue
            sharing = share and f.layout in (CLONE, ALIGNED)
            header = _header(plan, f, open_source)
            o = _create(stage, f, tmp, stage_dir / f.name, header, preallocate=not sharing)
            opened.append(o)
            if sharing:
                share_fds.setdefault(f.source_file, set()).add(o.fd)
            for t in f.tensors:
                s = t.source
                seg = segments.setdefault(s.file, {}).setdefault(s.name, Segment(s.name, s.offset, s.nbytes))
                seg.dests.append((o.fd, f.data_start + t.out_offset))
        total = sum(seg.nbytes for segs in segments.values() for seg in segs.values())
        reporter.start(total)
        # Clones are finished with the next files that are: redoing one costs nothing, so it
        # is not worth a barrier of its own. Synced file by file, they are finished now.
        ready: list[_OpenFile] = [o for o in opened if not o.pending_sources]  # not yet durable
        if not durable.whole_fs:
            _finish_files(ready, digests, durable)
            ready = []

        def run(file: str) -> dict[str, str | None]:
            src = open_source(file) if open_source is not None else str(plan.checkpoint.path(file))
            return copy_segments(
                src,
                list(segments[file].values()),
                on_progress=reporter.advance,
                should_stop=stop.is_set,
                share_fds=frozenset(share_fds.get(file, ())),
                on_shared=on_shared,
            )

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = {pool.submit(run, file): file for file in sorted(segments)}
            try:
                if meanwhile is not None:
                    meanwhile()
                while futures:
                    done, _ = wait(futures, return_when=FIRST_COMPLETED)
                    for fut in done:
                        file = futures.pop(fut)
                        found = fut.result()
                        for o in opened:
                            if file in o.pending_sources:
                                digests[o.stage.rank].update(
                                    {t.name: found[t.name] for t in o.plan.tensors if t.source.file == file}
                                )
                                o.pending_sources.discard(file)
                                if not o.pending_sources:
                                    ready.append(o)
                                    if copier.DROP_BEHIND:  # written back now, not all at the barrier
                                        drop_pages(o.fd, 0, 0)
                    # A barrier of the whole filesystem costs the same for one file or many:
                    # then files are finished once enough copied bytes would be lost to a crash.
                    copied = (
                        sum(o.plan.size - o.plan.shareable_bytes for o in ready) if durable.whole_fs else 0
                    )
                    if futures and (not durable.whole_fs or copied >= PROGRESS_BYTES):
                        _finish_files(ready, digests, durable)
                        ready = []
            except BaseException:
                stop.set()
                for fut in futures:
                    fut.cancel()
                raise
        if durable.whole_fs and deferred is not None:
            # Left for the stages' first barrier, which makes them durable with everything else.
            for o in ready:
                os.close(o.fd)
                o.fd = -1
                deferred.append((o.tmp, o.final))
        else:
            _finish_files(ready, digests, durable)
        return sum(f.size for _, f in to_write) - shared[0], shared[0]
    finally:
        for o in opened:
            if o.fd >= 0:
                os.close(o.fd)
                _remove(o.tmp)


def _clone(plan: Plan, f: OutputFile, tmp: Path) -> bool:
    """Make ``tmp`` share every block of ``f``'s source shard; False where refused."""
    src = os.open(plan.checkpoint.path(f.source_file), os.O_RDONLY)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            ok = reflinks.clone_file(src, dst) and os.fstat(dst).st_size == f.size
        finally:
            os.close(dst)
    finally:
        os.close(src)
    if not ok:
        _remove(tmp)
    return ok


def _create(
    stage: StagePlan, f: OutputFile, tmp: Path, final: Path, header: bytes, *, preallocate: bool
) -> _OpenFile:
    """Create ``tmp`` at ``f``'s size with ``header`` written; its data comes later.

    Preallocating makes a full disk fail here, before any copying; a file that will share
    blocks with the source is only sized (allocating blocks it will share would need the
    space the sharing saves).
    """
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if preallocate and hasattr(os, "posix_fallocate") and f.size:
            try:
                os.posix_fallocate(fd, 0, f.size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        else:
            os.ftruncate(fd, f.size)
        os.pwrite(fd, header, 0)
    except BaseException:  # not yet known to the caller's cleanup: clean up here
        os.close(fd)
        _remove(tmp)
        raise
    return _OpenFile(stage, f, tmp, final, fd, {t.source.file for t in f.tensors})


def _finish_files(
    files: list[_OpenFile], digests: dict[int, dict[str, str | None]], durable: _Durability
) -> None:
    """Make finished data files durable, give them their final names, and journal them.

    Files finished together (the clones, made before any copying; the files a source shard
    completes) share one barrier, one directory sync and one journal write per stage. The
    journal may lag behind the renames (a file found without its entry is redone), never
    ahead of the bytes: each entry names a file whose bytes were durable before it was renamed.
    """
    if not files:
        return
    for o in files:
        os.close(o.fd)
        o.fd = -1
    durable.files([o.tmp for o in files])
    for o in files:
        os.replace(o.tmp, o.final)
    stage_dirs = list(dict.fromkeys(o.final.parent for o in files))
    durable.dirs(stage_dirs, lazy=True)
    for stage_dir in stage_dirs:
        records = [
            {"file": o.plan.name, "digests": {t.name: digests[o.stage.rank][t.name] for t in o.plan.tensors}}
            for o in files
            if o.final.parent == stage_dir
        ]
        with open(stage_dir / JOURNAL, "a") as j:
            j.write("".join(json.dumps(r) + "\n" for r in records))
    durable.files([d / JOURNAL for d in stage_dirs], lazy=True)


@dataclass
class _Prepared:
    """What finishing stages writes before it knows any digest, under temporary names."""

    dirs: list[Path]
    first: list[tuple[Path, Path]]  # (temporary, final): side files, renamed before any index
    indexes: list[tuple[Path, Path]]
    manifests: list[ManifestDraft]
    side_files_of_out: bool


def _prepare_stages(
    plan: Plan, out: Path, stages: list[StagePlan], *, side_files_of_out: bool = False
) -> _Prepared:
    """Write each of ``stages``' non-weight files and index (and OUT's own non-weight files,
    when asked) under temporary names, and make their manifests but for the digests."""
    dirs = [out / s.dirname for s in stages]
    first: list[tuple[Path, Path]] = []
    indexes, manifests = [], []
    side_dirs = [*dirs, out] if side_files_of_out else dirs
    for name in plan.checkpoint.extra_files:
        first += _copy_side_file(plan.checkpoint.path(name), [d / name for d in side_dirs])
    for stage, stage_dir in zip(stages, dirs, strict=True):
        index_bytes = dumps(stage_index(stage))
        indexes.append(_write_tmp(stage_dir / INDEX_NAME, index_bytes))
        manifests.append(stage_manifest(plan, stage, index_bytes))
    return _Prepared(dirs, first, indexes, manifests, side_files_of_out)


def _finish_stages(
    plan: Plan,
    out: Path,
    stages: list[StagePlan],
    digests: dict[int, dict[str, str | None]],
    durable: _Durability,
    prepared: _Prepared,
    *,
    run_record: bytes | None = None,
    data: list[tuple[Path, Path]] | None = None,
) -> None:
    """Give each of ``stages`` its non-weight files, manifest and, last, its index (all but
    the manifests ``prepared``); then the run record, when given. ``data``: (temporary,
    final) names of data files written but not yet made durable; the rest are finished.

    Everything is written under temporary names first, then made durable and renamed in two
    steps, each behind a barrier: data, side files and manifests (and the journals removed: a
    finished stage never holds one, and later runs skip finished stages); then the indexes,
    which make the stages complete, and the run record. A last barrier makes those durable.
    The run record shares its step with the indexes: nothing trusts it alone (the next run
    and ``verify`` check every stage it records as complete), so a crash that kept it and lost
    an index costs a stage redone, not a wrong answer.
    """
    dirs, indexes = prepared.dirs, prepared.indexes
    first = [*(data or []), *prepared.first]  # (temporary, final) renamed before any index
    for stage, stage_dir, draft in zip(stages, dirs, prepared.manifests, strict=True):
        first.append(_write_tmp(stage_dir / STAGE_MANIFEST, draft.encode(digests[stage.rank])))
    last = [_write_tmp(out / RUN_MANIFEST, run_record)] if run_record is not None else []
    if not first and not last:
        return
    # Barrier 1: every byte written so far (and, synced whole, the data files' final names).
    durable.files([tmp for tmp, _ in (*first, *indexes, *last)])
    for stage_dir in dirs:
        _remove(stage_dir / JOURNAL)
    for tmp, final in first:
        os.replace(tmp, final)
    durable.dirs([*dirs, out] if prepared.side_files_of_out else dirs)  # 2: all of a stage but its index
    for tmp, final in indexes:
        os.replace(tmp, final)
    if last:
        os.replace(*last[0])
        _remove(out / RUN_MARKER)
    durable.dirs([*dirs, out] if last else dirs)  # barrier 3: the stages complete, the run recorded


def _copy_side_file(src: Path, finals: list[Path]) -> list[tuple[Path, Path]]:
    """Copy the non-weight file ``src`` to the temporary names of ``finals``; returns
    (temporary, final) pairs. A small one (all but rare ones) is read once for all its copies."""
    pairs = [(final.with_name(f".{final.name}{PARTIAL_SUFFIX}"), final) for final in finals]
    if not pairs:
        return pairs
    if os.path.getsize(src) > SIDE_FILE_IN_MEMORY:
        for tmp, _ in pairs:
            shutil.copyfile(src, tmp)
        return pairs
    data = src.read_bytes()
    for tmp, _ in pairs:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            pwrite_all(fd, memoryview(data), 0)
        finally:
            os.close(fd)
    return pairs


def _write_tmp(path: Path, data: bytes) -> tuple[Path, Path]:
    """Write ``data`` under ``path``'s temporary name; returns (temporary, final)."""
    tmp = path.with_name(f".{path.name}{PARTIAL_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
    return tmp, path


def _write_atomic(path: Path, data: bytes, *, sync_dir: bool = True) -> None:
    """Replace ``path`` with ``data``, durable (``sync_dir``: its name too, else the caller's
    next barrier makes it so)."""
    tmp, _ = _write_tmp(path, data)
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if sync_dir:
        _fsync_dir(path.parent)


class _Durability:
    """How a run makes what it wrote durable: file by file, or its filesystem at once.

    ``files(paths)`` makes the bytes of ``paths`` durable, ``dirs(paths)`` the entries
    (renames, removals) of those directories. File by file, each is an fsync, issued side by
    side (a journaling filesystem commits them together). With ``whole_fs``, each is one
    ``syncfs`` of OUT's filesystem, which also makes everything written before it durable,
    names included: one log commit instead of one per file and directory, at the price of
    also flushing other writers' dirty data on that filesystem. A run that shares blocks
    uses it (its files are mostly metadata, and it would pay ~100 fsyncs for a split that
    otherwise takes a fraction of a second); a run that copies fsyncs its own files, whose
    data is being written back as it goes.

    The order of the steps is what makes a crash safe, and it is the same both ways: no name
    becomes final before the bytes behind it are durable, and a barrier separates each step
    from the next.
    """

    def __init__(self, out: Path, *, whole_fs: bool) -> None:
        self.out = out
        self.whole_fs = whole_fs and _syncfs is not None

    def files(self, paths: list[Path], *, lazy: bool = False) -> None:
        """Make the bytes of ``paths`` durable. ``lazy``: needed only by the next barrier's
        renames (or only so that finished work survives a crash, a journal): when the
        filesystem is synced whole, that barrier covers it."""
        if not paths or (lazy and self.whole_fs):
            return
        if self.whole_fs:
            self._syncfs()
            return
        fds = [os.open(p, os.O_RDONLY) for p in paths]
        try:
            _fsync_all(fds)
        finally:
            for fd in fds:
                os.close(fd)

    def dirs(self, paths: list[Path], *, lazy: bool = False) -> None:
        """Make the entries of the directories ``paths`` durable (``lazy``: as for files)."""
        if not paths or (lazy and self.whole_fs):
            return
        if self.whole_fs:
            self._syncfs()
            return
        fds = [os.open(p, os.O_RDONLY | os.O_DIRECTORY) for p in dict.fromkeys(paths)]
        try:
            _fsync_all(fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _syncfs(self) -> None:
        fd = os.open(self.out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if _syncfs(fd) != 0:  # since Linux 5.8 it also reports write-back errors
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(self.out))
        finally:
            os.close(fd)


def _load_syncfs():
    """libc's ``syncfs(fd)`` (Linux), or None where there is none."""
    try:
        return ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None


_syncfs = _load_syncfs()


def _fsync_all(fds: list[int]) -> None:
    """fsync every file of ``fds``, side by side: a journaling filesystem commits them together."""
    if len(fds) < 2:
        for fd in fds:
            os.fsync(fd)
        return
    with ThreadPoolExecutor(max_workers=min(16, len(fds))) as pool:
        list(pool.map(os.fsync, fds))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_error(e: OSError, out: Path, needed: int) -> ReshardError:
    """One line for a failed write: a full disk names OUT and the space the run needs."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ReshardError(
            f"{param('out_dir')} {out}: no space left on device ({e.strerror}); this run writes "
            f"{format_bytes(needed)}: free space and run the same command again to resume"
        )
    return ReshardError(
        f"{e.filename or out}: {e.strerror or e}; cannot write the split there: choose another directory "
        "or fix its permissions"
    )


def _remove_partials(out: Path, stages: list[StagePlan]) -> None:
    """Delete the temporary ``.NAME.partial`` files in OUT and in the stages of this run."""
    for d in (out, *(out / s.dirname for s in stages)):
        try:
            entries = list(d.iterdir())
        except (FileNotFoundError, NotADirectoryError):  # never made, or not ours to clean
            continue
        for p in entries:
            if p.name.startswith(".") and p.name.endswith(PARTIAL_SUFFIX):
                _remove(p)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass

