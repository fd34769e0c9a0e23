"""Execute a plan: write each selected stage's directory, crash-safe and resumable.

Every file is written under a temporary name, flushed and renamed. A stage's manifest and
then its index are written last, after its data is durable, so a run killed at any point
leaves no stage that looks complete. Finished data files are journaled with their digests,
so running the same command again keeps them and redoes only the rest.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from . import manifest
from .copy import RangeSource, Segment, copy_segments
from .errors import ReshardError
from .plan import OutputFile, Plan, StagePlan
from .source import CONFIG_NAME, INDEX_NAME

RUN_MARKER = ".reshard-run.json"  # identity of a run in progress; removed on success
JOURNAL = ".reshard-journal.jsonl"  # finished data files of an unfinished stage, with digests
PARTIAL_SUFFIX = ".partial"


class Reporter:
    """Progress callbacks of a write; the default reports nothing. May be called from threads."""

    def start(self, total_bytes: int) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def stage_done(self, stage: StagePlan) -> None: ...


@dataclass
class WriteResult:
    """What a write did: stages built now, stages that were already complete, bytes copied."""

    built: list[int] = field(default_factory=list)
    already_complete: list[int] = field(default_factory=list)
    files_kept: int = 0
    bytes_copied: int = 0

    @property
    def nothing_to_do(self) -> bool:
        return not self.built


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
    workers: int = 1,
    reporter: Reporter | None = None,
    open_source: Callable[[str], str | RangeSource] | None = None,
) -> WriteResult:
    """Write the stages ``plan.ranks`` of ``plan`` under ``out_dir``.

    Resumes an interrupted run with the same settings; refuses a non-empty ``out_dir``
    holding anything else unless ``overwrite``. ``workers`` source shards are copied at
    once, each read by exactly one worker. ``open_source(file)`` gives the source of a data
    file that still has bytes to copy (a local path or a range source; it may download the
    file first); by default each file is read from the checkpoint's directory.
    """
    reporter = reporter or Reporter()
    out = Path(out_dir)
    identity = manifest.run_identity(plan)
    try:
        created = _prepare_out(plan, out, identity, overwrite=overwrite)
    except OSError as e:  # OUT cannot be created or read: nothing was written
        raise _write_error(e, out, 0) from None

    result = WriteResult()
    todo = []
    for stage in plan.selected:
        if manifest.stage_is_complete(out / stage.dirname, identity):
            result.already_complete.append(stage.rank)
        else:
            todo.append(stage)
    if not todo and (out / manifest.RUN_MANIFEST).exists():
        _remove(out / RUN_MARKER)  # left if a run was killed between its last two steps
        return result

    digests: dict[int, dict[str, str]] = {}
    needed = 0
    # What this run adds before its first data file, so that a run that cannot start (a
    # read-only or full OUT, no permission) leaves OUT as it found it.
    created += [out / name for name in (RUN_MARKER, *(s.dirname for s in todo)) if not (out / name).exists()]
    try:
        _write_atomic(out / RUN_MARKER, manifest.dumps({"identity": identity}))
        _remove(out / manifest.RUN_MANIFEST)
        to_write: list[tuple[StagePlan, OutputFile]] = []
        for stage in todo:
            kept, digests[stage.rank] = _resume_stage(out / stage.dirname, stage)
            result.files_kept += len(kept)
            to_write += [(stage, f) for f in stage.files if f.name not in kept]
        side_copies = len(todo) + 1  # each stage's, and OUT's own
        needed = sum(f.size for _, f in to_write) + side_copies * _side_file_bytes(plan)
        _check_free_space(out, needed)
        created = []  # from here on, finished files are kept for the next run to resume

        result.bytes_copied = _copy_files(plan, out, to_write, digests, workers, reporter, open_source)
        for stage in todo:
            _finish_stage(plan, out / stage.dirname, stage, digests[stage.rank])
            result.built.append(stage.rank)
            reporter.stage_done(stage)
        # OUT itself is the model path of `vllm serve OUT --load-format qwen35-stages`: vLLM reads
        # the config and the tokenizer there (and refuses a split for SGLang in the plugin, with
        # the shim's message), each rank's weights from OUT/pp{rank}.
        _copy_side_files(plan, out)
        complete = [s.rank for s in plan.stages if manifest.stage_is_complete(out / s.dirname, identity)]
        _write_atomic(out / manifest.RUN_MANIFEST, manifest.dumps(manifest.run_manifest(plan, complete)))
        _remove(out / RUN_MARKER)
        _fsync_dir(out)
    except OSError as e:  # a full disk, a file-size limit, ... while writing anything
        raise _write_error(e, out, needed) from None
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
    run_manifest: bool = False,
    workers: int = 1,
    reporter: Reporter | None = None,
) -> list[str]:
    """Rewrite from the source exactly ``files`` of a finished split in ``out_dir``.

    ``files`` maps a stage rank to names in its directory: its data files (rewritten from the
    plan), or its index, manifest, config.json or another side file (then the stage's
    non-weight files, manifest and index are written again, the manifest's digests taken from
    the data files). ``run_manifest`` rewrites ``reshard.json`` too. Every other file is left
    untouched; each rewritten one is replaced atomically, so a stage whose manifest and index
    are intact stays consistent throughout. Returns the paths rewritten, relative to OUT.
    """
    reporter = reporter or Reporter()
    out = Path(out_dir)
    to_write: list[tuple[StagePlan, OutputFile]] = []
    redo_meta: list[StagePlan] = []
    done: list[str] = []
    stages = [plan.stages[r] for r in sorted(files)]
    try:
        for stage in stages:
            stage_dir = out / stage.dirname
            names = files[stage.rank]
            data = [f for f in stage.files if f.name in names]
            stage_dir.mkdir(exist_ok=True)
            if names - {f.name for f in stage.files}:
                redo_meta.append(stage)
                _remove(stage_dir / INDEX_NAME)  # not a complete-looking stage while it is mended
            to_write += [(stage, f) for f in data]
            done += [f"{stage.dirname}/{f.name}" for f in data]
        digests: dict[int, dict[str, str]] = {s.rank: {} for s in stages}
        _copy_files(plan, out, to_write, digests, workers, reporter)
        for stage in stages:
            stage_dir = out / stage.dirname
            if stage in redo_meta:
                rewritten = {f.name for f in stage.files if f.name in files[stage.rank]}
                for f in stage.files:
                    if f.name not in rewritten:
                        digests[stage.rank].update(_file_digests(stage_dir / f.name, f))
                _finish_stage(plan, stage_dir, stage, digests[stage.rank])
                meta = (*plan.checkpoint.extra_files, manifest.STAGE_MANIFEST, INDEX_NAME)
                done += [f"{stage.dirname}/{n}" for n in meta]
            else:
                _remove(stage_dir / JOURNAL)  # a finished stage holds none
        if run_manifest:
            complete = [s.rank for s in plan.stages if manifest.stage_is_complete(out / s.dirname)]
            _write_atomic(out / manifest.RUN_MANIFEST, manifest.dumps(manifest.run_manifest(plan, complete)))
            done.append(manifest.RUN_MANIFEST)
        _fsync_dir(out)
    except OSError as e:
        raise _write_error(e, out, 0) from None
    finally:
        _remove_partials(out, stages)
    return done


def _file_digests(path: Path, f: OutputFile) -> dict[str, str]:
    """sha256 of each tensor of the stage's data file ``path``, laid out as ``f`` says."""
    data_start = len(f.header)
    segments = [Segment(t.name, data_start + t.out_offset, t.source.nbytes) for t in f.tensors]
    return copy_segments(str(path), segments)


def check_out_dir(model_dir: Path, out_dir: Path) -> None:
    """Refuse an OUT that is MODEL itself or lies inside it."""
    model, out = model_dir.resolve(), out_dir.resolve()
    if out == model or out.is_relative_to(model):
        raise ReshardError(
            f"OUT {out_dir} is inside MODEL {model_dir}; choose an output directory outside the checkpoint"
        )


def _prepare_out(plan: Plan, out: Path, identity: dict, *, overwrite: bool) -> list[Path]:
    """Create OUT if needed and check that this run may write into it.

    Returns the directories created (OUT and any missing parents, outermost first).
    """
    check_out_dir(plan.checkpoint.root, out)
    if out.exists() and not out.is_dir():
        raise ReshardError(f"OUT {out} exists and is not a directory")
    created = _make_dirs(out)
    # A run killed while writing its marker or run manifest leaves only their temporary files:
    # ours, never worth keeping, and they must not make OUT look foreign to the next run.
    for name in (RUN_MARKER, manifest.RUN_MANIFEST):
        _remove(out / f".{name}{PARTIAL_SUFFIX}")
    entries = sorted(out.iterdir())
    if not entries:
        return created
    marker = manifest.read_json(out / RUN_MARKER) or manifest.read_json(out / manifest.RUN_MANIFEST)
    if marker is not None and marker.get("identity") == identity:
        return created
    what = "a split made with other settings" if marker else "files not written by qwen35-reshard"
    if not overwrite:
        raise ReshardError(
            f"OUT {out} is not empty and holds {what}; choose an empty directory or pass "
            "--overwrite to replace it"
        )
    foreign = [
        p.name
        for p in entries
        if not manifest.STAGE_DIR.fullmatch(p.name)
        and p.name not in (RUN_MARKER, manifest.RUN_MANIFEST, *plan.checkpoint.extra_files)
    ]
    if foreign:
        raise ReshardError(
            f"OUT {out} holds {foreign[0]!r}, which qwen35-reshard did not write; refusing to "
            "delete it even with --overwrite: choose another directory"
        )
    # What makes a directory look complete goes first, so that a run killed while deleting
    # leaves no run manifest and no stage index beside half-deleted data.
    _remove(out / manifest.RUN_MANIFEST)
    for p in entries:
        if manifest.STAGE_DIR.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            _remove(p / INDEX_NAME)
    for p in entries:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.name != manifest.RUN_MANIFEST:
            p.unlink()
    return created


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


def _resume_stage(stage_dir: Path, stage: StagePlan) -> tuple[set[str], dict[str, str]]:
    """Prepare an unfinished stage: keep journaled files that check out, clear the rest.

    Returns the names of the kept data files and the digests of their tensors.
    """
    stage_dir.mkdir(exist_ok=True)
    # Index first: without it no server loads the directory. Without config.json neither
    # does one that globs *.safetensors, while files are being replaced.
    for name in (INDEX_NAME, manifest.STAGE_MANIFEST, CONFIG_NAME):
        _remove(stage_dir / name)
    journal = _read_journal(stage_dir / JOURNAL)
    planned = {f.name: f for f in stage.files}
    kept: set[str] = set()
    digests: dict[str, str] = {}
    for p in sorted(stage_dir.iterdir()):
        f = planned.get(p.name)
        entry = journal.get(p.name)
        if (
            f is not None
            and entry is not None
            and _matches(p, f)
            and set(entry) == {t.name for t in f.tensors}
        ):
            kept.add(p.name)
            digests.update(entry)
        elif p.name.endswith(PARTIAL_SUFFIX) or p.name in planned:
            p.unlink()
    return kept, digests


def _matches(path: Path, f: OutputFile) -> bool:
    """A finished file of an earlier run fits the plan: same size, same header bytes."""
    try:
        with open(path, "rb") as fh:
            return os.fstat(fh.fileno()).st_size == f.size and fh.read(len(f.header)) == f.header
    except OSError:
        return False


def _read_journal(path: Path) -> dict[str, dict[str, str]]:
    entries: dict[str, dict[str, str]] = {}
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return entries
    for line in lines:
        try:
            rec = json.loads(line)
            entries[rec["file"]] = rec["digests"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line torn by a crash: that file is simply redone
    return entries


def _side_file_bytes(plan: Plan) -> int:
    """Bytes of config.json and the other non-weight files that every stage gets a copy of."""
    root = plan.checkpoint.root
    return sum(os.path.getsize(root / name) for name in plan.checkpoint.extra_files)


def _check_free_space(out: Path, needed: int) -> None:
    free = shutil.disk_usage(out).free
    if needed > free:
        raise ReshardError(
            f"OUT {out} has {_gb(free)} free but this run writes {_gb(needed)}; free "
            f"{_gb(needed - free)} or choose another OUT"
        )


def _copy_files(
    plan: Plan,
    out: Path,
    to_write: list[tuple[StagePlan, OutputFile]],
    digests: dict[int, dict[str, str]],
    workers: int,
    reporter: Reporter,
    open_source: Callable[[str], str | RangeSource] | None = None,
) -> int:
    """Copy the data of ``to_write``, one worker per source shard; fills ``digests``."""
    opened: list[_OpenFile] = []
    segments: dict[str, dict[str, Segment]] = {}
    stop = threading.Event()
    try:
        for stage, f in to_write:
            stage_dir = out / stage.dirname
            o = _create(stage, f, stage_dir / (f".{f.name}{PARTIAL_SUFFIX}"), stage_dir / f.name)
            opened.append(o)
            data_start = len(f.header)
            for t in f.tensors:
                s = t.source
                seg = segments.setdefault(s.file, {}).setdefault(s.name, Segment(s.name, s.offset, s.nbytes))
                seg.dests.append((o.fd, data_start + t.out_offset))
        total = sum(seg.nbytes for segs in segments.values() for seg in segs.values())
        reporter.start(total)
        for o in opened:
            if not o.pending_sources:
                _finish_file(o, out, digests)

        def run(file: str) -> dict[str, str]:
            src = open_source(file) if open_source is not None else str(plan.checkpoint.path(file))
            return copy_segments(
                src, list(segments[file].values()), on_progress=reporter.advance, should_stop=stop.is_set
            )

        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            futures = {pool.submit(run, file): file for file in sorted(segments)}
            try:
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
                                    _finish_file(o, out, digests)
            except BaseException:
                stop.set()
                for fut in futures:
                    fut.cancel()
                raise
        return total
    finally:
        for o in opened:
            if o.fd >= 0:
                os.close(o.fd)
                _remove(o.tmp)


def _create(stage: StagePlan, f: OutputFile, tmp: Path, final: Path) -> _OpenFile:
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if hasattr(os, "posix_fallocate") and f.size:
            try:
                os.posix_fallocate(fd, 0, f.size)  # a full disk fails here, before any copying
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        os.pwrite(fd, f.header, 0)
    except BaseException:  # not yet known to the caller's cleanup: clean up here
        os.close(fd)
        _remove(tmp)
        raise
    return _OpenFile(stage, f, tmp, final, fd, {t.source.file for t in f.tensors})


def _finish_file(o: _OpenFile, out: Path, digests: dict[int, dict[str, str]]) -> None:
    """Make a finished data file durable, give it its final name, and journal it."""
    os.fsync(o.fd)
    os.close(o.fd)
    o.fd = -1
    os.replace(o.tmp, o.final)
    _fsync_dir(o.final.parent)
    record = {"file": o.plan.name, "digests": {t.name: digests[o.stage.rank][t.name] for t in o.plan.tensors}}
    with open(o.final.parent / JOURNAL, "a") as j:
        j.write(json.dumps(record) + "\n")
        j.flush()
        os.fsync(j.fileno())


def _finish_stage(plan: Plan, stage_dir: Path, stage: StagePlan, digests: dict[str, str]) -> None:
    """Copy the non-weight files, then write the manifest and, last, the index."""
    _copy_side_files(plan, stage_dir)
    index_bytes = manifest.dumps(manifest.stage_index(stage))
    stage_manifest = manifest.stage_manifest(plan, stage, digests, index_bytes)
    # The journal goes before the stage can look complete: a finished stage never holds one
    # (later runs skip finished stages, so one left behind would never be cleaned up).
    _remove(stage_dir / JOURNAL)
    _write_atomic(stage_dir / manifest.STAGE_MANIFEST, manifest.dumps(stage_manifest))
    _write_atomic(stage_dir / INDEX_NAME, index_bytes)
    _fsync_dir(stage_dir)


def _copy_side_files(plan: Plan, directory: Path) -> None:
    """Copy config.json and the source's other non-weight files into ``directory``, atomically."""
    root = plan.checkpoint.root
    for name in plan.checkpoint.extra_files:
        tmp = directory / f".{name}{PARTIAL_SUFFIX}"
        shutil.copyfile(root / name, tmp)
        _fsync_path(tmp)
        os.replace(tmp, directory / name)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}{PARTIAL_SUFFIX}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
            f"OUT {out}: no space left on device ({e.strerror}); this run writes {_gb(needed)}: free "
            "space and run the same command again to resume"
        )
    return ReshardError(
        f"{e.filename or out}: {e.strerror or e}; cannot write the split there: choose another OUT "
        "or fix its permissions"
    )


def _remove_partials(out: Path, stages: list[StagePlan]) -> None:
    """Delete the temporary ``.NAME.partial`` files in OUT and in the stages of this run."""
    for d in (out, *(out / s.dirname for s in stages)):
        try:
            entries = list(d.iterdir())
        except FileNotFoundError:
            continue
        for p in entries:
            if p.name.startswith(".") and p.name.endswith(PARTIAL_SUFFIX):
                _remove(p)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _gb(n: int) -> str:
    """Bytes for people; MB below a GB, so that a small run does not read "0.00 GB"."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"
