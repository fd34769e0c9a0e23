"""What a file name in a model or stage directory may be, and where its file may resolve."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def is_plain_name(name: str) -> bool:
    """Whether ``name`` names a file directly inside a directory (no path, no '..', no NUL,
    which os calls refuse with ValueError)."""
    return (
        bool(name) and "/" not in name and "\\" not in name and "\0" not in name and name not in (".", "..")
    )


def is_plain_safetensors_name(name: object) -> bool:
    """Whether ``name`` is a plain (see :func:`is_plain_name`), not hidden ``*.safetensors`` name."""
    return (
        isinstance(name, str)
        and is_plain_name(name)
        and name.endswith(".safetensors")
        and not name.startswith(".")
    )


def allowed_roots(root: Path) -> tuple[Path, ...]:
    """Real directories a file of the model directory ``root`` may resolve into.

    A Hugging Face cache snapshot (``models--x/snapshots/<rev>/``) holds symlinks into the
    repo's ``blobs/``; anything else must stay inside the directory itself.
    """
    real = root.resolve()
    roots = [real]
    if real.parent.name == "snapshots":
        roots.append(real.parent.parent / "blobs")
    return tuple(roots)


def checked_file(root: Path, name: str) -> Path:
    """``root/name``, to be read: a regular file that resolves inside ``root`` (see
    :func:`allowed_roots`). Raises FileNotFoundError when it is absent, and OSError saying why
    otherwise: a symlink out of the directory is not followed, and a FIFO or a device is not
    opened (reading one may block or never end)."""
    path = root / name
    st = os.stat(path)
    real = Path(os.path.realpath(path))
    if not any(real.is_relative_to(a) for a in allowed_roots(root)):
        raise OSError(errno.EACCES, f"a symlink to {real}, outside the directory: not followed")
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, "not a regular file")
    return path
