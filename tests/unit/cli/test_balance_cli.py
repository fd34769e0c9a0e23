"""``--partition balanced`` on the command line: the chosen split recorded and built like an
explicit one, the comparison with the runtime's default, capacity mode's options and their errors.

The expected splits come from the library (tests/unit/plan/test_balance.py checks those against an
independent brute force); here the CLI must pass them through unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from qwen35_reshard import read_checkpoint
from qwen35_reshard.plan.balance import choose
from qwen35_reshard.plan.capacity import Capacity

from support.checkpoints import SMALL
from support.checks import check_split
from support.helpers import CLI, run_cli

# --------------------------------------------------------------------------- the command line


def test_cli_balanced_split_is_recorded_like_an_explicit_one(ref, make_checkpoint, tmp_path):
    model = make_checkpoint(**SMALL["untied"])
    expected = list(choose(read_checkpoint(model), pp=3, runtime="sglang").partition)
    default = ref.split(32, 3, "sglang")
    assert expected != default  # MTP on the last stage: the even split is not the best
    out = tmp_path / "out"
    proc = run_cli("--pp", 3, "--partition", "balanced", "--json", model, out)
    summary = json.loads(proc.stdout)
    assert summary["partition"] == expected and summary["launch_env"] == ref.launch_env("sglang", expected)
    assert summary["balanced"]["partition"] == expected and summary["balanced"]["default"] == default
    assert not summary["balanced"]["default_optimal"]
    assert ref.launch_env("sglang", expected) in proc.stderr
    assert f"default split {','.join(map(str, default))}: fullest" in proc.stderr
    check_split(ref, model, out, pp=3, partition=expected)
    assert "verify OK" in run_cli("verify", out, "--source", model).stdout
    # Each node builds its own stage of the same split, with no coordinator.
    node = tmp_path / "node"
    run_cli("--pp", 3, "--partition", "balanced", "--rank", 1, model, node)
    check_split(ref, model, node, pp=3, partition=expected, ranks=[1])


def test_cli_says_when_the_default_is_already_optimal(make_checkpoint):
    model = make_checkpoint(**SMALL["untied"])
    ckpt = read_checkpoint(model)
    pp = next(p for p in range(2, 9) if choose(ckpt, pp=p, runtime="vllm", keep_mtp=False).default_optimal)
    proc = run_cli("plan", "--pp", pp, "--runtime", "vllm", "--no-mtp", "--partition", "balanced", model)
    assert "is already optimal" in proc.stdout


def test_cli_capacity_mode(make_checkpoint):
    model = make_checkpoint(**SMALL["fp8_big_vocab"])
    ckpt = read_checkpoint(model)
    weights = max(s.total_bytes for s in choose(ckpt, pp=3, runtime="sglang").stages)
    args = ["--gpu-memory", f"{2 * weights}B", "--tp", "2", "--context-length", "64", "--mem-fraction", "0.8"]
    proc = run_cli("plan", "--pp", 3, "--partition", "balanced", *args, "--json", model)
    got = json.loads(proc.stdout)["balanced"]
    expected = choose(ckpt, pp=3, runtime="sglang", capacity=Capacity(2 * weights, 0.8, 2, 64))
    assert got["partition"] == list(expected.partition)
    assert [s["requests"] for s in got["stages"]] == [s.requests for s in expected.stages]
    assert got["capacity"]["budget_bytes"] == int(2 * weights * 0.8) and got["capacity"]["tp"] == 2
    assert "requests" in proc.stderr and "limits the requests" in proc.stderr


@pytest.mark.parametrize(
    ("text_config", "needle"),
    [
        ({"mtp_num_hidden_layers": None}, None),  # what the schema takes it for: the default, 1
        ({"mtp_num_hidden_layers": "1"}, "mtp_num_hidden_layers must be a non-negative integer, got '1'"),
        ({"mtp_num_hidden_layers": -1}, "mtp_num_hidden_layers must be a non-negative integer, got -1"),
    ],
)
def test_cli_capacity_mode_reads_the_mtp_layer_count_as_the_schema_does(
    make_checkpoint, tmp_path, text_config, needle
):
    """The MTP draft's layer count sizes the last stage's KV cache: an odd value in config.json
    is read as the schema reads it (null: the default) or refused in one line, never a traceback."""
    model = make_checkpoint(fresh=True, **SMALL["untied"])
    config = json.loads((model / "config.json").read_text())
    config["text_config"].update(text_config)
    (model / "config.json").write_text(json.dumps(config))
    args = ["--pp", "3", "--partition", "balanced", "--gpu-memory", "80GB", "--context-length", "64"]
    proc = run_cli("plan", *args, "--json", model, check=False)
    assert "Traceback" not in proc.stderr
    if needle is None:
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["balanced"]["capacity"]["draft_layers"] == 1
    else:
        assert proc.returncode == 2 and needle in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--pp", "3", "--gpu-memory", "80GB", "--context-length", "4096"], "add --partition balanced"),
        (
            ["--pp", "3", "--partition", "balanced", "--tp", "2"],
            "--tp sizes capacity mode: it needs --gpu-memory",
        ),
        (["--pp", "3", "--partition", "balanced", "--gpu-memory", "80GB"], "needs --context-length"),
        (["--pp", "9", "--partition", "balanced", "--runtime", "vllm"], "can be served by vllm"),
        (
            ["--pp", "3", "--partition", "balanced", "--gpu-memory", "80GB", "--context-length", "64"]
            + ["--mem-fraction", "1.5"],
            "--mem-fraction must be in (0, 1], got 1.5",
        ),
        (
            ["--pp", "3", "--partition", "balanced", "--gpu-memory", "80GB", "--context-length", "0"],
            "--context-length must be at least 1, got 0",
        ),
    ],
)
def test_cli_balanced_bad_arguments(make_checkpoint, tmp_path, args, needle):
    model = make_checkpoint(**SMALL["untied"])  # 8 full-attention layers of 32
    proc = run_cli(*args, model, tmp_path / "out", check=False)
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the 397B-shaped checkpoint (~189,000 tensors)
def test_cli_tables_fit_80_columns_on_the_397b_fp8_shape(fixture_397b):
    """The issue's largest case, pp=16 in capacity mode, printed on a wide terminal (no
    wrapping): every line of the balanced table and its verdict fits 80 columns; every stage
    has its row, the last one marked as the one that limits the requests."""
    ckpt, _ = fixture_397b
    args = ["--pp", "16", "--partition", "balanced", "--gpu-memory", "80GB", "--tp", "8"]
    args += ["--context-length", "262144", "--json", str(ckpt.root)]
    env = {**os.environ, "COLUMNS": "200"}
    proc = subprocess.run([CLI, "plan", *args], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    table = proc.stderr.split("--partition balanced (")[1].split("\ndry run:")[0].splitlines()
    stages = [line.split()[0] for line in table if line.startswith("pp")]
    assert stages == [f"pp{r}" for r in range(15)] + ["pp15*"]
    wide = [line for line in table if len(line.rstrip()) > 80]
    assert len(table) > 20 and not wide, "\n".join(wide)
    # The vision column holds every vision role a stage has (SGLang may place pos_embed apart).
    vision = [line.split()[7] for line in table if line.startswith("pp")]
    parts = [s["parts"] for s in json.loads(proc.stdout)["balanced"]["stages"]]
    expected = [sum(n for kind, n in p.items() if kind.startswith("visual")) for p in parts]
    assert vision == [f"{n / 1e9:.2f}" if n else "-" for n in expected] and expected[0] > 0
