"""``qwen35-reshard cache ls|verify|rm``: the stage cache the servers build (a thin layer over
:mod:`qwen35_reshard.servers.stagecache`), in the manner of ``hf cache``. Tables on stdout;
with ``--json``, stdout holds only JSON and the table goes to stderr."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ..errors import BadInput
from ..units import format_bytes, plural
from .flags import PROG, Debug, Json
from .process import Output, run_guarded

if TYPE_CHECKING:
    from ..servers.stagecache import CacheEntry

CACHE_FLAGS = {
    "models": "--model",
    "older_than": "--older-than",
    "keep_newest": "--keep-newest",
    "everything": "--all",
}

CacheDir = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        metavar="DIR",
        help="the stage cache (default: QWEN35_RESHARD_STAGE_CACHE, else $HF_HOME/qwen35-stages)",
        show_default=False,
    ),
]
Models = Annotated[
    list[str] | None,
    typer.Option(
        "--model", metavar="REPO", help="only this model's entries (repeatable; local/<fingerprint>)"
    ),
]

app = typer.Typer(
    name="cache",
    help="List, check and remove the stage cache's entries (the stages servers built from unsplit models).",
    epilog=f"""Examples:

\b
  {PROG} cache ls
  {PROG} cache verify --model Qwen/Qwen3.5-397B-A17B
  {PROG} cache rm --keep-newest --dry-run
  {PROG} cache rm --older-than 30d
  {PROG} cache ls --json""",
    rich_markup_mode=None,
    no_args_is_help=True,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _guarded(command: Callable[[], int], json_: bool, debug: bool) -> None:
    run_guarded(command, Output(False, json_, debug), "nothing more was removed", CACHE_FLAGS)


@app.command("ls")
def ls(cache_dir: CacheDir = None, json_: Json = False, debug: Debug = False) -> None:
    """List the entries: model, revision, runtime and partition, stage, size, last used,
    complete or not, and the running servers that hold it."""

    def run() -> int:
        from ..servers.stagecache import cache_entries

        entries = cache_entries(cache_dir)
        _table(entries, sys.stderr if json_ else sys.stdout)
        if json_:
            print(json.dumps({"entries": [e.to_dict() for e in entries]}, indent=2))
        return 0

    _guarded(run, json_, debug)


@app.command("verify")
def verify(
    cache_dir: CacheDir = None, model: Models = None, json_: Json = False, debug: Debug = False
) -> None:
    """Check the entries as `verify` checks a stage: its files, and every tensor's bytes against
    the digest its manifest records. Exit 0 when all are intact, 1 otherwise."""

    def run() -> int:
        from ..servers.stagecache import verify_cache
        from ..servers.terms import CACHE

        checked = verify_cache(cache_dir, models=model or ())
        out = sys.stderr if json_ else sys.stdout
        for entry, report in checked:
            state = "ok" if report.ok else plural(len(report.findings), "problem")
            print(f"{_name(entry)}: {state}", file=out)
            for f in report.findings:  # what to do, in the terms of a stage the servers build
                print(f"  {f.render(CACHE)}", file=out)
            if not report.ok:
                print(f"  {_mend(entry)}", file=out)
        bad = sum(not r.ok for _, r in checked)
        print(f"{plural(len(checked), 'entry', 'entries')} checked, {bad} with problems", file=out)
        if json_:
            doc = [
                {**e.to_dict(), "report": r.to_dict(CACHE), **({} if r.ok else {"mend": _mend(e)})}
                for e, r in checked
            ]
            print(json.dumps({"status": "failed" if bad else "ok", "entries": doc}, indent=2))
        return 1 if bad else 0

    _guarded(run, json_, debug)


@app.command("rm")
def rm(
    cache_dir: CacheDir = None,
    model: Models = None,
    older_than: Annotated[
        str | None,
        typer.Option(
            "--older-than", metavar="AGE", help="only entries no server started on for AGE (30d, 12h, 90m)"
        ),
    ] = None,
    keep_newest: Annotated[
        bool,
        typer.Option("--keep-newest", help="keep each model's most recently used revision only"),
    ] = False,
    everything: Annotated[bool, typer.Option("--all", help="every entry")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="say what would be removed; remove nothing")
    ] = False,
    json_: Json = False,
    debug: Debug = False,
) -> None:
    """Remove entries: of --model, older than --older-than, all but the newest per model
    (--keep-newest), or --all; criteria given together must all hold. An entry a running server
    holds (or a start is building) is never removed: it is listed as refused, and the exit code
    is 1."""

    def run() -> int:
        from ..servers.stagecache import remove_entries

        age = _seconds(older_than) if older_than is not None else None
        done = remove_entries(
            cache_dir, models=model or (), older_than=age, keep_newest=keep_newest, everything=everything,
            dry_run=dry_run,
        )  # fmt: skip
        out = sys.stderr if json_ else sys.stdout
        verb = "would remove" if dry_run else "removed"
        for e in done.removed:
            print(f"{verb}: {_name(e)} ({format_bytes(e.size)})", file=out)
        for e in done.refused:
            held = ", ".join(u.describe() if u is not None else "unknown" for u in e.users)
            print(f"refused: {_name(e)} is held by a running server or start ({held})", file=out)
        print(f"{verb} {plural(len(done.removed), 'entry', 'entries')}, {format_bytes(done.freed)}", file=out)
        if json_:
            print(json.dumps(done.to_dict(), indent=2))
        return 1 if done.refused else 0

    _guarded(run, json_, debug)


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _seconds(age: str) -> float:
    """``30d``, ``12h``, ``90m``, ``45s``, ``2w`` in seconds."""
    text = age.strip().lower()
    try:
        value = float(text[:-1])
        if text[-1:] in _UNITS and value >= 0:
            return value * _UNITS[text[-1]]
    except ValueError:
        pass
    raise BadInput(f"--older-than {age!r} is not an age like 30d, 12h, 90m, 45s or 2w")


def _mend(e: CacheEntry) -> str:
    """What mends a damaged entry: removing it, so that a server's next start builds it anew."""
    return (
        f"remove it ({PROG} cache rm --model {e.model} removes every entry of {e.model}; or delete "
        f"{e.path}): the next start of a server on it builds it anew"
    )


def _name(e: CacheEntry) -> str:
    return f"{e.model}@{e.revision[:12]} {e.key} {e.path.name}"


HEADINGS = ("MODEL", "REVISION", "RUNTIME", "PARTITION", "STAGE", "SIZE", "LAST USED", "COMPLETE", "HELD BY")


def _table(entries: list[CacheEntry], out: object) -> None:
    rows = [HEADINGS]
    for e in entries:
        held = ", ".join(u.describe() if u is not None else "unknown" for u in e.users) or "-"
        rows.append((
            e.model, e.revision[:12], e.runtime, ",".join(map(str, e.partition)), e.path.name,
            format_bytes(e.size), _ago(e.last_used), "yes" if e.complete else "no", held,
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)
    total = sum(e.size for e in entries)
    print(f"\n{plural(len(entries), 'entry', 'entries')}, {format_bytes(total)}", file=out)


def _ago(t: float) -> str:
    """How long ago ``t`` was: ``12s ago``, ``5m ago``, ``3h ago``, ``2d ago``."""
    s = max(0.0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{int(s // n)}{unit} ago"
    return f"{int(s)}s ago"
