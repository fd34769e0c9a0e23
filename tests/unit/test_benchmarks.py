"""The benchmark suite (``python -m benchmarks``): it lists every benchmark, each takes its
smallest mode's arguments, the cheap ones run, ``--before`` checks out another commit, and a
child's peak RSS is its own, not the benchmark process's."""

import os
import subprocess
import sys

import pytest

from support.helpers import ROOT

sys.path.insert(0, str(ROOT))
from benchmarks import load, names  # noqa: E402
from benchmarks.lib import procs  # noqa: E402
from benchmarks.lib.trees import worktree  # noqa: E402

# Whose --quick takes a second or two here; the others need minutes, root or a server's venv.
CHEAP = ["plan", "rank_memory", "expert_nodes"]


def _suite(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_suite_lists_every_benchmark():
    files = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))
    assert names() == files
    assert len(files) >= 10
    listed = _suite().stdout
    for name in files:
        assert f"  {name} " in listed
        module = load(name)
        assert isinstance(module.QUICK, list) and isinstance(module.BEFORE, bool) and callable(module.main)


@pytest.mark.parametrize("name", names())
def test_each_benchmark_takes_its_quick_arguments(name, capsys):
    module = load(name)
    with pytest.raises(SystemExit) as e:
        module.main([*module.QUICK, "--help"], [])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("name", CHEAP)
def test_a_quick_run(name):
    done = _suite(name, "--quick")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "after" in line]
    assert rows and all(("x |" in row or "% |" in row) for row in rows)  # rows, each with its ratio


def test_an_unknown_benchmark_and_a_before_it_cannot_take():
    assert "error: no benchmark 'nope'" in _suite("nope").stderr
    done = _suite("partition_table", "--before", "HEAD")
    assert done.returncode == 2 and "error: --before: partition_table measures this tree only" in done.stderr


def test_before_is_a_worktree_of_the_commit_removed_after(tmp_path):
    repo = tmp_path / "repo"
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f").write_text("old")
    subprocess.run([*git, "add", "f"], check=True)
    subprocess.run([*git, "commit", "-qm", "old"], check=True)
    (repo / "f").write_text("new")
    subprocess.run([*git, "commit", "-qam", "new"], check=True)
    with worktree("HEAD~1", repo) as old:
        assert (old / "f").read_text() == "old" and (repo / "f").read_text() == "new"
    assert not old.exists()
    assert subprocess.run([*git, "worktree", "list"], capture_output=True, text=True).stdout.count("\n") == 1
    with pytest.raises(SystemExit, match="error: --before nope"), worktree("nope", repo):
        pass


def test_a_childs_peak_rss_is_its_own():
    """A child spawned straight from a process that has held 300 MB reports at least 300 MB
    (Linux carries the parent's high-water mark across exec); through the launcher it reports
    its own 100 MB."""
    held = b"\x01" * (300 << 20)  # every page written: resident
    child = [sys.executable, "-c", "x = b'\\x01' * (100 << 20)"]
    plain = subprocess.Popen(child)
    _, _, usage = os.wait4(plain.pid, 0)
    assert usage.ru_maxrss * 1024 >= 300 << 20  # what benchmarks/rank_memory.py used to read
    m = procs.run(child)
    assert 100 << 20 <= m.peak_rss < 200 << 20
    assert m.floor < 50 << 20
    del held
