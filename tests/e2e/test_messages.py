"""Messages that once misled (issue 32), each as a real command prints it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qwen35_reshard import reshard
from qwen35_reshard.cli.report import out_line
from qwen35_reshard.units import format_bytes
from qwen35_reshard.write.assess import OutState


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", *map(str, args)], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory):
    return Path(tiny.build_checkpoint(tmp_path_factory.mktemp("messages") / "model"))


def test_plan_states_the_space_out_needs_and_when_blocks_are_shared(model):
    """Sharing blocks is said as a condition of OUT's filesystem, never as what will happen;
    the free space needed is stated for both cases."""
    plan = reshard(model, None, pp=4, dry_run=True).plan
    size = sum(s.size for s in plan.stages)
    copy = size - sum(s.shareable_bytes for s in plan.stages)
    assert 0 < copy < size
    p = cli("plan", "--pp", 4, model)
    assert p.returncode == 0, p.stderr
    assert "shareable" not in p.stdout and "reflink:" not in p.stdout
    [line] = [x for x in p.stdout.splitlines() if x.startswith("space:")]
    needed, shared = format_bytes(size), format_bytes(copy)
    assert line == f"space: OUT needs {needed} free; {shared} if it can share the source's blocks"
    assert len(line) <= 80


def test_resume_names_the_stages_whose_files_are_kept(model, tmp_path):
    """An interrupted run kept a finished data file of pp0 only: the preview names pp0."""
    plan = reshard(model, None, pp=4, dry_run=True).plan
    name = plan.stages[0].files[0].name
    state = OutState("resume", kept={0: {name: {}}})
    line = out_line(plan, tmp_path, state)
    assert "keeping 1 finished data file of pp0, and writes pp0, pp1, pp2, pp3" in line, line


def test_debug_keeps_the_exit_code(model, tmp_path):
    """--debug adds the traceback; the exit code and the closing error line stay those of the
    run without it."""
    plain = cli("--pp", 99, model, tmp_path / "out")
    debug = cli("--pp", 99, "--debug", model, tmp_path / "out")
    assert plain.returncode == debug.returncode == 2, debug.stderr
    assert "Traceback" not in plain.stderr and "Traceback" in debug.stderr
    assert debug.stderr.splitlines()[-1] == plain.stderr.splitlines()[-1]
    assert plain.stderr.startswith("error: ")
