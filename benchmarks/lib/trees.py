"""The source trees a run compares: this checkout ("after") and, with ``--before REF``, a git
worktree of REF in a temporary directory ("before"), removed at the end of the run.

A benchmark runs its measured commands with a tree first on ``PYTHONPATH`` (``Tree.env``), so
the suite's code is this checkout's while the library measured is the tree's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Tree:
    """A source tree of the package: ``label`` ("after" or "before") and its ``path``."""

    label: str
    path: Path

    def env(self, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
        """An environment whose Python imports this tree's ``qwen35_reshard``."""
        env = dict(os.environ if base is None else base)
        env["PYTHONPATH"] = str(self.path)
        env.update(extra)
        return env


def check_imports(tree: Tree, module_file: str) -> None:
    """Stop if a child with ``tree`` on its path imported the package from elsewhere."""
    if not module_file.startswith(str(tree.path)):
        raise SystemExit(f"{tree.path} is not the tree Python imported ({module_file}); is it a checkout?")


@contextmanager
def worktree(ref: str, repo: Path = ROOT) -> Iterator[Path]:
    """A detached git worktree of ``ref`` (of ``repo``) in a temporary directory, removed after.

    Example:
        >>> with worktree("HEAD") as old:  # doctest: +SKIP
        ...     (old / "qwen35_reshard").is_dir()
        True
    """
    where = Path(tempfile.mkdtemp(prefix="bench-before-")) / "tree"
    done = subprocess.run(
        ["git", "-C", str(repo), "worktree", "add", "--detach", "--quiet", str(where), ref],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        shutil.rmtree(where.parent, ignore_errors=True)
        raise SystemExit(f"error: --before {ref}: {done.stderr.strip() or 'git worktree add failed'}")
    try:
        yield where
    finally:
        subprocess.run(
            ["git", "-C", str(repo), "worktree", "remove", "--force", str(where)], capture_output=True
        )
        shutil.rmtree(where.parent, ignore_errors=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


def order(trees: list[Tree], round_: int) -> list[Tree]:
    """The trees in the order round ``round_`` runs them: rotated, so none always goes first."""
    k = round_ % len(trees)
    return trees[k:] + trees[:k]
