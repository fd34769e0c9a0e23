"""``python -m benchmarks``: list the benchmarks, or run one, here and (``--before REF``) there."""

from __future__ import annotations

import argparse
import signal
import sys
import textwrap
from pathlib import Path

from benchmarks import load, names
from benchmarks.lib.trees import ROOT, Tree, worktree


def listing() -> str:
    """Each benchmark's name and the first paragraph of its docstring."""
    rows = []
    for name in names():
        module = load(name)
        summary = " ".join((module.__doc__ or "").strip().split("\n\n")[0].split())
        summary += "" if module.BEFORE else " (This tree only: no --before.)"
        rows.append(textwrap.fill(summary, 100, initial_indent=f"  {name:18s} ", subsequent_indent=" " * 21))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(
            f"{(__package__ and sys.modules[__package__].__doc__ or '').strip()}\n\nbenchmarks:\n{listing()}"
        )
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names():
        print(f"error: no benchmark {name!r}; `python -m benchmarks` lists them", file=sys.stderr)
        return 2
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--before", metavar="REF", default=None)
    common.add_argument("--quick", action="store_true")
    opts, rest = common.parse_known_args(rest)
    module = load(name)
    if opts.quick:
        rest = [*module.QUICK, *rest]
    here = Tree("after", ROOT)
    if opts.before is None:
        return module.main(rest, [here])
    if not module.BEFORE:
        print(f"error: --before: {name} measures this tree only (see its --help)", file=sys.stderr)
        return 2
    # A run stopped by `timeout` or `kill` still removes the worktree (its `finally`).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    with worktree(opts.before) as old:
        print(f"before: {opts.before} in {old}; after: {here.path}", flush=True)
        return module.main(rest, [here, Tree("before", Path(old))])


if __name__ == "__main__":
    sys.exit(main())
