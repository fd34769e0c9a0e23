"""The command's own process: its streams, signals, exit, and the speed tricks that are only
for a process that ends when the command does (never the library's caller's).

stdout that cannot take the results (a full device) is one ``error:`` line, exit 2; a reader
that went away (``| head``) ends the process as it ends ``git log``: by SIGPIPE, silently (in
a process that is not the command itself, the shell's status for it, 141). SIGINT and SIGTERM
raise KeyboardInterrupt while a command runs, whatever the process inherited.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, TextIO

import typer

from ..errors import ReshardError

if TYPE_CHECKING:
    from ..api import ReshardProgress

# What a run made (its plan, which holds the checkpoint) when this process is the command
# itself: kept to the end, where os._exit hands the memory back at once instead of freeing
# the ~190,000 tensors' objects of a 397B FP8 checkpoint one by one (0.1 s).
_kept: list[object] | None = None


def run(command: Callable[[], int], *, program: bool) -> int:
    """Run ``command()`` with stdout guarded; return its exit code, or, when ``program`` (this
    process is the command itself), end the process with it once its output is out."""
    global _kept
    _kept = [] if program else None
    stdout = sys.stdout
    if stdout is not None:
        sys.stdout = _Results(stdout)
    try:
        code = command()
        if stdout is not None:
            sys.stdout.flush()
    except StdoutFailed as e:
        code = _reader_gone(program) if isinstance(e.cause, BrokenPipeError) else _unwritable(e.cause)
    except BrokenPipeError:  # stderr's reader went away
        code = _reader_gone(program)
    finally:
        sys.stdout = stdout
    if program:
        _exit(code)
    return code


def keep_to_the_end(obj: object) -> None:
    """In the command's own process, keep ``obj`` alive until os._exit (see ``_kept``)."""
    if _kept is not None:
        _kept.append(obj)


def collector_off_until_planned(progress: ReshardProgress) -> ReshardProgress:
    """In the command's own process: the garbage collector off while the checkpoint is read and
    planned (~190,000 small objects, none cyclic, for a 397B FP8 checkpoint), and what that made
    frozen once planned, so that no collection walks it again (the first one after enable()
    would take ~0.2 s). The library itself leaves its caller's collector as it found it."""
    if _kept is None:
        return progress
    gc.disable()
    shown = progress.planned

    def planned(*args: object) -> None:
        gc.freeze()
        gc.enable()
        shown(*args)

    progress.planned = planned  # type: ignore[method-assign]
    return progress


# Control characters and line separators; lone surrogates (a file name's bytes that are no UTF-8,
# as Python decodes them), which no UTF-8 stream takes.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def fail(as_json: bool, message: str) -> None:
    """``message`` as one line on stderr; with ``--json`` also as a JSON error on stdout (when
    stdout takes it: the line on stderr is said either way). Control characters a damaged file
    or name may bring into it are escaped: a line break could forge another ``error:`` line, and
    a lone surrogate is no text a stream encodes."""
    message = _CONTROL.sub(lambda m: ascii(m.group())[1:-1], message)
    print(message, file=sys.stderr)
    if as_json:
        with contextlib.suppress(StdoutFailed, OSError):
            print(json.dumps({"status": "error", "error": message.removeprefix("error: ")}))


@contextlib.contextmanager
def interrupts_raised() -> Iterator[None]:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the block, as they did not before it.

    SIGINT is handled here rather than left to Python's default, which a process started with
    SIGINT ignored (a background job, some CI runners) never installs.
    """
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


class StdoutFailed(Exception):
    """Writing the results to stdout failed with ``cause``: told apart from the library's OS errors."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(str(cause))
        self.cause = cause


class _Results:
    """``sys.stdout`` while a command runs: a write or flush that fails raises StdoutFailed."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            raise StdoutFailed(e) from e

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            raise StdoutFailed(e) from e

    def __getattr__(self, name: str) -> object:  # isatty, fileno, encoding, ... as the stream's
        return getattr(self._stream, name)


def _unwritable(e: OSError) -> int:
    """stdout cannot take the results: say so on stderr; the exit code of a refused run."""
    with contextlib.suppress(OSError):
        print(
            f"error: stdout: cannot write the results ({e.strerror or e}); make room where stdout goes "
            "or send it elsewhere",
            file=sys.stderr,
        )
    return ReshardError.exit_code


def _reader_gone(program: bool) -> int:
    """The reader of the output went away (``| head``): end silently as ``git log | head`` does,
    killed by SIGPIPE; in-process (``program`` false), return the shell's status for that."""
    if program:
        with contextlib.suppress(OSError):
            sys.stderr.flush()
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGPIPE)
    return 128 + signal.SIGPIPE


def _exit(code: int) -> NoReturn:
    """End the process with ``code`` once its output is out, skipping the interpreter's teardown."""
    # The command is over: an interrupt now just ends the process, with nothing left to say.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with that descriptor closed: there was nowhere to write
            continue
        try:
            stream.flush()
        except BrokenPipeError:  # run flushed stdout: this is stderr's reader gone
            code = _reader_gone(True)
        except (OSError, ValueError):  # closed or unwritable: nothing more to say there
            pass
    os._exit(code)


@dataclass(frozen=True)
class Output:
    """How a command shows its results: ``--quiet``, ``--json``, ``--debug``."""

    quiet: bool
    json: bool
    debug: bool


def run_guarded(
    command: Callable[[], int],
    output: Output,
    interrupted: str,
    flags: Mapping[str, str],
) -> None:
    """Run ``command()``; errors become one line and an exit code, ``interrupted`` is what an
    interrupt (Ctrl-C, SIGINT, SIGTERM) says, parameters are spelt as ``flags`` maps them."""
    try:
        with interrupts_raised():
            code = command()
    except ReshardError as e:
        if output.debug:  # the traceback, then the same line and exit code as without --debug
            traceback.print_exc()
        fail(output.json, f"error: {e.render(flags)}")
        code = e.exit_code
    except KeyboardInterrupt:
        fail(output.json, f"interrupted: {interrupted}")
        code = 130
    raise typer.Exit(code)
