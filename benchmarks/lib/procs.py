"""Measured child processes: wall and CPU time and the child's own peak RSS.

Why a launcher: Linux records, at ``exec``, the high-water mark of the memory the process had
before it into its ``ru_maxrss``. A child spawned straight from a large benchmark process (vfork
or fork) starts in the parent's memory, so its ``ru_maxrss`` reads at least the parent's peak
(benchmarks/rank_memory.py read 220 MB on every row this way). Each measured command is
therefore started by a small fresh interpreter (``_LAUNCHER``, ``python -S``) that spawns it and
reports its ``wait4`` rusage: the inherited part is then the launcher's own size
(``launcher_rss``, ~10 MB), the floor of every peak reported here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable

# Reads its own VmHWM before it spawns: what the child can inherit, printed as the floor.
_LAUNCHER = r"""
import json, os, sys, time
result, argv = sys.argv[1], sys.argv[2:]
with open("/proc/self/status") as f:
    floor = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
t0 = time.perf_counter()
pid = os.posix_spawnp(argv[0], argv, os.environ)
_, status, ru = os.wait4(pid, 0)
with open(result, "w") as f:
    json.dump({"wall": time.perf_counter() - t0, "cpu": ru.ru_utime + ru.ru_stime,
               "peak_kb": ru.ru_maxrss, "floor_kb": floor, "code": os.waitstatus_to_exitcode(status)}, f)
"""


@dataclass(frozen=True)
class Measure:
    """One command's run: seconds of wall and CPU time (its descendants included), its peak
    RSS in bytes (at least ``floor``, the launcher's size), exit code and output."""

    wall: float
    cpu: float
    peak_rss: int
    floor: int
    code: int
    stdout: str
    stderr: str


def run(
    argv: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, check: bool = True
) -> Measure:
    """Run ``argv`` through the launcher and measure it.

    Args:
        argv: the command.
        env: its environment (default: this process's).
        cwd: its working directory (default: the temporary directory, never a checkout:
            ``python -m`` and ``-c`` put the working directory first on ``sys.path``).
        check: exit with the command's stderr if it fails.

    Returns:
        The measurements.

    Example:
        >>> run([PY, "-c", "print(1)"]).stdout
        '1\\n'
    """
    fd, result = tempfile.mkstemp(prefix="bench-measure-", suffix=".json")
    os.close(fd)
    try:
        done = subprocess.run(
            [PY, "-S", "-c", _LAUNCHER, result, *argv],
            env=env,
            cwd=cwd or tempfile.gettempdir(),
            capture_output=True,
            text=True,
        )
        got = json.loads(Path(result).read_text()) if os.path.getsize(result) else None
    finally:
        os.unlink(result)
    if got is None:
        raise SystemExit(f"the launcher failed for {argv[:4]}: {done.stderr.strip()}")
    m = Measure(
        got["wall"],
        got["cpu"],
        got["peak_kb"] * 1024,
        got["floor_kb"] * 1024,
        got["code"],
        done.stdout,
        done.stderr,
    )
    if check and m.code != 0:
        raise SystemExit(f"{' '.join(map(str, argv))[:300]} failed (exit {m.code}):\n{m.stderr[-3000:]}")
    return m


def timed(
    argv: list[str], *, env: dict[str, str] | None = None, marker: str = ""
) -> tuple[float, list[float]]:
    """Wall seconds of ``argv``, and the seconds at which each stderr line starting with
    ``marker`` came (read as it runs, stderr piped as in a CI job)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        argv, env=env, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    seen, tail = [], []
    for line in proc.stderr:
        tail = (tail + [line])[-20:]
        if marker and line.startswith(marker):
            seen.append(time.perf_counter() - start)
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(argv)[:300]} failed (exit {proc.returncode}):\n{''.join(tail)}")
    return time.perf_counter() - start, seen


def vm_hwm() -> int:
    """This process's own peak RSS in bytes (``VmHWM``: of its current memory image only)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024


def io_read_bytes() -> int:
    """Bytes this process has caused to be read from storage (``read_bytes`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def stop_session(proc: subprocess.Popen) -> None:
    """Stop a process started in a session of its own (``start_new_session``), and every process of
    its session (a server's engine core and workers may outlive the leader)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            # the session's other processes (engine core, workers) may outlive the leader
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _session_alive(proc.pid):
                time.sleep(0.2)
            if not _session_alive(proc.pid):
                return
        except subprocess.TimeoutExpired:
            pass


def _session_alive(sid: int) -> bool:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == sid:
                    return True
            except OSError:
                pass
    return False
