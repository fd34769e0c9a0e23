"""Every node builds its own stage, on a real Slurm cluster: Debian's slurmctld, munge and four
slurmd emulating four nodes on this machine (``.ci/slurm/start.sh``), so every task sees the
SLURM_* variables Slurm itself sets. All nodes write into one OUT (this machine's filesystem is
the storage they share), which must then be what one sequential run builds, byte for byte.

The cluster starts once per session, when the tests run as root and Slurm is installed
(``bash .ci/slurm/install.sh``; ``.ci/run`` does both). Otherwise they are skipped, except under
``CI=true``, where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.helpers import ROOT as REPO
from support.helpers import digests

# A real Slurm cluster of four emulated nodes: its daemons run as root.
pytestmark = [pytest.mark.slow, pytest.mark.root]

CI_DIR = REPO / ".ci" / "slurm"
CLUSTER_DIR = Path(os.environ.get("QWEN35_SLURM_DIR", "/tmp/qwen35-reshard-slurm"))
NEEDED = ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/srun", "/usr/bin/sbatch")
CLI = str(Path(sys.executable).parent / "qwen35-reshard")
NODES = 4
STEP_TIMEOUT = 120


@dataclass(frozen=True)
class Cluster:
    env: dict[str, str]
    startup: str  # start.sh's line: how long the four nodes took to come up

    def run(self, *args: str, cwd: Path) -> subprocess.CompletedProcess:
        """A Slurm client command (srun, sbatch) against this cluster; its output captured."""
        return subprocess.run(
            args, env=self.env, cwd=cwd, capture_output=True, text=True, timeout=STEP_TIMEOUT
        )


@pytest.fixture(scope="session")
def slurm() -> Cluster:
    missing = [exe for exe in NEEDED if not Path(exe).exists()]
    if os.geteuid() != 0 or missing:
        why = "the test cluster's daemons run as root" if os.geteuid() else f"{', '.join(missing)} missing"
        if os.environ.get("CI") == "true":
            pytest.fail(f"the Slurm tests must run in CI: {why} (.ci/run installs Slurm and runs as root)")
        pytest.skip(f"no Slurm test cluster: {why} (bash .ci/slurm/install.sh, as root)")
    env = {**os.environ, "QWEN35_SLURM_DIR": str(CLUSTER_DIR)}
    started = subprocess.run(
        ["bash", str(CI_DIR / "start.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    try:
        assert started.returncode == 0, f"the Slurm test cluster did not start:\n{started.stderr}"
        env["SLURM_CONF"] = str(CLUSTER_DIR / "etc" / "slurm.conf")
        print(started.stdout.strip(), file=sys.stderr)
        yield Cluster(env, started.stdout.strip())
    finally:
        subprocess.run(["bash", str(CI_DIR / "stop.sh")], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory) -> Path:
    return Path(tiny.build_checkpoint(tmp_path_factory.mktemp("slurm-model") / "model"))


def sequential(model: Path, out: Path, pp: int) -> dict[str, str]:
    """What one plain run builds: the bytes every cluster run must match."""
    p = subprocess.run(
        [CLI, "--pp", str(pp), str(model), str(out)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    return digests(out)


def verify_source(out: Path, model: Path) -> None:
    p = subprocess.run(
        [CLI, "verify", str(out), "--source", str(model)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr


def task_errors(logs: Path) -> str:
    return "".join(f.read_text() for f in sorted(logs.glob("*.err")))


def assert_built(p: subprocess.CompletedProcess, logs: Path, model: Path, out: Path, pp: int) -> None:
    """The step or job ended well, and OUT verifies against the source and holds exactly what
    one sequential run builds."""
    assert p.returncode == 0, p.stderr + task_errors(logs)
    verify_source(out, model)
    assert digests(out) == sequential(model, out.parent / "sequential", pp)


def srun(slurm: Cluster, logs: Path, *command: str) -> subprocess.CompletedProcess:
    """``command`` as one task on each of the four nodes; each task's stderr in logs/N.err,
    N being the task's node (Slurm's %n)."""
    logs.mkdir(exist_ok=True)
    return slurm.run(
        "srun", f"-N{NODES}", "--ntasks-per-node=1", f"--output={logs}/%n.out", f"--error={logs}/%n.err",
        *command, cwd=logs,
    )  # fmt: skip


def node_lines(logs: Path) -> dict[int, str]:
    """Each node's stderr line saying which node it is and what it builds."""
    found = {}
    for n in range(NODES):
        text = (logs / f"{n}.err").read_text()
        lines = [line for line in text.splitlines() if re.match(r"rank \d+ of \d+ from ", line)]
        assert len(lines) == 1, text
        found[n] = lines[0]
    return found


def test_srun_one_stage_per_node(slurm, model, tmp_path):
    """srun -N4 --ntasks-per-node=1 qwen35-reshard --pp 4 --rank auto: node n builds stage n
    (from SLURM_NODEID and SLURM_NNODES), all exit 0, OUT verifies against the source and is
    byte-identical to a sequential build."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    started = time.monotonic()
    p = srun(slurm, logs, CLI, "--pp", "4", "--rank", "auto", str(model), str(out))
    seconds = time.monotonic() - started
    assert_built(p, logs, model, out, 4)
    assert node_lines(logs) == {
        n: f"rank {n} of 4 from SLURM_NODEID, SLURM_NNODES: stage {n}" for n in range(4)
    }
    print(f"srun -N4 --pp 4 --rank auto: {seconds:.1f} s ({slurm.startup})", file=sys.stderr)


def test_sbatch_array_into_one_out(slurm, model, tmp_path):
    """sbatch --array=0-3 --wait: each array task builds the stage of its SLURM_ARRAY_TASK_ID
    (SLURM_NODEID is 0 in all of them), wherever it lands, into one OUT."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    p = slurm.run(
        "sbatch", "--array=0-3", "--wait", f"--output={logs}/%a.out", f"--error={logs}/%a.err",
        f"--wrap={CLI} --pp 4 --rank auto {model} {out}", cwd=logs,
    )  # fmt: skip
    assert_built(p, logs, model, out, 4)
    assert node_lines(logs) == {
        n: f"rank {n} of 4 from SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT: stage {n}" for n in range(4)
    }


def test_two_nodes_per_stage(slurm, model, tmp_path):
    """--pp 2 on four nodes (a tensor-parallel group across two nodes, as SGLang and vLLM map
    it): nodes 0 and 1 both build stage 0, nodes 2 and 3 stage 1, into the same OUT at once."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    p = srun(slurm, logs, CLI, "--pp", "2", "--rank", "auto", str(model), str(out))
    assert_built(p, logs, model, out, 2)
    assert node_lines(logs) == {
        n: f"rank {n} of 4 from SLURM_NODEID, SLURM_NNODES: stage {n // 2}" for n in range(4)
    }


def test_broken_checkpoint_fails_every_task_in_one_line(slurm, model, tmp_path):
    """A checkpoint whose index is cut short: the step fails, and each node's task says so in
    one error: line (its last), no traceback; nothing in OUT looks like a finished split."""
    broken = Path(shutil.copytree(model, tmp_path / "broken"))
    index = broken / "model.safetensors.index.json"
    index.write_text(index.read_text()[:-100])
    out, logs = tmp_path / "out", tmp_path / "logs"
    p = srun(slurm, logs, CLI, "--pp", "4", "--rank", "auto", str(broken), str(out))
    assert p.returncode != 0
    for n in range(NODES):
        err = (logs / f"{n}.err").read_text()
        lines = err.rstrip("\n").splitlines()
        assert [line for line in lines if line.startswith("error:")] == [lines[-1]], err
        assert "model.safetensors.index.json" in lines[-1] and "Traceback" not in err, err
    assert not (out / "reshard.json").exists() and not list(out.glob("pp*/model.safetensors.index.json"))


# Runs the command line in sys.argv[3:] as qwen35-reshard; on node sys.argv[1] it SIGKILLs
# itself just before it renames (or links) its first finished stage data file into place (audit hooks run
# before the operation): a task killed mid-run at an exact step while the others go on.
KILLED_ON_NODE = """\
import os, runpy, signal, sys
node, stage = sys.argv[1], sys.argv[2]
def hook(event, args):
    if event in ("os.rename", "os.link"):
        target = str(args[1])
        if f"/{stage}/" in target and target.endswith(".safetensors"):
            os.kill(os.getpid(), signal.SIGKILL)
if os.environ["SLURM_NODEID"] == node:
    sys.addaudithook(hook)
sys.argv = ["qwen35-reshard", *sys.argv[3:]]
runpy.run_module("qwen35_reshard", run_name="__main__")
"""


def test_a_task_killed_mid_run_then_the_step_again(slurm, model, tmp_path):
    """SIGKILL of node 2's task as it finishes its first data file: the step fails, the other
    nodes' stages are complete, and running the same step again completes OUT."""
    out, logs = tmp_path / "out", tmp_path / "logs"
    killer = tmp_path / "killed_on_node.py"
    killer.write_text(KILLED_ON_NODE)
    args = ("--pp", "4", "--rank", "auto", str(model), str(out))
    p = srun(slurm, logs, sys.executable, str(killer), "2", "pp2", *args)
    assert p.returncode != 0
    assert "Killed" in p.stderr or "signal 9" in p.stderr or "exit code 137" in p.stderr, p.stderr
    for n in (0, 1, 3):
        assert (out / f"pp{n}" / "model.safetensors.index.json").exists(), (logs / f"{n}.err").read_text()
    assert not (out / "pp2" / "model.safetensors.index.json").exists()
    again = srun(slurm, tmp_path / "logs-again", CLI, *args)
    assert_built(again, tmp_path / "logs-again", model, out, 4)


# Stands in for the server on PATH: records, per node, the command line each task ran.
FAKE_PYTHON3 = """#!/bin/sh
echo "$SLURMD_NODENAME $*" > "$RECORD/$SLURM_NODEID"
"""


def test_the_docs_sbatch_script_as_written(slurm, model, tmp_path):
    """docs/clusters.md's Slurm script, run by sbatch with only MODEL and OUT changed and the server's
    `python3` replaced by one that records its arguments: step 1 builds every node's stage,
    step 2 starts on each node the server on that node's own stage with its own --node-rank
    (expanded in each task, not once in the batch shell)."""
    page = (REPO / "docs" / "clusters.md").read_text()
    (script,) = [b for b in re.findall(r"```\n(.*?)```", page, re.S) if "#SBATCH --nodes=4" in b]
    out = tmp_path / "out"
    script = re.sub(r"(?m)^MODEL=\S+", f"MODEL={model}", script)
    script = re.sub(r"(?m)^OUT=\S+", f"OUT={out}", script)
    (tmp_path / "serve.sbatch").write_text(script)
    fake, record = tmp_path / "bin", tmp_path / "record"
    fake.mkdir()
    record.mkdir()
    (fake / "python3").write_text(FAKE_PYTHON3)
    (fake / "python3").chmod(0o755)
    env = {**slurm.env, "PATH": f"{fake}:{Path(CLI).parent}:{os.environ['PATH']}", "RECORD": str(record)}
    p = subprocess.run(
        ["sbatch", "--wait", f"--output={tmp_path}/job.err", str(tmp_path / "serve.sbatch")],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=STEP_TIMEOUT,
    )  # fmt: skip
    assert_built(p, tmp_path, model, out, 4)
    for n in range(NODES):
        line = (record / str(n)).read_text().strip()
        assert line == (
            f"n{n} -m sglang.launch_server --model-path {out}/pp{n} --pp-size 4 --tp-size 8 --nnodes 4 "
            f"--node-rank {n} --dist-init-addr n0:5000"
        ), line


def test_start_over_an_earlier_clusters_leftovers(slurm, tmp_path):
    """start.sh where an earlier run's cluster still runs (a test session killed before its
    teardown), with a job in it: that cluster's daemons are stopped by their pids, its jobs
    cancelled and forgotten, and four idle nodes come up again. Runs last: it restarts the
    session's cluster."""
    job = slurm.run("sbatch", "--parsable", "-N2", "--wrap", "sleep 300", cwd=tmp_path)
    assert job.returncode == 0, job.stderr
    old = {f.name: int(f.read_text()) for f in (CLUSTER_DIR / "run").glob("*.pid")}
    assert len(old) == NODES + 1, old  # slurmctld and four slurmd
    again = subprocess.run(
        ["bash", str(CI_DIR / "start.sh")], env=slurm.env, capture_output=True, text=True, timeout=120
    )
    assert again.returncode == 0, again.stderr
    print(again.stdout.strip(), "(over a running cluster)", file=sys.stderr)
    for name, pid in old.items():
        assert (
            not Path(f"/proc/{pid}").exists()
            or f"{CLUSTER_DIR}" not in Path(f"/proc/{pid}/cmdline").read_text()
        ), name
    assert slurm.run("squeue", "-h", "-o", "%i", cwd=tmp_path).stdout.strip() == ""
    p = srun(slurm, tmp_path / "logs", "true")
    assert p.returncode == 0, p.stderr
