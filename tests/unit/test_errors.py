"""The exception hierarchy under ReshardError: each kind of failure its own class, with the
same one-line messages and exit codes as before (the CLI's are compared byte for byte by
.ci/tools/compare_trees.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import qwen35_reshard as q
from qwen35_reshard.format.names import CLAIM

from support.helpers import ROOT


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint()


def test_every_kind_is_a_reshard_error_and_a_value_error():
    for kind in (q.BadInput, q.OutBusy, q.OutError, q.HubError, q.StageError):
        assert issubclass(kind, q.ReshardError) and issubclass(kind, ValueError)
        assert kind.exit_code == 2
    assert q.OutBusy.retryable and not any(k.retryable for k in (q.BadInput, q.OutError, q.HubError))


def test_a_bad_parameter_is_bad_input(model):
    with pytest.raises(q.BadInput, match="pp must be at least 1, got 0"):
        q.reshard(model, None, pp=0, dry_run=True)


def test_a_repo_offline_and_not_cached_is_a_hub_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(q.HubError, match="offline, and the Hugging Face cache lacks revision"):
        q.reshard("Qwen/NotCached", None, pp=2, dry_run=True, hub=q.HubSettings(offline=True))


def test_an_unfinished_stage_is_a_stage_error(tmp_path):
    with pytest.raises(q.StageError, match="is incomplete"):
        q.open_stage(tmp_path)


def test_a_write_the_os_refuses_is_an_out_error_from_the_os_error(model, tmp_path):
    """RLIMIT_FSIZE, a real kernel limit (no mount, works as root): the first large write fails."""
    code = (
        "import resource, sys, qwen35_reshard as q\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))\n"
        "try:\n"
        "    q.reshard(sys.argv[1], sys.argv[2], pp=2, write=q.WriteOptions(reflink='never'))\n"
        "except q.ReshardError as e:\n"
        "    print(type(e).__name__, type(e.__cause__).__name__)\n"
    )
    # No bytecode written: under the limit a .pyc would be cut short.
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(model), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.stdout.split() == ["OutError", "OSError"], done.stderr


def test_out_written_by_another_live_run_is_out_busy_and_retryable(model, tmp_path):
    """A live process holds a stage's claim of a split with other settings: a run refuses OUT,
    and says it may succeed later."""
    out = tmp_path / "out"
    q.reshard(model, out, pp=2)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from qwen35_reshard.write import claims\n"
            "assert claims.try_take(Path(sys.argv[1])) is None\n"
            "print('held', flush=True); sys.stdin.read()",
            str(out / "pp0" / CLAIM),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(q.OutBusy, match="is being written by another qwen35-reshard run") as e:
            q.reshard(model, out, pp=4)
        assert e.value.retryable
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
