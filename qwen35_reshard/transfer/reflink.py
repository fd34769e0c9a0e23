"""Block sharing (reflinks): make an output file share the source's blocks instead of copying them.

On XFS, Btrfs, OCFS2 (and bcachefs, ZFS 2.3, NFS 4.2 servers that clone) two files can point
at the same disk blocks, copy-on-write. ``FICLONE`` makes a whole file share another's blocks;
``FICLONERANGE`` shares a range, which the kernel allows only when the source offset, the
destination offset and the length are multiples of the filesystem's block size (a length may
end ragged at the source's end of file). Neither reads nor writes the data, so a split that
shares its bytes costs metadata only.

These are the ioctls ``cp --reflink`` uses. They are used explicitly (rather than through
``copy_file_range``, which may share or copy at the kernel's choice) so that the tool knows
exactly which bytes it shared, and so which bytes it never read: the manifests and the
summary say so. Every refusal that means "these two files cannot share blocks" (another
filesystem, a filesystem without reflinks, an unaligned range) returns False; the caller
copies instead, or stops when sharing was required.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

# linux/fs.h: _IOW(0x94, 9, int) and _IOW(0x94, 13, struct file_clone_range).
FICLONE = 0x40049409
FICLONERANGE = 0x4020940D
# Refusals that mean "no sharing between these two files", not a failed write: no reflinks
# on this filesystem (EOPNOTSUPP, ENOTTY, ENOSYS), two filesystems (EXDEV), an unaligned or
# otherwise unshareable range (EINVAL), an immutable or swap file (EPERM, ETXTBSY).
_NO_SHARING = {
    errno.EOPNOTSUPP,
    errno.ENOTSUP,
    errno.EXDEV,
    errno.EINVAL,
    errno.ENOTTY,
    errno.ENOSYS,
    errno.EPERM,
    errno.ETXTBSY,
}
# The name the probe's temporary file in OUT stands for: a run killed while probing leaves it.
PROBE_NAME = "reflink-probe"


def clone_file(src_fd: int, dst_fd: int) -> bool:
    """Make ``dst_fd`` share every block of ``src_fd`` (same size, same bytes); False if refused."""
    return _share(dst_fd, FICLONE, src_fd)


def clone_range(src_fd: int, src_offset: int, length: int, dst_fd: int, dst_offset: int) -> bool:
    """Share ``length`` bytes of ``src_fd`` at ``src_offset`` into ``dst_fd`` at ``dst_offset``.

    All three must be multiples of the block size (see :func:`block_size`), the length except
    at the source's end of file. False if the filesystem refuses.
    """
    return _share(dst_fd, FICLONERANGE, struct.pack("<qQQQ", src_fd, src_offset, length, dst_offset))


def _share(dst_fd: int, request: int, arg: int | bytes) -> bool:
    """Run a sharing ioctl on ``dst_fd``: True when done, False when the filesystem refuses."""
    try:
        fcntl.ioctl(dst_fd, request, arg)
    except OSError as e:
        if e.errno in _NO_SHARING:
            return False
        raise
    return True


def block_size(fd: int) -> int:
    """The granularity at which the filesystem of ``fd`` shares blocks (its block size)."""
    return os.fstatvfs(fd).f_bsize


def probe(src_path: str | os.PathLike[str], tmp: str | os.PathLike[str]) -> bool:
    """True when files beside ``tmp`` can share blocks with the file ``src_path``.

    Shares the source's first block (or the whole file, if smaller) into the temporary file
    ``tmp`` (a name of the caller's own), which is removed again.
    """
    src = os.open(src_path, os.O_RDONLY)
    try:
        dst = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            size = os.fstat(src).st_size
            return size > 0 and clone_range(src, 0, min(size, block_size(dst)), dst, 0)
        finally:
            os.close(dst)
            os.unlink(tmp)
    finally:
        os.close(src)
