"""The check a load makes of the bytes it hands the server, shared across the node's loaders.

:class:`LoadCheck` is what ``Stage.iter_weights`` drives: each data file, once the loader has
opened and mapped it, is hashed through the loader's own map as the load goes, each range
before it is handed on (``stage.digestpool``), unless another loader on the node checked it
already or is checking it now (``stage.nodechecks``: a record keyed by the file's identity
and what it must hash to). Before the last tensor is handed over, every file is known good:
hashed here, or recorded good by the loader that hashed it, and still the file it was (its
identity unchanged since it was opened).

**Threads.** A copy into CPU tensors runs on torch's intra-op threads, every core by default;
a hashing thread beside them only takes turns with them (on 2 cores, the 0.56 GB stage loaded
at 0.5x of ``safe_open`` with one, 0.7x with the hashing in the reader's thread between
copies: ``python -m benchmarks loader``). So a loader takes hashing threads only on the cores
torch leaves (:func:`copy_threads`: all of them where the server's copy goes to a GPU; a server
that sets ``OMP_NUM_THREADS=1`` per worker, as vLLM's workers do, leaves the rest), at most
:data:`~..stage.nodechecks.WORKER_THREADS`, within the node's budget.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

from ..format.digest import XXH128, hexdigest
from ..stage.digestpool import DigestPool, Mismatch, Range, cores
from ..stage.nodechecks import MINE, OTHERS, WORKER_THREADS, Claim, NodeChecks, identity


class FileChanged(Exception):
    """A data file was written to while it was loaded: its bytes are not the ones checked."""

    def __init__(self, path: Path) -> None:
        super().__init__(str(path))
        self.path = path


def copy_threads(torch: object) -> int:
    """The threads the caller's copy of each tensor runs on: none of the CPU's intra-op threads
    where CUDA is initialized (a server whose parameters are on a GPU copies host to device, one
    transfer per tensor), else torch's intra-op threads (``torch.get_num_threads()``).

    Example:
        >>> import torch
        >>> copy_threads(torch) == (0 if torch.cuda.is_initialized() else torch.get_num_threads())
        True
    """
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return 0
    return torch.get_num_threads()


class LoadCheck:
    """Checks the ranges of each data file a load goes through, each byte once per node.

    Call :meth:`feed` for every file in load order, ``reached(offset)`` as the reader goes
    (:meth:`DigestPool.reached <..stage.digestpool.DigestPool.reached>`: mismatches found since
    the last call) and :meth:`finish` before the last tensor; a context manager (releases threads, locks and
    descriptors).
    """

    def __init__(self, ranges: dict[str, list[Range]], node: NodeChecks | None, copying: int = 0) -> None:
        """``ranges``: what to hash of each data file, by file name; ``node``: the node's
        record, None to hash every range here; ``copying``: the threads the caller's copy runs
        on (:func:`copy_threads`), whose cores are not the check's."""
        self._ranges = ranges
        want = max(0, min(cores() - copying, WORKER_THREADS))
        try:
            threads = node.take_threads(want) if node is not None else want
        except OSError:  # a record directory that refuses locks (not the node's memory): on our own
            node.close()
            node, threads = None, want
        self._node = node
        self._pool = DigestPool(threads)
        self.reached = self._pool.reached  # called once per tensor: no call of its own in between
        # file name -> (path, fd, size, identity when opened, claim or None)
        self._files: dict[str, tuple[Path, int, int, tuple, Claim | None]] = {}

    def feed(self, file: str, path: Path, fd: int, size: int, mapped: mmap.mmap) -> None:
        """The reader opened data ``file`` at ``path`` as ``fd`` (kept open until :meth:`close`),
        mapped it as ``mapped`` (whose views it hands on) and goes through it next."""
        ranges = self._ranges[file]
        try:
            claim = self._node.claim(fd, _expected(ranges)) if self._node is not None and ranges else None
        except OSError:  # the record cannot be used for this file: checked here
            claim = None
        self._files[file] = (path, fd, size, identity(fd), claim)
        mine = claim is None or claim.state == MINE
        self._pool.feed(path, fd, ranges if mine else [], size, mapped)

    def finish(self) -> list[Mismatch]:
        """Every range checked, here or by another loader of the node: the mismatches.

        Records this loader's good files for the others first, then waits for the files
        others check (this loader's locks are released by then: two loaders each waiting for
        the other's file cannot both wait); a file nobody recorded good is hashed here.

        Raises:
            FileChanged: a file's identity moved since it was opened (written to meanwhile).
        """
        bad = self._pool.finish()
        if bad:
            return bad
        for path, fd, _, opened, claim in self._files.values():
            if identity(fd) != opened:
                raise FileChanged(path)
            if claim is not None and claim.state == MINE:
                claim.record(opened)
        for file, (path, fd, size, opened, claim) in self._files.items():
            if claim is None or claim.state != OTHERS or claim.wait():
                continue
            self._pool.feed(path, fd, self._ranges[file], size)  # the checker found it damaged, or died
            bad = self._pool.finish()
            if bad:
                return bad
            if identity(fd) != opened:
                raise FileChanged(path)
            claim.record(opened)
        return []

    def __enter__(self) -> LoadCheck:
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool.__exit__(*exc)
        for _, fd, _, _, claim in self._files.values():
            if claim is not None:
                claim.release()
            os.close(fd)
        self._files.clear()
        if self._node is not None:
            self._node.close()


def _expected(ranges: list[Range]) -> str:
    """What a file's check compares it with, in one short string: the digest of its ranges'
    offsets, sizes, digests and algorithms (a file read in place by two stages is checked
    against other ranges by each)."""
    columns = ([r.offset for r in ranges], [r.nbytes for r in ranges], [r.digest for r in ranges])
    text = "|".join(",".join(map(str, c)) for c in columns) + "|" + ranges[0].algorithm
    return hexdigest(XXH128, text.encode())
