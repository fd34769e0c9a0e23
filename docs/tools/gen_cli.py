"""Write docs/cli.md from the commands' own ``--help`` (tests/test_docs.py fails when they differ).

Run: ``python docs/tools/gen_cli.py`` after changing an option or a help text.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "cli.md"
COMMANDS = (
    (), ("split",), ("plan",), ("verify",), ("cache",), ("cache", "ls"), ("cache", "verify"), ("cache", "rm"),
)  # fmt: skip
WIDTH = "100"  # the help is wrapped to the terminal: one width for the page

INTRO = """# Command reference

Generated from the commands' own `--help` by `docs/tools/gen_cli.py` (a test fails when they
differ). What each option means in practice: [Using the command](usage.md).
"""


def help_text(command: tuple[str, ...]) -> str:
    env = {**os.environ, "COLUMNS": WIDTH, "TERM": "dumb", "NO_COLOR": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", *command, "--help"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    return "\n".join(line.rstrip() for line in p.stdout.strip("\n").splitlines())


def page() -> str:
    parts = [INTRO]
    for command in COMMANDS:
        name = " ".join(("qwen35-reshard", *command))
        parts.append(f"## `{name}`\n\n```\n{help_text(command)}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    PAGE.write_text(page())
    print(f"wrote {PAGE}")
