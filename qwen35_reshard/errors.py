"""The exceptions the tool raises for bad input or a failed run, in the library's own terms.

Every one is a :class:`ReshardError` (a ValueError), whose message is a single line that names
the file, tensor or parameter at fault and what to do; the command line prints it as
``error: ...`` and exits with its ``exit_code`` (2 for each). What went wrong, by class:

- :class:`BadInput`: a parameter, the checkpoint, or what OUT holds is not what the tool can
  work with (a bad ``pp``, a damaged header, OUT holding another split): fix it, run again.
- :class:`OutBusy`: another live run is writing OUT (or building the stage a repair would
  mend): ``retryable``, the same call succeeds once that run has finished.
- :class:`OutError`: the operating system refused a write in OUT (a full disk, no
  permission, a read-only volume); raised ``from`` the OSError: the same command resumes.
- :class:`RemoteError`: a remote source could not be read (unreachable, refusing, or answering
  other bytes than asked); :class:`HubError`, one of them: the Hugging Face Hub could not be
  reached, refused the request, or the repo is incomplete; :class:`ObjectStoreError`, another:
  an object store (``s3://``) refused the credentials or the request, lacks the objects, or an
  object was replaced while a run read it.
- :class:`StageError`: a stage directory that must not be loaded (the loader shim);
  :class:`DamagedStage` when its bytes are not the ones its manifest records.
A parameter is named through :func:`param`, and what to do through :func:`advice`, so each
reader sees its own terms (an :class:`Audience`): ``str(e)`` says ``pp`` or ``overwrite=True``
(the library's parameters) and "run the same qwen35-reshard command again"; the CLI renders the
same error with its flags (``--pp``, ``--overwrite``) through :meth:`ReshardError.render`; a
server's log in its operator's terms (the stage cache, its variable, the server's next start:
:mod:`qwen35_reshard.servers.terms`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

# What json.loads raises for bytes it cannot load: JSONDecodeError and UnicodeDecodeError (both
# ValueErrors), ValueError for an integer past Python's 4300-digit limit, RecursionError for
# nesting past the recursion limit. Crafted or damaged files hold any of them.
JSON_ERRORS = (ValueError, RecursionError)

_MARK, _SEP, _ADVICE = "\x1f", "\x1e", "\x1d"
_PARAM = re.compile(f"{_MARK}([^{_MARK}{_SEP}]+)(?:{_SEP}([^{_MARK}]*))?{_MARK}")
_ADVISED = re.compile(f"{_ADVICE}([^{_ADVICE}{_SEP}]+){_SEP}([^{_ADVICE}]*){_ADVICE}")


def param(name: str, value: object = None) -> str:
    """Name parameter ``name`` (set to ``value``, if given) inside an error message."""
    return f"{_MARK}{name}{'' if value is None else _SEP + repr(value)}{_MARK}"


def advice(key: str, text: str) -> str:
    """Advice ``text`` inside a message, of the kind ``key`` (``"rerun"``, ``"rebuild"``, ...):
    said as ``text`` unless the reader's :class:`Audience` words that kind its own way.

    Example:
        >>> e = OutError(f"/out: disk full; free space and {advice('rerun', 'run it again')}")
        >>> str(e)
        '/out: disk full; free space and run it again'
        >>> e.render(Audience(advice={"rerun": "start the server again"}))
        '/out: disk full; free space and start the server again'
    """
    return f"{_ADVICE}{key}{_SEP}{text}{_ADVICE}"


# Advice several messages give: the same run again (a server's next start) resumes where this
# one stopped; write elsewhere (a server writes where its variable points).
AGAIN = advice("rerun", "run the same command again")
ELSEWHERE = advice("elsewhere", "choose another directory")


class Audience:
    """Who reads a message, in their terms: ``flags`` spells each :func:`param` (a CLI's
    flags, a server's settings), ``advice`` words each kind of :func:`advice` (what a server
    operator does is not what a command-line user does). Anything not mapped is said as the
    library says it.

    A plain class, not a dataclass: this module loads before the command line's Ctrl-C handler
    is installed (``cli.main``), so it imports only what the interpreter's start already has
    (``dataclasses`` pulls in ``copy``, ``inspect``, ...: tests/e2e/test_no_traceback.py).
    """

    __slots__ = ("flags", "advice")

    def __init__(
        self, flags: Mapping[str, str] | None = None, advice: Mapping[str, str] | None = None
    ) -> None:
        self.flags: Mapping[str, str] = dict(flags or {})
        self.advice: Mapping[str, str] = dict(advice or {})

    def __repr__(self) -> str:
        return f"Audience(flags={self.flags!r}, advice={self.advice!r})"


class ReshardError(ValueError):
    """Bad input or an unrecoverable condition, explained in one line for the user.

    A ValueError, so that ``except ValueError`` catches the library's bad-argument errors too.
    """

    exit_code = 2
    retryable = False  # whether the same call may succeed later, unchanged
    # Whom ``str()`` words the message for (None: the library's caller); a server sets its
    # operator's on what escapes into its log (servers.terms.operator_terms).
    audience: Audience | None = None

    def __str__(self) -> str:
        return self.render(self.audience or Audience())

    @property
    def text(self) -> str:
        """The message with its parameters and advice still marked: to build another message
        from, which its reader renders."""
        return super().__str__()

    def render(self, flags: Mapping[str, str] | Audience) -> str:
        """The message with each parameter spelt as ``flags`` maps it (a CLI's flag), or in an
        :class:`Audience`'s terms; others as the library spells them (``name`` or
        ``name=value``)."""
        if isinstance(flags, Audience):
            return spell(self.text, flags.flags, flags.advice)
        return spell(self.text, flags)


def spell(text: str, flags: Mapping[str, str], advised: Mapping[str, str] | None = None) -> str:
    """``text`` with each :func:`param` in it spelt as ``flags`` maps it, others as the library
    spells them, and each :func:`advice` worded as ``advised`` maps its kind, else as given:
    for messages that are no error (e.g. where a setting came from, a finding)."""
    advised = advised or {}
    text = _ADVISED.sub(lambda m: advised.get(m.group(1), m.group(2)), text)

    def one(m: re.Match) -> str:
        name, value = m.group(1), m.group(2)
        if name not in flags:
            return name if value is None else f"{name}={value}"
        if value is None or value == "True":
            return flags[name]
        return f"{flags[name]} {value.strip(chr(39))}"

    return _PARAM.sub(one, text)


class BadInput(ReshardError):
    """A parameter, the checkpoint or what OUT holds is not what the tool can work with."""


class OutBusy(ReshardError):
    """Another live run is writing OUT: wait for it to finish (or choose another directory)."""

    retryable = True


class OutError(ReshardError):
    """The operating system refused a write in OUT (full disk, no permission, read-only)."""


class RemoteError(ReshardError):
    """A remote source (the Hub, an object store) could not be read: unreachable, refusing,
    or answering with bytes that are not the ones asked for."""


class HubError(RemoteError):
    """The Hugging Face Hub could not be reached, refused the request, or the repo is incomplete."""


class ObjectStoreError(RemoteError):
    """An object store (``s3://``) could not be read: unreachable, refusing the credentials or
    the request, the objects missing, or an object replaced while a run read it."""


class StageError(ReshardError):
    """A stage directory that must not be loaded, with what to do about it in one line."""


class DamagedStage(StageError):
    """Bytes handed to a server that are not the ones the stage records: found while loading,
    before the load finished. ``path``: the data file; ``tensor``: the tensor whose sha256
    differs (None when only the whole file's digest is known)."""

    def __init__(self, message: str, path: str, tensor: str | None) -> None:
        super().__init__(message)
        self.path, self.tensor = path, tensor
