"""Runs sharing one OUT: its lock and stage claims.

Several runs may write one OUT at once: one per node building its own stage into storage the
nodes share, several stages built side by side on one machine, or the same command twice.
What keeps them apart uses only what every filesystem does atomically, NFS included: creating
a name that must not exist yet (``link``) and ``rename``. No ``flock``/``fcntl`` lock: across
NFS clients those need a lock manager and its lease recovery, often absent or off on shared
storage, and a lock that silently does not exclude is worse than none.

- ``OUT/.reshard-lock`` (:data:`LOCK`) is held for the short steps that decide or record what
  OUT holds: what a run does there, the run marker, OUT's own files and ``reshard.json``. Those
  are decided by one run at a time, and OUT's temporary files are written only under it.
- ``OUT/ppN/.reshard-claim`` (:data:`CLAIM`), taken under the lock, is held while a run builds
  stage N; a run that wants the same stage waits, then finds it complete. A stage directory's
  temporary files are written only by its claimant.

Both record their holder (:class:`~..format.holder.Owner`). A holder is gone when that is
proven (:func:`~..format.holder.gone`): on this host, when its process no longer runs; on
another host, when the file's modification time, which its holder refreshes every
:data:`HEARTBEAT_SECONDS`, is :data:`LEASE_SECONDS` older than a file this run has just
touched. Both times are set by the file server's clock, so no two hosts' clocks are compared.
A run stopped for longer than the lease on another host is taken as gone: the price of not
needing a lock manager.
"""

from __future__ import annotations

import atexit
import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..format.holder import LEASE_SECONDS, Owner, gone, left_by_gone_run, me, read_holder
from ..format.names import (
    CLAIM,
    GONE_SUFFIX,
    IN_USE,
    LAST_USED,
    LOCK,
    PARTIAL_SUFFIX,
    partial_base,
    partial_name,
)

HEARTBEAT_SECONDS = 5.0  # a holder refreshes its files' modification time this often (< LEASE_SECONDS)
POLL_SECONDS = (0.01, 0.5)  # waiting for a holder: first and longest pause between looks
_NO_LINKS = (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP)  # link() refused by the filesystem


def temp_name(name: str) -> str:
    """The temporary name this process writes ``name`` under: unique to it, so that no two
    runs (on any hosts sharing OUT) ever write, rename or delete each other's temporaries."""
    return partial_name(name, me().token)


def is_mine(name: str) -> bool:
    """Whether the temporary file ``name`` was written by this process."""
    return name.endswith(f".{me().token}{PARTIAL_SUFFIX}")


# --------------------------------------------------------------------------- holding files

_held: set[Path] = set()
_held_lock = threading.Lock()
_beating: list[threading.Thread] = []


def _heartbeat() -> None:
    """Refresh the modification time of every file held, until none is (see :func:`gone`)."""
    while True:
        time.sleep(HEARTBEAT_SECONDS)
        with _held_lock:
            if not _held:
                _beating.clear()
                return
            held = list(_held)
        for path in held:
            try:
                os.utime(path)  # no times given: NFS sets the server's own (SET_TO_SERVER_TIME)
            except OSError:
                pass


def _hold(path: Path) -> None:
    with _held_lock:
        _held.add(path)
        if not _beating:
            beat = threading.Thread(target=_heartbeat, name="qwen35-reshard-heartbeat", daemon=True)
            _beating.append(beat)
            beat.start()


@dataclass(frozen=True)
class Held:
    """Someone else holds the file: who (None when its record is unreadable)."""

    owner: Owner | None


def try_take(path: Path) -> Held | None:
    """Create ``path`` recording this process, unless a live holder has it (then returns who).

    A gone holder's file is broken and taken. The record is written under a temporary name
    first and linked into place, so that a crash never leaves a torn record under ``path``.
    """
    mine = me().to_bytes()
    cand = path.with_name(temp_name(path.name))
    try:
        for _ in range(3):
            with open(cand, "wb") as f:
                f.write(mine)
            try:
                os.utime(cand)  # the server's "now", for judging another host's file below
                now = os.stat(cand).st_mtime_ns
            except FileNotFoundError:  # removed by a run clearing temporaries: write it again
                continue
            try:
                os.link(cand, path)
                _hold(path)
                return None
            except FileExistsError:
                pass
            except FileNotFoundError:  # removed by a run clearing temporaries: write it again
                continue
            except OSError as e:
                if e.errno in _NO_LINKS:
                    return _take_exclusive(path, mine, now)
                # NFS: a retransmitted LINK whose first reply was lost fails although it was done.
                if os.stat(cand).st_nlink != 2:
                    raise
                _hold(path)
                return None
            holder, raw, mtime = read_holder(path)
            if raw is None:
                continue  # released meanwhile
            if not gone(holder, mtime, now):
                return Held(holder)
            _break(path, raw)
        return Held(None)
    finally:
        _remove(cand)


def _take_exclusive(path: Path, mine: bytes, now_ns: int) -> Held | None:
    """``try_take`` where the filesystem has no hard links (some FUSE and SMB mounts): an
    exclusive create, whose record a crash may leave torn (then judged by its age alone)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        holder, raw, mtime = read_holder(path)
        if raw is not None and gone(holder, mtime, now_ns):
            _break(path, raw)
        return Held(holder)
    with os.fdopen(fd, "wb") as f:
        f.write(mine)
    _hold(path)
    return None


def _break(path: Path, raw: bytes) -> None:
    """Remove ``path``, held by a gone run whose record is ``raw``.

    Moved aside under a name of this process's first, then checked: when two runs break the
    same file at once and a third takes it in between, the one that moved the third's away
    puts it back.
    """
    aside = path.with_name(temp_name(path.name + GONE_SUFFIX))
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return  # broken by another run
    try:
        if aside.read_bytes() != raw:
            try:
                os.link(aside, path)
            except FileExistsError:
                pass
    except FileNotFoundError:
        pass  # cleared meanwhile by the run that took the lock since
    finally:
        _remove(aside)


def release(path: Path) -> None:
    """Give up ``path`` if this process still holds it."""
    with _held_lock:
        _held.discard(path)
    _, raw, _ = read_holder(path)
    if raw == me().to_bytes():
        _remove(path)


@dataclass(frozen=True)
class Holding:
    """Who holds a lock or claim file besides this process: nobody (``held`` false: absent,
    ours, or its holder gone), or a live run, ``owner`` (None: its record is unreadable)."""

    held: bool
    owner: Owner | None = None

    def describe(self) -> str:
        """How a message names the holder."""
        return describe(self.owner)


def holder_of(path: Path, now_ns: int) -> Holding:
    """Who holds ``path`` besides this process, as of ``now_ns``."""
    holder, raw, mtime = read_holder(path)
    if raw is None or raw == me().to_bytes() or gone(holder, mtime, now_ns):
        return Holding(False)
    return Holding(True, holder)


def gone_file(path: Path, now_ns: int) -> bool:
    """Whether the run whose record ``path`` is (a lock or claim, or one being taken) is gone."""
    holder, raw, mtime = read_holder(path)
    return raw is not None and gone(holder, mtime, now_ns)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


@contextmanager
def locked(out: Path, on_wait: Callable[[str], None]) -> Iterator[int]:
    """Hold OUT's lock; yields the server's time at which it was taken (for :func:`gone`).

    Waits for a live holder (``on_wait(message)`` once), and breaks the lock of a gone one.
    """
    lock = out / LOCK
    waited = 0
    while (held := try_take(lock)) is not None:
        if not waited:
            who = describe(held.owner)
            on_wait(f"{out} is being changed by another qwen35-reshard run ({who}): waiting for it")
        time.sleep(pause(waited))
        waited += 1
    try:
        yield os.stat(lock).st_mtime_ns
    finally:
        release(lock)


def wait_for_change(paths: list[Path]) -> None:
    """Wait until one of the held files ``paths`` is released or changes hands, or its holder
    is a process of this host that no longer runs (proven at once: only another host's holder
    needs the lease), or a lease has half run out (another host's holder may be gone by then:
    only OUT's lock can tell).

    Looks only at the files themselves (and this host's process table): a waiting run does not
    take OUT's lock (or read a stage's manifest) every moment, for the hours another node may
    take to build its stage.
    """
    seen = [read_holder(p)[1] for p in paths]
    deadline = time.monotonic() + LEASE_SECONDS / 2
    waited = 0
    while time.monotonic() < deadline and [read_holder(p)[1] for p in paths] == seen:
        if any(left_by_gone_run(p) for p in paths):
            return
        time.sleep(pause(waited))
        waited += 1


def pause(waited: int) -> float:
    """Seconds to wait before looking again, after ``waited`` looks: short at first, then longer."""
    return min(POLL_SECONDS[0] * 2**waited, POLL_SECONDS[1])


def describe(owner: Owner | None) -> str:
    """How a message names the run ``owner`` (which may be unknown)."""
    return owner.describe() if owner is not None else "unknown host and pid"


def lock_free(out: Path) -> bool:
    """Whether OUT's lock can be taken now: not held by a live run, on a filesystem that takes
    writes. Taken and given back at once: a finished split with nothing to do never waits
    (a repair may hold the lock for long) or fails (a serving node's read-only volume) only
    to clear what a killed run left."""
    try:
        held = try_take(out / LOCK)
    except OSError as e:
        if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return False
        raise
    if held is None:
        release(out / LOCK)
    return held is None


# --------------------------------------------------------------------------- a server's stage in use


def in_use(stage_dir: Path) -> None:
    """Record that this process (a server) uses the finished stage in ``stage_dir`` (of the
    stage cache), until it exits: ``IN_USE`` plus its token, holding its :class:`Owner`,
    refreshed as claims are (:data:`HEARTBEAT_SECONDS`, for a reader on another host) and
    removed at exit; and ``LAST_USED`` touched (what ``qwen35-reshard cache`` says and prunes by).

    A record left by a killed server is judged as a claim is (:func:`users`): gone.

    Args:
        stage_dir: the stage directory.

    Raises:
        OSError: the records cannot be written (a read-only cache).
    """
    path = stage_dir / f"{IN_USE}{me().token}"
    cand = path.with_name(temp_name(path.name))
    cand.write_bytes(me().to_bytes())
    os.replace(cand, path)
    _hold(path)
    atexit.register(release, path)
    (stage_dir / LAST_USED).touch()


def users(stage_dir: Path, now_ns: int) -> list[Owner | None]:
    """The live processes that record using the stage in ``stage_dir`` (:func:`in_use`), or
    build it (its claim), as of ``now_ns`` (see :func:`~..format.holder.gone`); None for a
    record that cannot be read (a live holder is assumed). Reads only."""
    found = []
    for p in sorted(stage_dir.glob(f"{IN_USE}*")) + [stage_dir / CLAIM]:
        if partial_base(p.name) is not None:
            continue
        holding = holder_of(p, now_ns)
        if holding.held:
            found.append(holding.owner)
    return found
