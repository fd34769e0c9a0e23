"""Server-side shim: open one stage directory and stream exactly its tensors.

    from qwen35_reshard import loader
    stage = loader.open_stage("OUT", pp_rank=2)            # or loader.open_stage("OUT/pp2")
    stage.check(pp_size=4, start_layer=30, end_layer=45)   # the server's own view of its rank
    model.load_weights(stage.iter_weights())               # Hugging Face names, no PP skip logic

Opening a stage checks, without reading tensor data, that the directory is a finished stage
(manifest and index present, the index being the one the manifest names), that it belongs to
the split recorded beside it, and that every data file's header lists exactly the manifest's
tensors with the same dtype, shape and size (``stage.reader.read_stage``, which ``verify`` shares).
``iter_weights`` then reads only this stage's files, one tensor at a time in file-offset
order, each a view of the file's memory map as safetensors' own reader makes them; never pickle.

torch is imported only inside ``iter_weights``: the package stays importable without it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path

from ..bulk import collector_paused
from ..errors import DamagedStage, StageError
from ..format.digest import SHA256
from ..format.dtypes import DTYPES
from ..format.names import INDEX_NAME, RUN_MANIFEST, STAGE_MANIFEST, stage_dir_rank, stage_dirname
from ..model.runtimes import launch_env, runtime_of
from ..stage.digestpool import Mismatch, Range, ranges_of
from ..stage.findings import REBUILD, REPAIR, Finding, tensor_digest_finding
from ..stage.manifest import StageManifest, StageTensor
from ..stage.nodechecks import NodeChecks
from ..stage.reader import RunRecord, read_run_record, read_stage
from ..units import format_bytes, plural
from .checks import FileChanged, LoadCheck, copy_threads
from .mapping import Changed as _Changed
from .mapping import Readahead as _Readahead
from .mapping import mapped as _mapped
from .mapping import tensor_at as _tensor_at

VERIFY_LOAD_ENV = "QWEN35_RESHARD_VERIFY_LOAD"  # 0: loads do not hash (checked elsewhere)

log = logging.getLogger(__name__)


@dataclass
class Stage:
    """A validated stage directory: its recorded facts (``manifest``) and where it is. Nothing
    is read until iterated."""

    path: Path
    display: str  # the path as the caller spelled it, for messages
    manifest: StageManifest = field(repr=False)  # tensors in load order: file, then offset
    headers: dict[str, bytes] = field(repr=False)  # each data file's header JSON as validated
    # Called with a data file found damaged while loading: may act (the stage cache sets the
    # file aside, to be fetched again) and returns what to tell the user; None: repair advice.
    on_damaged: Callable[[str], str] | None = field(default=None, repr=False)
    unrecorded: str | None = None  # why tensors without a sha256 have none, where not a shared split
    files_at: str | None = None  # the data files' directory in messages, where not ``display``

    @property
    def rank(self) -> int:
        return self.manifest.rank

    @property
    def pp(self) -> int:
        return self.manifest.pp

    @property
    def runtime(self) -> str:
        return self.manifest.runtime

    @property
    def partition(self) -> tuple[int, ...]:
        return self.manifest.partition

    @property
    def start_layer(self) -> int:
        return self.manifest.start_layer

    @property
    def end_layer(self) -> int:
        """The first layer after this stage's (exclusive end)."""
        return self.manifest.end_layer

    @property
    def mtp(self) -> str | None:
        return self.manifest.mtp

    @property
    def tensors(self) -> dict[str, StageTensor]:
        """This stage's tensors by name, in load order: file, then offset."""
        return self.manifest.tensors

    @property
    def files(self) -> tuple[str, ...]:
        """The stage's data files, in load order."""
        return tuple(sorted(self.manifest.files))

    @property
    def names(self) -> list[str]:
        """This stage's tensor names, in the order ``iter_weights`` yields them."""
        return list(self.tensors)

    @property
    def num_layers(self) -> int:
        return sum(self.partition)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def launch_env(self) -> str:
        """The variable the server must be launched with, e.g. SGLANG_PP_LAYER_PARTITION=..."""
        return launch_env(self.runtime, list(self.partition))

    def __len__(self) -> int:
        return len(self.tensors)

    def check(
        self,
        pp_size: int,
        start_layer: int,
        end_layer: int,
        *,
        pp_rank: int | None = None,
        runtime: str | None = None,
    ) -> None:
        """Raise StageError unless the server's view of its rank is the one this stage was built for.

        ``pp_size``, ``start_layer`` and ``end_layer`` (exclusive) are what the server computed
        for itself; ``pp_rank`` and ``runtime`` are checked when given.
        """
        mine = f"pp={self.pp} layers [{self.start_layer}, {self.end_layer})"
        theirs = f"pp={pp_size} layers [{start_layer}, {end_layer})"
        if pp_rank is not None and pp_rank != self.rank:
            raise StageError(
                f"{self.display} is stage {self.rank} ({mine}) but the server is rank {pp_rank} "
                f"({theirs}): give rank {pp_rank} its own directory (pp{pp_rank})"
            )
        if runtime is not None and runtime != self.runtime:
            raise StageError(
                f"{self.display} was split for {self.runtime} but the server is {runtime}; the two "
                f"place embed_tokens and the vision tower differently: re-split with "
                f"qwen35-reshard --runtime {runtime} --pp {pp_size}"
            )
        if (pp_size, start_layer, end_layer) == (self.pp, self.start_layer, self.end_layer):
            return
        if pp_size == self.pp:
            fix = f"launch the server with {self.launch_env}"
        else:
            flag = runtime_of(self.runtime).pp_flag
            fix = (
                f"launch the server with {flag} {self.pp} and {self.launch_env}, or re-split "
                f"with qwen35-reshard --pp {pp_size} --runtime {self.runtime}"
            )
        raise StageError(f"stage {self.display} was built for {mine} but the server expects {theirs}: {fix}")

    def iter_weights(self, device: str = "cpu", verify: bool | None = None) -> Iterator[tuple[str, object]]:
        """Yield ``(name, torch.Tensor)`` for exactly this stage's tensors, one at a time, every
        byte checked against the digest the stage records while it is loaded.

        Tensors come in file and offset order, each a view of the file's copy-on-write memory
        map (what ``safe_open(file, framework="pt")`` gives; see :func:`_mapped`) until the caller
        copies it, moved to ``device`` when that is not the CPU. Before a file is read, its size
        and header bytes are checked to be those validated by :func:`open_stage`, so every
        tensor has the manifest's dtype, shape and place.

        The check: each tensor's bytes are hashed through the same map before it is handed
        over (:class:`~.stage.digestpool.DigestPool`; ahead of the reader in threads where the
        copy's torch threads leave cores and the node's budget allows, else in this thread),
        and compared with its digest in the manifest (xxh3-128; sha256 in a stage written
        before ``stage-v2``; or, where the stage records only its file's, the whole file's
        sha256). Each file is hashed once per node: where another loader of the node (another
        worker of the same server) checked the very same file moments ago, or is checking it
        now, its verdict is used (``stage.nodechecks`` says when that is trusted), and the last
        tensor is handed over only once that verdict is in: a damaged byte stops the iteration
        with :class:`~.errors.DamagedStage` before the caller's load can finish, even one that
        stops after ``len(stage)`` tensors (``zip(stage.names, ...)``) and never asks for more.
        Tensors the split shared with the source record no digest: loaded unchecked, said in
        the log (``verify --source`` proves those).

        Args:
            device: where the tensors go (``"cpu"``: views of the files, no copy).
            verify: check the bytes; None (the default): unless ``QWEN35_RESHARD_VERIFY_LOAD=0``
                asks not to (for those who check elsewhere), which is logged.

        Returns:
            An iterator of ``(name, tensor)`` in load order.

        Raises:
            StageError: torch is missing or lacks a dtype of the stage, or a file changed while
                loading; DamagedStage: bytes that do not match their digest, naming the tensor
                and the file.

        Example:
            >>> from qwen35_reshard import open_stage, reshard
            >>> _ = reshard(MODEL, OUT, pp=2)
            >>> weights = dict(open_stage(OUT, pp_rank=1).iter_weights())
            >>> len(weights) > 0
            True
        """
        try:
            import torch
        except ModuleNotFoundError as e:
            raise StageError(
                f"iter_weights needs {e.name}, which is not installed: pip install {e.name} (torch from "
                "https://download.pytorch.org/whl/cpu for the CPU build; see docs/install.md)"
            ) from e

        if sys.byteorder != "little":
            raise StageError("safetensors data is little-endian; this loader needs a little-endian host")
        dtypes = {}
        for dtype in {t.dtype for t in self.tensors.values()}:
            dt = getattr(torch, DTYPES[dtype][1], None)
            if dt is None:
                t = next(t for t in self.tensors.values() if t.dtype == dtype)
                raise StageError(
                    f"{self.display}: tensor {t.name!r} is {t.dtype}, which this torch "
                    f"({torch.__version__}) has no dtype for; upgrade torch"
                )
            dtypes[dtype] = dt

        by_file: dict[str, list[StageTensor]] = {}
        for t in self.tensors.values():
            by_file.setdefault(t.file, []).append(t)
        checked = load_checked() if verify is None else verify
        ranges = {file: self._digest_ranges(file, by_file[file]) for file in self.files} if checked else {}
        if checked:
            self._say_unchecked(by_file, ranges)
        elif verify is None:
            said = "qwen35-reshard: %s: loaded without checking its bytes' digests (%s=0)"
            log.warning(said, self.display, VERIFY_LOAD_ENV)
        move = torch.device(device).type != "cpu"
        # Checked in full before it is handed out: a caller that knows the count never resumes us.
        final = by_file[self.files[-1]][-1] if self.files else None
        # The caller's copy runs torch's threads: hashing threads only on the cores they leave.
        copying = copy_threads(torch)
        with LoadCheck(ranges, NodeChecks.open(), copying) if checked else nullcontext() as check:
            for file in self.files:
                path = self.path / file
                where = f"{self.display}/{file}"
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as e:
                    raise StageError(f"{where}: cannot open ({e.strerror or e}); {self._advice(file)}") from e
                try:
                    private, storage = _mapped(torch, fd, self.manifest.files[file], self.headers[file])
                    if check is not None:
                        check.feed(file, path, fd, self.manifest.files[file], private)
                        fd = None  # the check keeps it open, to tell whether the file changed
                except OSError as e:
                    raise StageError(f"{where}: cannot open ({e.strerror or e}); {self._advice(file)}") from e
                except _Changed as e:
                    raise self._changed(file, str(e)) from None
                finally:
                    if fd is not None:
                        os.close(fd)
                tensors = by_file[file]
                # A shard read in place (``in_place_stage``) also holds other stages' tensors.
                last = tensors[-1].offset + tensors[-1].nbytes
                with _Readahead(path, tensors[0].offset, last) as readahead:
                    for t in tensors:
                        readahead.through(t.offset + t.nbytes)
                        if check is not None:
                            try:
                                bad = check.finish() if t is final else check.reached(t.offset)
                            except FileChanged as e:
                                raise self._changed(e.path.name, "written to") from None
                            if bad:
                                raise self._damaged(bad[0])
                        tensor = _tensor_at(torch, storage, t.offset, dtypes[t.dtype], t.shape)
                        yield t.name, tensor.to(device) if move else tensor

    def _digest_ranges(self, file: str, tensors: list[StageTensor]) -> list[Range]:
        """What of ``file`` is hashed as it is loaded: each of its ``tensors`` against its
        recorded sha256; where some have none (blocks shared with the source when split, or a
        shard read in place), the whole file against the file's, if recorded; else nothing."""
        algorithm = self.manifest.digest
        digests = list(map(attrgetter(algorithm), tensors))  # StageTensor's field of that name
        if None not in digests:
            columns = (map(_NAME, tensors), map(_OFFSET, tensors), map(_NBYTES, tensors))
            return ranges_of(*columns, digests, algorithm)
        layout = self.manifest.layouts.get(file)
        if layout is not None and layout.sha256 is not None:  # the Hub's LFS sha256 of the shard
            return [Range(None, 0, self.manifest.files[file], layout.sha256, SHA256)]
        recorded = [t for t in tensors if t.digest is not None]
        return [Range(t.name, t.offset, t.nbytes, t.digest, algorithm) for t in recorded]

    def _say_unchecked(self, by_file: dict[str, list[StageTensor]], ranges: dict[str, list[Range]]) -> None:
        """Log how many tensors no sha256 is recorded for (neither theirs nor their file's), if any."""
        unchecked = [
            t
            for file, tensors in by_file.items()
            if len(ranges[file]) < len(tensors) and not (ranges[file] and ranges[file][0].key is None)
            for t in tensors
            if t.digest is None
        ]
        if unchecked:
            why = self.unrecorded or "their blocks were shared with the source when split"
            size = format_bytes(sum(t.nbytes for t in unchecked))
            log.warning(
                "qwen35-reshard: %s: %s (%s) loaded unchecked: no digest is recorded for them (%s)",
                self.display, plural(len(unchecked), "tensor"), size, why,
            )  # fmt: skip

    def _advice(self, file: str) -> str:
        """What to do about ``file`` that cannot be loaded: the stage's ``on_damaged`` (never to
        delete a checkpoint's own file read in place), else rebuild the stage."""
        return self.on_damaged(file) if self.on_damaged is not None else REBUILD

    def _changed(self, file: str, what: str) -> StageError:
        """The error for data ``file`` found ``what`` (changed) while loading."""
        return StageError(
            f"{self.display}/{file}: {what}, not what it was when the stage was opened; the stage "
            f"changed while loading: {self._advice(file)}"
        )

    def _damaged(self, found: Mismatch) -> DamagedStage:
        """The error for the first mismatch found; the stage's ``on_damaged`` says what to do."""
        file = found.path.name
        where = f"{self.files_at or self.display}/{file}"
        if found.key is not None:
            what = tensor_digest_finding(where, file, found.key, self.manifest.digest).message
        else:
            recorded = self.manifest.layouts[file].sha256
            what = (
                f"{where}: its bytes do not match the sha256 {recorded[:12]}... recorded for the whole "
                "file; the file is damaged"
            )
        advice = self.on_damaged(file) if self.on_damaged is not None else REPAIR
        return DamagedStage(f"{what}: {advice}", str(found.path), found.key)


def load_checked(env: Mapping[str, str] | None = None) -> bool:
    """Whether a load checks its bytes: unless ``QWEN35_RESHARD_VERIFY_LOAD`` is 0 (or false,
    no, off), for those who check the files elsewhere.

    Args:
        env: the environment (default ``os.environ``).

    Returns:
        False when the variable turns the check off.

    Example:
        >>> load_checked({"QWEN35_RESHARD_VERIFY_LOAD": "0"}), load_checked({})
        (False, True)
    """
    value = (os.environ if env is None else env).get(VERIFY_LOAD_ENV, "")
    return value.strip().lower() not in ("0", "false", "no", "off")


def _no_stage_dir(root: Path, given: str, pp_rank: int) -> str:
    """What to say when ``root`` has no ``pp{pp_rank}``: outside the split, or not built yet."""
    if not root.is_dir():
        return f"{given} is not a directory; pass the run directory OUT or a stage directory OUT/pp<rank>"
    run = read_run_record(root, given)
    pp = run.identity.pp if isinstance(run, RunRecord) else None
    if pp is not None and pp_rank >= pp:
        return (
            f"pp_rank {pp_rank} is outside the split in {given}: it has {pp} stages (pp0..pp{pp - 1}); "
            f"the server's pipeline size must be {pp}, or split again with --pp {pp_rank + 1} or more"
        )
    return (
        f"{given} has no pp{pp_rank}/: run qwen35-reshard --rank {pp_rank} (or without --rank) to "
        f"build stage {pp_rank} there, or pass that stage's directory"
    )


def is_split(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a split's run directory or one of its stage directories."""
    p = Path(path)
    return any((p / name).is_file() for name in (RUN_MANIFEST, STAGE_MANIFEST)) or (
        p / stage_dirname(0)
    ).is_dir()


def open_stage(path: str | os.PathLike[str], pp_rank: int | None = None) -> Stage:
    """Open and validate a stage directory: what a server's loader reads its weights through.

    Args:
        path: a stage directory (``OUT/pp2``), or the run directory ``OUT`` with ``pp_rank``.
        pp_rank: the server's pipeline rank, checked against the stage's.

    Returns:
        The :class:`Stage`: its manifest's facts (rank, layers, partition); its tensors are
        read only when iterated (``iter_weights``).

    Raises:
        StageError: a missing or interrupted stage, files that do not match the manifest, or a
            stage that belongs to another split; each says what to do.

    Example:
        >>> from qwen35_reshard import open_stage, reshard
        >>> _ = reshard(MODEL, OUT, pp=2)
        >>> stage = open_stage(OUT, pp_rank=1)
        >>> stage.rank, stage.start_layer, stage.end_layer
        (1, 4, 8)
    """
    given = os.fspath(path)
    root = Path(given)
    if pp_rank is not None:
        if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or pp_rank < 0:
            raise StageError(f"pp_rank must be a non-negative integer, got {pp_rank!r}")
        sub = root / stage_dirname(pp_rank)
        if sub.is_dir():
            root, display = sub, os.path.join(given, stage_dirname(pp_rank))
        elif (root / STAGE_MANIFEST).exists():
            display = given  # a stage directory passed together with its rank
        else:
            raise StageError(_no_stage_dir(root, given, pp_rank))
    else:
        display = given
        if not root.is_dir():
            raise StageError(f"{given}: not a directory; pass a stage directory such as OUT/pp0")
        if not (root / STAGE_MANIFEST).exists() and not (root / INDEX_NAME).exists():
            stages = sorted(
                (p.name for p in root.iterdir() if stage_dir_rank(p) is not None and p.is_dir()),
                key=lambda n: int(n[2:]),
            )
            if stages or (root / RUN_MANIFEST).exists():
                listed = f" (it holds {', '.join(stages)})" if stages else ""
                raise StageError(
                    f"{given} is a run directory{listed}: pass pp_rank=... or open "
                    f"{os.path.join(given, 'pp<rank>')}"
                )

    run = read_run_record(root.parent, str(root.parent)) if stage_dir_rank(root) is not None else None
    if isinstance(run, Finding):
        raise StageError(run.text)
    with collector_paused():
        found = read_stage(root, display, run)
    m = found.manifest
    if m is not None and pp_rank is not None and m.rank != pp_rank:
        raise StageError(
            f"{display} holds stage {m.rank}, not stage {pp_rank}: it belongs to another "
            f"split or was copied to the wrong place; {REBUILD}"
        )
    if found.problems:
        raise StageError(found.problems[0].text)
    return Stage(path=root, display=display, manifest=m, headers={f: h.raw for f, h in found.headers.items()})


_NAME, _OFFSET, _NBYTES = attrgetter("name"), attrgetter("offset"), attrgetter("nbytes")
