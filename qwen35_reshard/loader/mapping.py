"""A data file as the loader reads it: one copy-on-write memory map, tensors as views of it,
and read-ahead hints; the speed tricks of ``Stage.iter_weights``, each in a helper of its own."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path


class Changed(Exception):
    """A data file is no longer the one validated when the stage was opened."""


def mapped(torch: object, fd: int, size: int, header: bytes) -> tuple[mmap.mmap, object]:
    """The file open as ``fd`` as one copy-on-write memory map and a byte storage over it,
    once its size and header bytes are checked to be those validated when the stage was opened
    (``size`` bytes, ``header`` the JSON after the 8-byte length): every offset comes from that
    header.

    What safetensors' reader does for framework="pt" (``UntypedStorage.from_file``, shared=False:
    a private map), without its per-tensor cost: see :func:`tensor_at`. The map is made from the
    descriptor itself, so what is mapped is what was checked; it is returned too, for the load
    check to hash through (``stage.digestpool``: the copy then finds its pages already mapped).
    Raises OSError or Changed.
    """
    found = os.fstat(fd).st_size
    if found != size:
        raise Changed(f"is {found} bytes, not {size}")
    if os.pread(fd, 8 + len(header), 0) != struct.pack("<Q", len(header)) + header:
        raise Changed("has another header")
    try:
        private = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except ValueError as e:  # shorter than ``size`` since the fstat above
        raise Changed(f"is shorter than {size} bytes") from e
    # Never closed: the storage (and every view handed out) keeps the map, and with it mmap's
    # own duplicate of the descriptor, alive until the last view goes.
    return private, torch.frombuffer(private, dtype=torch.uint8).untyped_storage()


def tensor_at(torch: object, storage: object, offset: int, dtype: object, shape: tuple[int, ...]) -> object:
    """The tensor of ``dtype`` and ``shape`` whose bytes start at ``offset`` of ``storage``: a
    view, no copy.

    Why not ``safe_open(...).get_tensor``: it slices the storage, wraps the slice and views it
    as the dtype and then the shape, four calls back into torch per tensor, which cost more
    than copying a small tensor (a 397B FP8 stage has ~47,000 of them). ``set_`` makes the
    view in one call where the offset is a multiple of the item size (always in files this
    tool writes; safetensors' reference writer aligns them too); elsewhere the storage is
    sliced first, as safetensors does.
    """
    size = dtype.itemsize
    if offset % size:
        return torch.empty(0, dtype=dtype).set_(storage[offset:], 0, shape)
    return torch.empty(0, dtype=dtype).set_(storage, offset // size, shape)


class Readahead:
    """Ask the kernel to read a file ahead of the tensors being copied out of its mapping.

    Page faults on a memory map read little at a time; requesting the next ``WINDOW`` bytes in
    advance (``posix_fadvise(WILLNEED)``, which starts the reads without waiting for them) lets
    the storage work while the caller copies the tensor before. A hint only: where it is not
    available, nothing changes.
    """

    WINDOW = 64 << 20

    def __init__(self, path: Path, start: int, stop: int) -> None:
        """Read ahead within ``[start, stop)``, the bytes of the file's tensors being read."""
        self.fd = os.open(path, os.O_RDONLY) if hasattr(os, "posix_fadvise") else None
        self.ahead = start  # bytes of the file already requested
        self.stop = stop

    def through(self, end: int) -> None:
        """Make sure the file is requested up to ``WINDOW`` bytes past ``end``."""
        if self.fd is not None and self.ahead < min(end + self.WINDOW, self.stop):
            start, self.ahead = self.ahead, min(end + 2 * self.WINDOW, self.stop)
            os.posix_fadvise(self.fd, start, self.ahead - start, os.POSIX_FADV_WILLNEED)

    def __enter__(self) -> Readahead:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)
