"""Which stages a node builds (qwen35_reshard.plan.nodes): the node-to-stage mapping against
SGLang's own function and vLLM's rank layout, and the node read from every scheduler variable
set the README documents, their conflicts and their absence."""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from qwen35_reshard.errors import ReshardError
from qwen35_reshard.plan.nodes import given_node, node_from_env, node_stages

from support.helpers import ROOT as REPO

SGLANG_PYTHON = Path(
    os.environ.get("QWEN35_RESHARD_SGLANG_PYTHON") or REPO / ".venv-sglang" / "bin" / "python"
)

# (pp, nnodes) -> the stages of node 0, 1, ...
MAPPING = {
    (4, 4): [[0], [1], [2], [3]],
    (4, 2): [[0, 1], [2, 3]],
    (4, 1): [[0, 1, 2, 3]],
    (8, 2): [[0, 1, 2, 3], [4, 5, 6, 7]],
    (2, 4): [[0], [0], [1], [1]],
    (3, 6): [[0], [0], [1], [1], [2], [2]],
    (1, 2): [[0], [0]],
}


@pytest.mark.parametrize(("pp", "nnodes"), MAPPING)
def test_mapping_table(pp, nnodes):
    assert [list(node_stages(pp, nnodes, n)) for n in range(nnodes)] == MAPPING[pp, nnodes]


@pytest.mark.parametrize(("pp", "nnodes"), [(4, 3), (3, 2), (6, 4), (2, 3)])
def test_counts_that_do_not_divide_are_refused_naming_both(pp, nnodes):
    with pytest.raises(ReshardError) as e:
        node_stages(pp, nnodes, 0)
    assert f"nnodes={nnodes}" in str(e.value) and f"pp={pp}" in str(e.value)
    assert e.value.render({"nnodes": "--nnodes", "pp": "--pp"}).startswith(f"--nnodes {nnodes} and --pp {pp}")


@pytest.mark.parametrize(
    ("pp", "nnodes", "rank", "needle"),
    [
        (4, 4, 4, "node_rank=4"),
        (4, 4, -1, "node_rank=-1"),
        (4, 0, 0, "nnodes must be"),
        (0, 1, 0, "pp must be"),
    ],
)
def test_bad_counts_and_ranks(pp, nnodes, rank, needle):
    with pytest.raises(ReshardError, match=needle):
        node_stages(pp, nnodes, rank)


def _sglang_rank_ranges():
    """SGLang's own ``_calculate_rank_ranges``, its source taken from the installed engine.py
    (importing that module needs the whole server, ~30 s and GPU-side packages): it reads the
    counts through get_parallel(), given here."""
    if not SGLANG_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(
                f"no SGLang environment at {SGLANG_PYTHON} (bash .ci/sglang/build-venv.sh .venv-sglang)"
            )
        pytest.skip("no SGLang environment (QWEN35_RESHARD_SGLANG_PYTHON)")
    purelib = subprocess.run(
        [SGLANG_PYTHON, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    tree = ast.parse(Path(purelib, "sglang/srt/entrypoints/engine.py").read_text())
    (func,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_calculate_rank_ranges"]
    parallel = SimpleNamespace()
    namespace = {"get_parallel": lambda: parallel, "Tuple": tuple}
    exec(compile(ast.Module([func], []), "engine.py", "exec"), namespace)

    def ranges(pp, nnodes, tp, node):
        parallel.__dict__.update(pp_size=pp, nnodes=nnodes, tp_size=tp)
        return namespace["_calculate_rank_ranges"](node)[0]

    return ranges


def test_mapping_is_sglangs():
    sglang = _sglang_rank_ranges()
    checked = 0
    for pp in range(1, 17):
        for nnodes in range(1, 17):
            tp = max(nnodes // pp, 1) * 2  # a tensor-parallel group that spans the stage's nodes
            if pp % nnodes and nnodes % pp:
                # The servers' arithmetic leaves some stage without a node (or names one past
                # pp): why such counts are refused.
                got = [r for n in range(nnodes) for r in sglang(pp, nnodes, tp, n)]
                assert sorted(set(got)) != list(range(pp)) or len(got) % pp
                continue
            for node in range(nnodes):
                assert node_stages(pp, nnodes, node) == sglang(pp, nnodes, tp, node), (pp, nnodes, node)
                checked += 1
    assert checked > 100


def test_mapping_is_vllms_rank_layout():
    """vLLM (multiproc_executor.py, parallel_state.py): node n holds the global ranks from
    local_world_size * n, local_world_size = pp * tp / nnodes; global rank g is pipeline rank
    g // tp (TP innermost, one data-parallel replica)."""
    for pp in range(1, 9):
        for nnodes in range(1, 9):
            if pp % nnodes and nnodes % pp:
                continue
            tp = max(nnodes // pp, 1) * 2
            local = pp * tp // nnodes
            for node in range(nnodes):
                held = sorted({g // tp for g in range(local * node, local * (node + 1))})
                assert list(node_stages(pp, nnodes, node)) == held, (pp, nnodes, node)


# --------------------------------------------------------------------------- the environment

# (case, env, pp, nnodes given, expected (rank, nnodes, stages, source)): every variable set the
# README documents, as the scheduler sets it (other variables it sets beside them included).
FOUND = [
    (
        "lws",
        {"LWS_WORKER_INDEX": "2", "LWS_GROUP_SIZE": "4", "LWS_LEADER_ADDRESS": "lead.svc"},
        4,
        None,
        (2, 4, [2], "LWS_WORKER_INDEX, LWS_GROUP_SIZE"),
    ),
    (
        "lws-leader",
        {"LWS_WORKER_INDEX": "0", "LWS_GROUP_SIZE": "2"},
        4,
        None,
        (0, 2, [0, 1], "LWS_WORKER_INDEX, LWS_GROUP_SIZE"),
    ),
    (
        "lws-index-only",
        {"LWS_WORKER_INDEX": "1"},
        4,
        None,
        (1, 4, [1], "LWS_WORKER_INDEX, one node per stage of pp"),
    ),
    (
        "indexed-job",
        {"JOB_COMPLETION_INDEX": "3"},
        4,
        None,
        (3, 4, [3], "JOB_COMPLETION_INDEX, one node per stage of pp"),
    ),
    (
        "indexed-job-nnodes",
        {"JOB_COMPLETION_INDEX": "1"},
        4,
        2,
        (1, 2, [2, 3], "JOB_COMPLETION_INDEX, nnodes"),
    ),
    (
        "kubeflow",
        {"PET_NODE_RANK": "1", "PET_NNODES": "2", "PET_MASTER_ADDR": "m"},
        4,
        None,
        (1, 2, [2, 3], "PET_NODE_RANK, PET_NNODES"),
    ),
    (
        "slurm-step",
        {"SLURM_NODEID": "3", "SLURM_NNODES": "4", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3"},
        4,
        None,
        (3, 4, [3], "SLURM_NODEID, SLURM_NNODES"),
    ),
    (
        "slurm-step-pp2",
        {"SLURM_NODEID": "2", "SLURM_NNODES": "4", "SLURM_STEP_ID": "0"},
        2,
        None,
        (2, 4, [1], "SLURM_NODEID, SLURM_NNODES"),
    ),
    (
        "slurm-step-nnodes-agrees",
        {"SLURM_NODEID": "1", "SLURM_NNODES": "2", "SLURM_STEP_ID": "0"},
        4,
        2,
        (1, 2, [2, 3], "SLURM_NODEID, SLURM_NNODES"),
    ),
    (
        "slurm-one-node-batch",
        {"SLURM_NODEID": "0", "SLURM_NNODES": "1", "SLURM_JOB_ID": "7"},
        4,
        None,
        (0, 1, [0, 1, 2, 3], "SLURM_NODEID, SLURM_NNODES"),
    ),
    (
        "slurm-array",
        {
            "SLURM_ARRAY_TASK_ID": "2",
            "SLURM_ARRAY_TASK_COUNT": "4",
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_ARRAY_TASK_MIN": "0",
        },
        4,
        None,
        (2, 4, [2], "SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT"),
    ),
    (
        "slurm-array-srun",
        {
            "SLURM_ARRAY_TASK_ID": "1",
            "SLURM_ARRAY_TASK_COUNT": "4",
            "SLURM_NODEID": "0",
            "SLURM_NNODES": "1",
            "SLURM_STEP_ID": "0",
        },
        4,
        None,
        (1, 4, [1], "SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT"),
    ),
    (
        "torchrun",
        {
            "GROUP_RANK": "1",
            "WORLD_SIZE": "8",
            "LOCAL_WORLD_SIZE": "4",
            "GROUP_WORLD_SIZE": "2",
            "RANK": "5",
            "LOCAL_RANK": "1",
            "ROLE_RANK": "5",
        },
        2,
        None,
        (1, 2, [1], "GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE"),
    ),
    (
        "torchrun-no-group-world-size",
        {"GROUP_RANK": "3", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "1"},
        4,
        None,
        (3, 4, [3], "GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE"),
    ),
    ("node-rank", {"NODE_RANK": "1", "NNODES": "4"}, 4, None, (1, 4, [1], "NODE_RANK, NNODES")),
    ("node-rank-only", {"NODE_RANK": "1"}, 2, None, (1, 2, [1], "NODE_RANK, one node per stage of pp")),
    (
        "kubeflow-torchrun",
        {
            "PET_NODE_RANK": "1",
            "PET_NNODES": "2",
            "GROUP_RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "1",
        },
        2,
        None,
        (1, 2, [1], "PET_NODE_RANK, PET_NNODES, GROUP_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE"),
    ),
    (
        "indexed-job-node-rank-count",
        {"JOB_COMPLETION_INDEX": "1", "NODE_RANK": "1", "NNODES": "2"},
        4,
        None,
        (1, 2, [2, 3], "JOB_COMPLETION_INDEX, NODE_RANK, NNODES"),
    ),
]


@pytest.mark.parametrize(
    ("env", "pp", "nnodes", "expected"), [c[1:] for c in FOUND], ids=[c[0] for c in FOUND]
)
def test_node_from_env(env, pp, nnodes, expected):
    node = node_from_env(env, pp, nnodes)
    assert (node.rank, node.nnodes, list(node.stages), node.describe()) == (
        *expected[:3],
        f"rank {expected[0]} of {expected[1]} from {expected[3]}: "
        + (
            f"stage {expected[2][0]}"
            if len(expected[2]) == 1
            else f"stages {', '.join(map(str, expected[2]))}"
        ),
    )


def test_description_spells_the_callers_flags():
    node = node_from_env({"JOB_COMPLETION_INDEX": "1"}, 4)
    assert (
        node.describe({"pp": "--pp"})
        == "rank 1 of 4 from JOB_COMPLETION_INDEX, one node per stage of --pp: stage 1"
    )
    given = given_node(4, 2, 1)
    assert given.describe({"nnodes": "--nnodes", "node_rank": "--node-rank"}) == (
        "rank 1 of 2 from --nnodes, --node-rank: stages 2, 3"
    )
    assert given.to_dict() == {"rank": 1, "nnodes": 2, "stages": [2, 3], "source": "nnodes, node_rank"}


# (case, env, pp, nnodes given, what the one-line refusal must say)
REFUSED = [
    ("none", {}, 4, None, "found no node index in the environment"),
    (
        "global-rank-is-no-node",
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0"},
        4,
        None,
        "found no node index",
    ),
    (
        "lws-vs-indexed-job",
        {"LWS_WORKER_INDEX": "1", "JOB_COMPLETION_INDEX": "2"},
        4,
        None,
        "LWS_WORKER_INDEX=1 and JOB_COMPLETION_INDEX=2 disagree",
    ),
    (
        "kubeflow-vs-torchrun",
        {"PET_NODE_RANK": "0", "PET_NNODES": "2", "GROUP_RANK": "1"},
        2,
        None,
        "PET_NODE_RANK=0 PET_NNODES=2 and GROUP_RANK=1 disagree",
    ),
    (
        "counts-disagree",
        {
            "LWS_WORKER_INDEX": "1",
            "LWS_GROUP_SIZE": "4",
            "SLURM_NODEID": "1",
            "SLURM_NNODES": "2",
            "SLURM_STEP_ID": "0",
        },
        4,
        None,
        "LWS_WORKER_INDEX=1 LWS_GROUP_SIZE=4 and SLURM_NODEID=1 SLURM_NNODES=2 disagree",
    ),
    (
        "count-vs-nnodes",
        {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "4"},
        4,
        2,
        "nnodes=2 but LWS_WORKER_INDEX=1 LWS_GROUP_SIZE=4",
    ),
    (
        "batch-script",
        {"SLURM_NODEID": "0", "SLURM_NNODES": "4", "SLURM_JOB_ID": "7"},
        4,
        None,
        "SLURM_NODEID is 0 in the batch script of a job on 4 nodes",
    ),
    (
        "array-from-1",
        {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4"},
        4,
        None,
        "node index 4 is not below the node count 4",
    ),
    ("index-past-pp", {"JOB_COMPLETION_INDEX": "4"}, 4, None, "JOB_COMPLETION_INDEX=4: node index 4"),
    ("elastic", {"PET_NODE_RANK": "0", "PET_NNODES": "1:4"}, 4, None, "PET_NNODES=1:4 is an elastic range"),
    (
        "torchrun-ratio",
        {"GROUP_RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"},
        4,
        None,
        "WORLD_SIZE=6 is no multiple of LOCAL_WORLD_SIZE=4",
    ),
    (
        "torchrun-group-world-size",
        {"GROUP_RANK": "0", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "4"},
        4,
        None,
        "GROUP_WORLD_SIZE=4 disagrees",
    ),
    ("not-a-number", {"LWS_WORKER_INDEX": "x"}, 4, None, "LWS_WORKER_INDEX='x' is not a node index"),
    ("negative", {"NODE_RANK": "-1"}, 4, None, "NODE_RANK='-1' is not a node index"),
    ("empty", {"JOB_COMPLETION_INDEX": ""}, 4, None, "JOB_COMPLETION_INDEX='' is not a node index"),
    ("spaces", {"SLURM_ARRAY_TASK_ID": " 1"}, 4, None, "SLURM_ARRAY_TASK_ID=' 1' is not a node index"),
    ("non-ascii-digit", {"NODE_RANK": "\u0663"}, 4, None, "is not a node index"),
    (
        "zero-count",
        {"LWS_WORKER_INDEX": "0", "LWS_GROUP_SIZE": "0"},
        4,
        None,
        "LWS_GROUP_SIZE='0' is not a node count",
    ),
    (
        "does-not-divide",
        {"LWS_WORKER_INDEX": "0", "LWS_GROUP_SIZE": "3"},
        4,
        None,
        "nnodes=3 and pp=4 do not divide",
    ),
]


@pytest.mark.parametrize(
    ("env", "pp", "nnodes", "needle"), [c[1:] for c in REFUSED], ids=[c[0] for c in REFUSED]
)
def test_node_from_env_refuses(env, pp, nnodes, needle):
    with pytest.raises(ReshardError) as e:
        node_from_env(env, pp, nnodes)
    message = str(e.value)
    assert needle in message and "\n" not in message


def test_refusals_name_the_callers_flags():
    with pytest.raises(ReshardError) as e:
        node_from_env({}, 4)
    assert e.value.render({"ranks": "--rank", "nnodes": "--nnodes", "node_rank": "--node-rank"}).startswith(
        "--rank auto found no node index"
    )
    assert "pass --nnodes and --node-rank" in e.value.render(
        {"nnodes": "--nnodes", "node_rank": "--node-rank"}
    )
