"""The node's record of the data files already checked, and its budget of hashing threads.

With tensor parallelism every worker on a node loads the same stage: without this record each
would hash every byte of it. Here the first loader to reach a file checks it; the others use
its verdict, and a node's hashing threads are counted against one budget however many
workers load.

**Trust.** A record says: the file with this identity (device, inode, size, modification and
status-change times, from ``fstat`` of the descriptor the loader maps) had, at the recorded
time, the bytes of these expected digests (the key also covers what was expected: another
stage reading the same shard in place checks other ranges). Any write through the kernel
moves the file's change time (no call sets it back), a replaced file is another inode: either
gives another key, so another check. Timestamps are coarse (a kernel tick), so a file changed
within :data:`RACY_SECONDS` before its check began is not recorded (git's "racy" rule: a
write in the same tick as the one the check saw would keep the timestamps); on a filesystem
that keeps whole seconds, within that plus :data:`COARSE_SECONDS` (:func:`racy_margin`). A record is
trusted for :data:`TRUSTED_FOR` seconds, the start of one server's workers, not for later
starts (the page cache may be dropped and bytes read again from the disk), and never across a
reboot (``/dev/shm`` is memory). Only the user's own private directory is trusted: another
user cannot plant a verdict.

**Races.** The loader takes the identity from the descriptor it maps and hashes, not from
the path (a file replaced between two opens is not what was checked), checks that it is
unchanged once read, and the checker records only when the file's identity after hashing is
the one before. A file being checked is locked (``flock``, released by the kernel if the
checker dies): the others wait for its verdict before their last tensor, and check it
themselves when none came (a damaged file, or a checker that died).
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from pathlib import Path

from ..format.digest import XXH128, hexdigest

try:
    import fcntl
except ImportError:  # not POSIX: no record, each loader checks everything itself
    fcntl = None  # type: ignore[assignment]

CHECKED_DIR_ENV = "QWEN35_RESHARD_CHECKED_DIR"  # the node's record directory (default: see node_dir)
HASH_THREADS_ENV = "QWEN35_RESHARD_HASH_THREADS"  # the node's hashing threads (default: see node_threads)
TRUSTED_FOR = 600.0  # seconds a check counts for the node's other loaders: one start's workers
RACY_SECONDS = 0.1  # a kernel tick is at most 10 ms (HZ=100); the margin is ten of them
# A filesystem that keeps whole seconds (ext3, NFSv2, ...) or two (FAT's modification time)
# gives every time of a file 0 ns: a write up to 2 s after the time seen keeps it.
COARSE_SECONDS = 2.0
# A node's hashing threads: xxh3-128 hashes ~30 GB/s a thread (format.digest), so 8 outrun the
# memory bandwidth of the copies of every worker of a GPU node; more only take cores from them.
NODE_THREADS_MAX = 8
WORKER_THREADS = 2  # what one loader asks for: two threads of xxh3 outrun one copy (~10 GB/s)

TRUSTED, MINE, OTHERS = "trusted", "mine", "others"

Identity = tuple[int, int, int, int, int]


def identity(fd: int) -> Identity:
    """What tells the open file ``fd`` from any other and from itself after a write: device,
    inode, size, modification and status-change times (ns)."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def node_threads(env: dict[str, str] | None = None) -> int:
    """The node's budget of hashing threads, shared by every loader on it: ``QWEN35_RESHARD_HASH_THREADS``
    if set, else the node's cores up to :data:`NODE_THREADS_MAX`.

    Example:
        >>> node_threads({"QWEN35_RESHARD_HASH_THREADS": "3"})
        3
    """
    value = (os.environ if env is None else env).get(HASH_THREADS_ENV, "").strip()
    if value.isdigit():
        return int(value)
    return min(os.cpu_count() or 1, NODE_THREADS_MAX)


def node_dir() -> Path | None:
    """The node's record directory, made private to this user if new; None when it is not
    (another owner, open to others, not a directory): then nothing is shared."""
    given = os.environ.get(CHECKED_DIR_ENV)
    if given:
        path = Path(given)
    else:
        base = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())
        path = base / f"qwen35-reshard-checked-{os.geteuid()}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return path


def racy_margin(checked: Identity) -> float:
    """How long before a check began its file must have last changed for the check to be
    recorded: :data:`RACY_SECONDS`, plus :data:`COARSE_SECONDS` where the file's times are whole
    seconds (a coarse filesystem: a write within its granularity would keep the identity).

    Example:
        >>> racy_margin((1, 2, 3, 1_700_000_000_123_456_789, 1_700_000_000_123_456_789))
        0.1
        >>> racy_margin((1, 2, 3, 1_700_000_000_000_000_000, 1_700_000_000_000_000_000))
        2.1
    """
    coarse = checked[3] % 1_000_000_000 == 0 or checked[4] % 1_000_000_000 == 0
    return RACY_SECONDS + (COARSE_SECONDS if coarse else 0.0)


class Claim:
    """A loader's standing on one file: :data:`TRUSTED` (checked by another loader, nothing to
    do), :data:`MINE` (locked: this loader checks it and records the verdict) or :data:`OTHERS`
    (another loader is checking it: :meth:`wait` for its verdict)."""

    def __init__(self, fd: int | None, state: str, checked: Identity) -> None:
        self._fd = fd
        self.state = state
        self.checked = checked  # the identity the verdict is about
        self.started = time.time()  # when this loader's check began (MINE)

    def record(self, now: Identity) -> None:
        """The file was checked and found intact, and ``now`` is its identity after: record the
        verdict (unless the file changed, or changed too recently to tell), release the lock."""
        changed_at = max(self.checked[3], self.checked[4]) / 1e9
        settled = changed_at < self.started - racy_margin(self.checked)
        if self._fd is not None and now == self.checked and settled:
            text = f"checked {time.time()!r}\n".encode()
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text, 0)
        self.release()

    def wait(self) -> bool:
        """Wait for the loader checking the file; True when it recorded the file intact, else
        (damaged, or it died) this loader now holds the file to check (``state`` MINE)."""
        assert self._fd is not None
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        if _fresh(self._fd):
            self.state = TRUSTED
            self.release()
            return True
        self.state, self.started = MINE, time.time()
        return False

    def release(self) -> None:
        """Give up the lock without a verdict (found damaged, or stopped early)."""
        if self._fd is not None:
            os.close(self._fd)  # closing releases the flock
            self._fd = None


class NodeChecks:
    """The node's record directory, opened by one loader: claims on files and hashing threads.

    Example:
        >>> import os, tempfile
        >>> os.environ["QWEN35_RESHARD_CHECKED_DIR"] = tempfile.mkdtemp() + "/node"
        >>> a, b = NodeChecks.open(), NodeChecks.open()
        >>> a.take_threads(2, budget=3), b.take_threads(2, budget=3)  # the node's 3, not 2 each
        (2, 1)
        >>> a.close(); b.close()
    """

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self._slots: list[int] = []

    @classmethod
    def open(cls) -> NodeChecks | None:
        """The node's record, or None where there is no private directory for it (or no
        ``flock``)."""
        directory = node_dir() if fcntl is not None else None
        return None if directory is None else cls(directory)

    def take_threads(self, want: int, budget: int | None = None) -> int:
        """Take up to ``want`` of the node's ``budget`` hashing threads (default
        :func:`node_threads`) not taken by another loader; held until :meth:`close`.
        Returns how many: 0 when the others hold them all (this loader then hashes in its
        own thread)."""
        budget = node_threads() if budget is None else budget
        for i in range(budget):
            if len(self._slots) >= want:
                break
            fd = _open_private(self.dir / f"thread-{i}.slot")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self._slots.append(fd)
        return len(self._slots)

    def claim(self, fd: int, expected: str) -> Claim:
        """This loader's :class:`Claim` on the data file open as ``fd`` against ``expected``
        (what its check compares the bytes with, e.g. the digests of its ranges, joined)."""
        checked = identity(fd)
        name = hexdigest(XXH128, repr((checked, expected)).encode()) + ".check"
        record = _open_private(self.dir / name)
        try:
            fcntl.flock(record, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return Claim(record, OTHERS, checked)
        if _fresh(record):
            os.close(record)
            return Claim(None, TRUSTED, checked)
        return Claim(record, MINE, checked)

    def close(self) -> None:
        """Give back the threads taken; forget records too old to be trusted."""
        for fd in self._slots:
            os.close(fd)
        self._slots = []
        _sweep(self.dir)


def _open_private(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)


def _fresh(fd: int) -> bool:
    """Whether the record open as ``fd`` holds a verdict younger than :data:`TRUSTED_FOR`."""
    text = os.pread(fd, 64, 0)
    try:
        word, when = text.split()
        age = time.time() - float(when)
    except ValueError:
        return False
    return word == b"checked" and 0 <= age < TRUSTED_FOR


def _sweep(directory: Path) -> None:
    """Delete records older than twice :data:`TRUSTED_FOR` that nobody holds (each start's files
    make new ones)."""
    cutoff = time.time() - 2 * TRUSTED_FOR
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for e in entries:
        if not e.name.endswith(".check"):
            continue
        try:
            if e.stat(follow_symlinks=False).st_mtime >= cutoff:
                continue
            fd = _open_private(Path(e.path))
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(e.path)
        except OSError:
            pass
        finally:
            os.close(fd)
