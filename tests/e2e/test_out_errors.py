"""OS errors on OUT (issue 10): one ``error:`` line naming the path and the cause, exit 2, and
OUT left exactly as it was (no empty ``pp*`` folders, no run marker) by a run that could not
start. Real conditions only: a file where a directory should be, a real read-only mount (a
tmpfs in a private mount namespace, as the full-disk tests use), a directory the (unprivileged)
user may not write, a name longer than the filesystem allows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from support.helpers import ROOT, mount_namespace, one_error_line, tree


def command(model: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "qwen35_reshard", "--pp", "2", str(model), str(out)]


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, **kw)


def test_out_under_a_file(make_checkpoint, tmp_path):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "deeper" / "out"
    model = make_checkpoint()
    line = one_error_line(run(command(model, out)))
    assert f"OUT {out} cannot be created: {tmp_path / 'afile'} is not a directory" in line
    assert tree(tmp_path) == {"afile": b"x"}
    # The preview refuses the same way.
    plan = run([sys.executable, "-m", "qwen35_reshard", "plan", "--pp", "2", str(model), str(out)])
    assert plan.returncode == 2 and one_error_line(plan) == line


def test_out_name_too_long(make_checkpoint, tmp_path):
    out = tmp_path / "new" / ("x" * 300)
    line = one_error_line(run(command(make_checkpoint(), out)))
    assert "File name too long" in line and "x" * 300 in line
    assert tree(tmp_path) == {}, "the parent created on the way was left behind"


@pytest.mark.root  # a tmpfs mounted in a private mount namespace
def test_out_on_a_read_only_filesystem(make_checkpoint, tmp_path):
    prefix = mount_namespace(tmp_path / "probe")
    if prefix is None:
        pytest.skip("cannot mount a tmpfs here (needs root or unprivileged user namespaces)")
    mnt = tmp_path / "ro"
    mnt.mkdir()
    model = make_checkpoint()
    script = (
        "import subprocess, sys, json\n"
        f"subprocess.run(['mount', '-t', 'tmpfs', '-o', 'ro,size=1m', 'tmpfs', {str(mnt)!r}], check=True)\n"
        f"r = subprocess.run({command(model, mnt / 'out')!r}, capture_output=True, text=True)\n"
        f"r2 = subprocess.run({command(model, mnt)!r}, capture_output=True, text=True)\n"
        f"import os; left = os.listdir({str(mnt)!r})\n"
        "print(json.dumps([r.returncode, r.stdout, r.stderr, r2.returncode, r2.stdout, r2.stderr, left]))\n"
    )
    p = run([*prefix, sys.executable, "-c", script])
    assert p.returncode == 0, p.stderr
    rc, stdout, stderr, rc2, stdout2, stderr2, left = json.loads(p.stdout)
    for code, o, e, where in ((rc, stdout, stderr, mnt / "out"), (rc2, stdout2, stderr2, mnt)):
        line = one_error_line(subprocess.CompletedProcess([], code, o, e))
        assert str(where) in line and "Read-only file system" in line
    assert left == []


def test_out_without_write_permission(make_checkpoint):
    """As an unprivileged user (root may write anywhere): permission denied, OUT unchanged."""
    base = Path(tempfile.mkdtemp(prefix="qwen35-reshard-perm-"))
    try:
        model = base / "model"
        shutil.copytree(make_checkpoint(), model)
        locked = base / "locked"
        locked.mkdir()
        os.chmod(base, 0o755)
        for p in base.rglob("*"):
            os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.chmod(locked, 0o555)
        drop = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] if os.geteuid() == 0 else []
        if drop and shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: cannot lose the right to write")
        for out in (locked / "out", locked):
            line = one_error_line(run([*drop, *command(model, out)], cwd=base))
            assert str(out) in line and "Permission denied" in line
            assert tree(locked) == {}
    finally:
        shutil.rmtree(base)


def test_a_stage_directory_replaced_by_a_file(make_checkpoint, tmp_path):
    """OUT/pp1 is a plain file now: the preview and the run answer in one line each, no traceback."""
    model, out = make_checkpoint(), tmp_path / "out"
    assert run(command(model, out)).returncode == 0
    shutil.rmtree(out / "pp1")
    (out / "pp1").write_text("not a stage")
    plan = run([sys.executable, "-m", "qwen35_reshard", "plan", "--pp", "2", str(model), str(out)])
    assert plan.returncode == 0 and "Traceback" not in plan.stderr, plan.stderr
    line = one_error_line(run(command(model, out)))
    assert str(out / "pp1") in line
