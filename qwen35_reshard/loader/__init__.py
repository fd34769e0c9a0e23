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
order, through safetensors' own memory-mapped reader; never pickle.

torch and safetensors are imported only inside ``iter_weights``: the package stays importable
without them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ReshardError
from ..format.dtypes import DTYPES
from ..format.names import INDEX_NAME, RUN_MANIFEST, STAGE_MANIFEST, stage_dir_rank, stage_dirname
from ..model.runtimes import launch_env
from ..stage.findings import REBUILD, Finding
from ..stage.manifest import StageManifest, StageTensor
from ..stage.reader import read_run_record, read_stage

# Device types safe_open(device=...) places tensors on by itself.
SAFETENSORS_DEVICES = ("cpu", "cuda", "mps", "npu", "xpu", "hpu", "mlu", "musa")


class StageError(ReshardError):
    """A stage directory that must not be loaded, with what to do about it in one line."""


@dataclass
class Stage:
    """A validated stage directory: its recorded facts (``manifest``) and where it is. Nothing
    is read until iterated."""

    path: Path
    display: str  # the path as the caller spelled it, for messages
    manifest: StageManifest = field(repr=False)  # tensors in load order: file, then offset

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
            flag = "--pp-size" if self.runtime == "sglang" else "--pipeline-parallel-size"
            fix = (
                f"launch the server with {flag} {self.pp} and {self.launch_env}, or re-split "
                f"with qwen35-reshard --pp {pp_size} --runtime {self.runtime}"
            )
        raise StageError(f"stage {self.display} was built for {mine} but the server expects {theirs}: {fix}")

    def iter_weights(self, device: str = "cpu", verify: bool = False) -> Iterator[tuple[str, object]]:
        """Yield ``(name, torch.Tensor)`` for exactly this stage's tensors, one at a time.

        Tensors come in file and offset order, read through safetensors' own reader
        (``safe_open(file, framework="pt", device=device)``): the file is memory-mapped, a tensor
        is a view of its bytes until the caller copies it, and a tensor for another device is
        placed there directly. Each tensor's dtype and shape are checked against the manifest.
        With ``verify=True`` its bytes are hashed and compared to the manifest's sha256 before it
        is yielded (read on the CPU, then moved to ``device``); that hashing is the only extra cost.
        Tensors the split shared with the source record no sha256 (``verify --source`` proves
        those).
        """
        try:
            import torch
            from safetensors import SafetensorError, safe_open
        except ModuleNotFoundError as e:
            raise StageError(
                f"iter_weights needs {e.name}, which is not installed: pip install {e.name} (torch from "
                "https://download.pytorch.org/whl/cpu for the CPU build; see the README's Install)"
            ) from e

        if sys.byteorder != "little":
            raise StageError("safetensors data is little-endian; this loader needs a little-endian host")
        dtypes = {}
        for t in self.tensors.values():
            if t.dtype not in dtypes:
                dt = getattr(torch, DTYPES[t.dtype][1], None)
                if dt is None:
                    raise StageError(
                        f"{self.display}: tensor {t.name!r} is {t.dtype}, which this torch "
                        f"({torch.__version__}) has no dtype for; upgrade torch"
                    )
                dtypes[t.dtype] = dt

        by_file: dict[str, list[StageTensor]] = {}
        for t in self.tensors.values():
            by_file.setdefault(t.file, []).append(t)
        # safetensors places tensors on these devices itself; others (e.g. "meta") get a CPU copy moved.
        direct = str(device) if torch.device(device).type in SAFETENSORS_DEVICES else "cpu"
        read_on = "cpu" if verify else direct
        for file in self.files:
            path = self.path / file
            where = f"{self.display}/{file}"
            try:
                # The file must still be the one validated at open time.
                size = os.stat(path).st_size
                if size != self.manifest.files[file]:
                    raise StageError(
                        f"{where}: is {size} bytes, not the {self.manifest.files[file]} bytes it had "
                        f"when the stage was opened; the stage changed while loading: {REBUILD}"
                    )
                handle = safe_open(path, framework="pt", device=read_on)
            except (OSError, SafetensorError) as e:
                raise StageError(f"{where}: cannot open ({e}); {REBUILD}") from e
            with handle as f, _Readahead(path) as readahead:
                for t in by_file[file]:
                    readahead.through(t.offset + t.nbytes)
                    tensor = f.get_tensor(t.name)
                    if tensor.dtype != dtypes[t.dtype] or tuple(tensor.shape) != t.shape:
                        raise StageError(
                            f"{where}: tensor {t.name!r} is {tensor.dtype} {tuple(tensor.shape)}, not the "
                            f"{t.dtype} {list(t.shape)} the stage was opened with; the stage changed "
                            f"while loading: {REBUILD}"
                        )
                    recorded = t.sha256 if verify else None  # None: shared, no digest recorded
                    if recorded is not None and hashlib.sha256(_bytes_of(tensor)).hexdigest() != recorded:
                        raise StageError(
                            f"{where}: tensor {t.name!r} does not match its sha256 in "
                            f"{STAGE_MANIFEST}; the file is damaged: {REBUILD}"
                        )
                    if read_on != str(device):
                        tensor = tensor.to(device)
                    yield t.name, tensor


class _Readahead:
    """Ask the kernel to read a file ahead of the tensors being copied out of its mapping.

    Page faults on a memory map read little at a time; requesting the next ``WINDOW`` bytes in
    advance (``posix_fadvise(WILLNEED)``, which starts the reads without waiting for them) lets
    the storage work while the caller copies the tensor before. A hint only: where it is not
    available, nothing changes.
    """

    WINDOW = 64 << 20

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY) if hasattr(os, "posix_fadvise") else None
        self.ahead = 0  # bytes of the file already requested

    def through(self, end: int) -> None:
        """Make sure the file is requested up to ``WINDOW`` bytes past ``end``."""
        if self.fd is not None and self.ahead < end + self.WINDOW:
            start, self.ahead = self.ahead, end + 2 * self.WINDOW
            os.posix_fadvise(self.fd, start, self.ahead - start, os.POSIX_FADV_WILLNEED)

    def __enter__(self) -> _Readahead:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)


def _bytes_of(tensor: object) -> memoryview | bytes:
    """The bytes of a contiguous CPU tensor, without a copy (and without numpy)."""
    n = tensor.numel() * tensor.element_size()
    if n == 0:
        return b""
    return memoryview((ctypes.c_ubyte * n).from_address(tensor.data_ptr())).cast("B")


def _no_stage_dir(root: Path, given: str, pp_rank: int) -> str:
    """What to say when ``root`` has no ``pp{pp_rank}``: outside the split, or not built yet."""
    if not root.is_dir():
        return f"{given} is not a directory; pass the run directory OUT or a stage directory OUT/pp<rank>"
    run = read_run_record(root, given)
    pp = run[1].pp if isinstance(run, tuple) else None
    if pp is not None and pp_rank >= pp:
        return (
            f"pp_rank {pp_rank} is outside the split in {given}: it has {pp} stages (pp0..pp{pp - 1}); "
            f"the server's pipeline size must be {pp}, or split again with --pp {pp_rank + 1} or more"
        )
    return (
        f"{given} has no pp{pp_rank}/: run qwen35-reshard --rank {pp_rank} (or without --rank) to "
        f"build stage {pp_rank} there, or pass that stage's directory"
    )


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
        raise StageError(run.message)
    found = read_stage(root, display, run)
    m = found.manifest
    if m is not None and pp_rank is not None and m.rank != pp_rank:
        raise StageError(
            f"{display} holds stage {m.rank}, not stage {pp_rank}: it belongs to another "
            f"split or was copied to the wrong place; {REBUILD}"
        )
    if found.problems:
        raise StageError(found.problems[0].message)
    return Stage(path=root, display=display, manifest=m)
