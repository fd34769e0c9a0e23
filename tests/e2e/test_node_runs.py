"""A run that builds one node's stages: the library's ``ranks="auto"`` / ``nnodes`` and
``node_rank``, and the command line's ``--rank auto`` and ``--nnodes N --node-rank R`` in a real
process with the scheduler's variables in its environment: what it builds, says and prints as
this node's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qwen35_reshard import Nodes, ReshardError, ReshardProgress, reshard

from support.helpers import lone_error_line

# Real runs of the command with a scheduler's variables in their environment.
pytestmark = pytest.mark.slow

# Every variable plan.nodes reads: cleared from the tests' own environment (they may run under
# a scheduler), then set per case.
SCHEDULER_VARS = (
    "LWS_WORKER_INDEX", "LWS_GROUP_SIZE", "JOB_COMPLETION_INDEX", "PET_NODE_RANK", "PET_NNODES",
    "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_NODEID", "SLURM_NNODES", "SLURM_STEP_ID",
    "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "NODE_RANK", "NNODES",
)  # fmt: skip


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in SCHEDULER_VARS}
    return subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def stages_in(out: Path) -> list[str]:
    return sorted(p.parent.name for p in out.glob("pp*/model.safetensors.index.json"))


@pytest.fixture(scope="module")
def model(make_checkpoint) -> Path:
    return make_checkpoint()


def test_rank_auto_builds_this_nodes_stage_and_prints_its_launch_line(model, tmp_path):
    out = tmp_path / "my out"
    p = cli(
        "--pp",
        "4",
        "--rank",
        "auto",
        str(model),
        str(out),
        env={"LWS_WORKER_INDEX": "2", "LWS_GROUP_SIZE": "4"},
    )
    assert p.returncode == 0, p.stderr
    assert "rank 2 of 4 from LWS_WORKER_INDEX, LWS_GROUP_SIZE: stage 2" in p.stderr.splitlines()
    assert stages_in(out) == ["pp2"]
    assert "Launch this node (rank 2 of 4)" in p.stdout
    assert f"--model-path '{out}/pp2' --pp-size 4 --nnodes 4 --node-rank 2 " in p.stdout


def test_nnodes_and_node_rank_build_that_nodes_stages(model, tmp_path):
    """Two nodes for four stages (SGLang's mapping): node 1 runs pp2 and pp3, and is told to
    serve OUT through the SGLang plugin (not the unsplit checkpoint); the plan table says the
    other stages are not this node's, not that --rank (not given) left them out."""
    out = tmp_path / "out"
    p = cli("--pp", "4", "--nnodes", "2", "--node-rank", "1", str(model), str(out))
    assert p.returncode == 0, p.stderr
    assert "rank 1 of 2 from --nnodes, --node-rank: stages 2, 3" in p.stderr.splitlines()
    assert stages_in(out) == ["pp2", "pp3"]
    assert f"--model-path {out} --pp-size 4 --nnodes 2 --node-rank 1 " in p.stdout
    plugin = f"this node runs pp2, pp3 from {out}, each pipeline rank's stage loaded by qwen35-reshard's"
    assert plugin in p.stdout
    assert "unsplit" not in p.stdout and "--rank" not in p.stdout
    assert "build no: this node (rank 1 of 2) does not run it" in p.stdout


def test_two_nodes_per_stage(model, tmp_path):
    out = tmp_path / "out"
    p = cli(
        "--pp",
        "2",
        "--rank",
        "auto",
        str(model),
        str(out),
        env={"JOB_COMPLETION_INDEX": "3"},
    )
    # No node count from an Indexed Job: one node per stage, so index 3 of pp 2 is refused...
    assert "JOB_COMPLETION_INDEX=3: node index 3 is not below the node count 2" in lone_error_line(p)
    assert not out.exists()
    # ... and with the count given, nodes 2 and 3 share stage 1.
    p = cli(
        "--pp",
        "2",
        "--rank",
        "auto",
        "--nnodes",
        "4",
        str(model),
        str(out),
        env={"JOB_COMPLETION_INDEX": "3"},
    )
    assert p.returncode == 0, p.stderr
    assert "rank 3 of 4 from JOB_COMPLETION_INDEX, --nnodes: stage 1" in p.stderr.splitlines()
    assert stages_in(out) == ["pp1"]


def test_vllm_node_is_told_to_serve_out_with_its_load_format(make_checkpoint, tmp_path):
    model = make_checkpoint(full_attention_interval=1)
    out = tmp_path / "out"
    p = cli("--pp", "4", "--runtime", "vllm", "--rank", "auto", str(model), str(out), "--json",
            env={"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0"})  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert stages_in(out) == ["pp2", "pp3"]
    assert (
        f"vllm serve {out} --load-format qwen35-stages --pipeline-parallel-size 4 "
        "--distributed-executor-backend mp --nnodes 2 --node-rank 1 --master-addr HEAD_IP --headless"
    ) in p.stderr.replace("\n", " ")
    node = json.loads(p.stdout)["node"]
    assert node == {"rank": 1, "nnodes": 2, "stages": [2, 3], "source": "SLURM_NODEID, SLURM_NNODES"}


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (("--rank", "auto"), {}, "error: --rank auto found no node index in the environment"),
        (("--rank", "auto"), {"LWS_WORKER_INDEX": "1", "NODE_RANK": "2"}, "=1 and NODE_RANK=2 disagree"),
        (("--rank", "auto"), {"SLURM_NODEID": "0", "SLURM_NNODES": "4"}, "batch script of a job on 4 nodes"),
        (("--nnodes", "3", "--node-rank", "0"), {}, "error: --nnodes 3 and --pp 4 do not divide"),
        (("--nnodes", "4", "--node-rank", "4"), {}, "error: --node-rank 4 is not a node of --nnodes 4"),
        (("--nnodes", "4"), {}, "--nnodes and --node-rank go together"),
        (("--rank", "auto", "--node-rank", "1"), {"NODE_RANK": "1"}, "drop --node-rank"),
        (("--rank", "1", "--nnodes", "2", "--node-rank", "1"), {}, "drop --nnodes and --node-rank"),
        (("--rank", "auto", "--rank", "1"), {"NODE_RANK": "1"}, "'--rank': auto is no stage number"),
        (("--rank", "auto", "--nnodes", "2"), {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "4"},
         "--nnodes 2 but LWS_WORKER_INDEX=1 LWS_GROUP_SIZE=4"),
    ],
    ids=["none", "disagree", "batch-script", "divide", "out-of-range", "alone", "auto-and-node-rank",
         "rank-and-nodes", "auto-among-ranks", "nnodes-vs-env"],
)  # fmt: skip
def test_refused_in_one_line_writing_nothing(model, tmp_path, args, env, needle):
    out = tmp_path / "out"
    assert needle in lone_error_line(cli("--pp", "4", *args, str(model), str(out), env=env))
    assert not out.exists()


# --------------------------------------------------------------------------- the library


class Located(ReshardProgress):
    def __init__(self):
        self.events = []

    def located(self, node):
        self.events.append(("located", node.describe()))

    def planned(self, plan, choice):
        self.events.append(("planned", plan.ranks))


def test_library_reads_the_env_it_is_given(model, tmp_path):
    """ranks="auto" reads the mapping passed as env (not this process's environment), says so
    before the checkpoint is read, and builds that node's stages."""
    events = Located()
    env = {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_NODEID": "0"}
    result = reshard(model, tmp_path / "out", pp=4, ranks="auto", node=Nodes(env=env), progress=events)
    assert events.events == [
        ("located", "rank 1 of 2 from SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT: stages 2, 3"),
        ("planned", (2, 3)),
    ]
    assert result.written.built == [2, 3] and stages_in(tmp_path / "out") == ["pp2", "pp3"]
    assert result.to_dict()["node"] == {
        "rank": 1, "nnodes": 2, "stages": [2, 3], "source": "SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT",
    }  # fmt: skip
    given = reshard(model, None, pp=4, node=Nodes(nnodes=4, node_rank=3), dry_run=True)
    assert list(given.plan.ranks) == [3] and given.node.to_dict()["source"] == "nnodes, node_rank"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks": "auto", "node": Nodes(env={})}, "ranks='auto' found no node index in the environment"),
        ({"ranks": "auto", "node": Nodes(node_rank=1, env={"NODE_RANK": "1"})}, "drop node_rank"),
        ({"ranks": "some", "node": Nodes(env={})}, "ranks='some' must be stage numbers or 'auto'"),
        (
            {"ranks": [1], "node": Nodes(nnodes=2, node_rank=1)},
            "ranks picks the stages itself: drop nnodes and node_rank",
        ),
        ({"node": Nodes(node_rank=1)}, "nnodes and node_rank go together"),
        ({"node": Nodes(nnodes=3, node_rank=0)}, "nnodes=3 and pp=4 do not divide"),
    ],
)
def test_library_errors_name_its_parameters(model, kwargs, message):
    with pytest.raises(ReshardError, match=message) as e:
        reshard(model, None, pp=4, dry_run=True, **kwargs)
    assert "--" not in str(e.value)
