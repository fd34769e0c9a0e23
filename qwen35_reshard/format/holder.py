"""The record in a lock or claim (see write/claims.py): which run holds it, and proving that
run gone. The writer breaks what a gone run held; a reader (``verify``) tells a gone run's
leftover from what a live run holds, by the same rules, without writing anything.

A holder is gone when that is proven: on this host (same hostname, boot and pid namespace),
when its pid no longer runs the process that started at the recorded time; on another host,
when the file's modification time, which its holder refreshes every few seconds, is
:data:`LEASE_SECONDS` older than a file just touched on the same file server.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..errors import JSON_ERRORS
from .names import process_token

# A holder on another host is gone once its files went this long unrefreshed: many heartbeats,
# so that a busy file server or a slow client does not make a live run look gone.
LEASE_SECONDS = 60.0


@dataclass(frozen=True)
class Owner:
    """A run (one process on one host), as its lock and claims record it."""

    host: str  # hostname, for people
    machine: str  # hostname, boot id and pid namespace: where ``pid`` means this process
    pid: int
    start: str  # the process's start time on its machine (``/proc/PID/stat``), against pid reuse
    token: str  # unique to this process: in every temporary name it writes

    def describe(self) -> str:
        """``host NAME, pid N``: how messages name the run."""
        return f"host {self.host}, pid {self.pid}"

    def to_bytes(self) -> bytes:
        """The record written into a lock or claim."""
        return (json.dumps(self.__dict__, sort_keys=True) + "\n").encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Owner | None:
        """The owner recorded as ``raw``; None when it is not a well-formed record."""
        try:
            obj = json.loads(raw)
            return cls(**obj) if isinstance(obj, dict) else None
        except (*JSON_ERRORS, TypeError):
            return None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _start_time(pid: int) -> str | None:
    """Process ``pid``'s start time (clock ticks since boot), or None when it is not running.
    Without /proc (not Linux), "" for any running process: pid reuse goes unseen there."""
    if not os.path.exists("/proc/self/stat"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # runs, as another user
        return ""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return None
    fields = stat.rsplit(")", 1)[-1].split()  # after "(comm)", which may hold spaces
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie has ended


@cache
def _me(pid: int) -> Owner:
    host = socket.gethostname()
    machine = f"{host}/{_read('/proc/sys/kernel/random/boot_id')}/{_ns()}"
    return Owner(host, machine, pid, _start_time(pid) or "", process_token())


def _ns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def me() -> Owner:
    """This process as an :class:`Owner` (a forked child is another)."""
    return _me(os.getpid())


def exited(holder: Owner) -> bool:
    """Whether the process ``holder`` of this machine no longer runs (its pid runs none, or
    another process: one started at another time)."""
    return holder.start != _start_time(holder.pid)


def gone(holder: Owner | None, mtime_ns: int, now_ns: int) -> bool:
    """Whether the holder of a file last refreshed at ``mtime_ns`` is proven gone; ``now_ns``:
    the modification time of a file this run just touched (the same server clock)."""
    if holder is not None and holder.machine == me().machine:
        return exited(holder)
    return now_ns - mtime_ns > LEASE_SECONDS * 1e9  # another host (or a record torn by a crash)


def left_by_gone_run(path: Path) -> bool:
    """Whether the lock or claim ``path`` is held by a run proven gone, judged without writing
    anything (as ``verify`` must): a process of this machine that no longer runs. Another
    host's run is judged by a lease on the file server's clock, which only a file written now
    can read; a torn record, by that lease alone: neither is proven gone here.
    """
    holder, raw, _ = read_holder(path)
    return raw is not None and holder is not None and holder.machine == me().machine and exited(holder)


def read_holder(path: Path) -> tuple[Owner | None, bytes | None, int]:
    """Who holds ``path`` (its record and modification time); raw None when it is not there.

    Opened, then read: on NFS, opening revalidates the attributes and data cached (close-to-open
    consistency), so the record and time are the server's, not a stale copy."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
            mtime = os.fstat(f.fileno()).st_mtime_ns
    except FileNotFoundError:
        return None, None, 0
    return Owner.from_bytes(raw), raw, mtime
