"""The launch commands the tool prints after a split are the ones docs/deploy.md recommends,
stated once there: for each server, one machine and several nodes (one stage per node, several
stages per node), whole splits and node runs. The docs' commands are written for OUT
``/models/q35-pp4`` and partition ``15,15,15,15``; a split of the tiny model at ``--pp 4`` into
an OUT of that name prints ``2,2,2,2``, so the docs' lines are read with that substitution (and
a node's number for ``$R``)."""

from __future__ import annotations

import re

import pytest

from qwen35_reshard.cli import main

from support.helpers import ROOT

DOCS_OUT, DOCS_PARTITION = "/models/q35-pp4", "15,15,15,15"
SERVERS = ("vllm serve", "sglang.launch_server")


def docs_commands() -> list[str]:
    """The launch commands in deploy.md's code blocks, each on one line (as the shell reads a
    line continued with a backslash)."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    blocks = [b.replace(" \\\n    ", " ") for b in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)]
    lines = [line for block in blocks for line in block.splitlines()]
    return [line for line in lines if any(s in line for s in SERVERS) and not line.startswith("#")]


def printed_commands(capsys, *args) -> list[str]:
    assert main([str(a) for a in args]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  ")]
    return [line.strip() for line in lines if any(s in line for s in SERVERS)]


def as_docs(line: str, out: str, partition: str) -> str:
    return line.replace(out, DOCS_OUT).replace(partition, DOCS_PARTITION)


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint(full_attention_interval=1)  # vLLM serves any split of it


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
def test_a_split_prints_the_docs_commands(runtime, model, tmp_path, capsys):
    out = str(tmp_path / "q35-pp4")
    printed = printed_commands(capsys, "--pp", 4, "--runtime", runtime, model, out)
    docs = docs_commands()
    # One machine, and one stage per node: the head's and the others' for vLLM.
    assert len(printed) == (3 if runtime == "vllm" else 2), printed
    for line in printed:
        assert as_docs(line, out, "2,2,2,2") in docs, (line, docs)


@pytest.mark.parametrize(
    ("runtime", "nnodes", "rank"),
    [("sglang", 4, 1), ("sglang", 2, 1), ("vllm", 4, 0), ("vllm", 4, 2)],
)
def test_a_node_run_prints_the_docs_command_for_its_node(runtime, nnodes, rank, model, tmp_path, capsys):
    out = str(tmp_path / "q35-pp4")
    args = ("--pp", 4, "--runtime", runtime, "--nnodes", nnodes, "--node-rank", rank, model, out)
    printed = printed_commands(capsys, *args)
    docs = [line.replace("$R", str(rank)) for line in docs_commands()]
    assert len(printed) == 1, printed
    assert as_docs(printed[0], out, "2,2,2,2") in docs, (printed, docs)
    if nnodes < 4 and runtime == "sglang":  # several stages on the node: OUT itself, the plugin
        assert f"--model-path {out} " in printed[0]
