"""Expert-parallel splits end to end (issue 42): ``--ep E --nodes N`` writes one directory per
node whose every tensor is the source's bytes (an expert of a fused tensor: its slice, cut here
by torch, not by the tool's offsets); nodes built apart (``--node``, ``--node auto``) and at once
into one OUT make the same split; verify names a node's missing expert."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qwen35_reshard import Parallelism, make_plan, read_checkpoint, repair, write_plan
from qwen35_reshard.cli import main
from qwen35_reshard.model.experts import expert_placement, expert_tensor
from qwen35_reshard.plan.layout import layout_files
from qwen35_reshard.verify import verify

from support.helpers import ROOT
from support.hub_server import HubServer

SCHEDULER_VARS = ("LWS_WORKER_INDEX", "JOB_COMPLETION_INDEX", "PET_NODE_RANK", "SLURM_ARRAY_TASK_ID",
                  "SLURM_NODEID", "GROUP_RANK", "NODE_RANK", "NNODES")  # fmt: skip


def source_tensors(model: Path) -> dict[str, torch.Tensor]:
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index.values())):
        out.update(load_file(model / file))
    return out


def expected(source: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The source's tensor ``name``, or the slice of the fused tensor an expert is cut from."""
    if name in source:
        return source[name]
    w = expert_tensor(name)
    layer_prefix, _, _ = name.partition(f"mlp.experts.{w.expert}.")
    proj = w.part.partition(".")[0]
    if proj == "down_proj":
        return source[f"{layer_prefix}mlp.experts.down_proj"][w.expert]
    gate_up = source[f"{layer_prefix}mlp.experts.gate_up_proj"][w.expert]
    half = gate_up.shape[0] // 2
    return gate_up[:half] if proj == "gate_proj" else gate_up[half:]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (random bytes hold NaNs, which equal nothing)."""
    return t.contiguous().view(-1).view(torch.uint8)


def node_tensors(node_dir: Path) -> dict[str, torch.Tensor]:
    index = json.loads((node_dir / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index.values())):
        out.update(load_file(node_dir / file))
    assert set(out) == set(index)
    return out


@pytest.mark.parametrize("kind", ["fused", "per_expert"])
def test_every_node_holds_its_experts_as_the_sources_bytes(make_checkpoint, tmp_path, capsys, kind):
    model = make_checkpoint(layout=kind)
    out = tmp_path / "out"
    code = main(["--pp", "2", "--ep", "4", "--nodes", "2", "--runtime", "vllm", "-q", str(model), str(out)])
    assert code == 0, capsys.readouterr().err
    source = source_tensors(model)
    place = expert_placement("vllm", num_experts=4, ep=4)
    dirs = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert dirs == ["pp0-node0", "pp0-node1", "pp1-node0", "pp1-node1"]
    for name in dirs:
        stage, node = int(name[2]), int(name[-1])
        tensors = node_tensors(out / name)
        experts = {}
        for tname, t in tensors.items():
            want = expected(source, tname)
            same = t.dtype == want.dtype and t.shape == want.shape and torch.equal(raw(t), raw(want))
            assert same, tname
            w = expert_tensor(tname)
            if w is not None:
                assert w.expert is not None  # per-expert names only
                experts.setdefault(w.layer, set()).add(w.expert)
        assert experts and all(ids == place.node_experts(m, node, 2) for m, ids in experts.items())
        layers = {m.index for m in experts if not m.mtp}
        assert layers == set(range(4 * stage, 4 * stage + 4))
    assert verify(out, model).ok
    capsys.readouterr()
    code = main(["plan", "--pp", "2", "--ep", "4", "--nodes", "2", "--json", str(model)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and [(s["dir"], s["stage"], s["node"], s["ep_ranks"]) for s in doc["stages"]] == [
        ("pp0-node0", 0, 0, [0, 1]), ("pp0-node1", 0, 1, [2, 3]),
        ("pp1-node0", 1, 0, [0, 1]), ("pp1-node1", 1, 1, [2, 3]),
    ]  # fmt: skip
    assert doc["stages"][1]["experts"]["layers.0"] == [2, 3] and doc["stages"][1]["bytes"] > 0
    assert doc["identity"]["ep"] == 4 and doc["identity"]["nodes"] == 2


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    clean = {k: v for k, v in os.environ.items() if k not in SCHEDULER_VARS}
    return subprocess.Popen(
        [sys.executable, "-m", "qwen35_reshard", *args],
        env={**clean, "PYTHONPATH": str(ROOT), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_nodes_built_apart_and_at_once_into_one_out(make_checkpoint, tmp_path):
    model = make_checkpoint(layout="fused")
    out = tmp_path / "out"
    flags = ["--pp", "2", "--ep", "4", "--nodes", "2", "-q"]
    # Node 3 from the scheduler's variables and node 0 by number, at the same time.
    runs = [
        cli(*flags, "--node", "auto", str(model), str(out), env={"NODE_RANK": "3", "NNODES": "4"}),
        cli(*flags, "--node", "0", str(model), str(out)),
    ]
    for p in runs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["pp0-node0", "pp1-node1"]
    report = verify(out, model)
    assert sorted(report.missing_stages) == [1, 2] and not report.not_from_source
    # The other two, at once: then OUT holds the whole split, as one run makes it.
    runs = [cli(*flags, "--node", str(g), str(model), str(out)) for g in (1, 2)]
    for p in runs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert verify(out, model).ok
    whole = tmp_path / "whole"
    assert main([*flags, str(model), str(whole)]) == 0
    for d in ("pp0-node0", "pp1-node1"):
        manifest = "reshard-stage.json"
        assert (out / d / manifest).read_bytes() == (whole / d / manifest).read_bytes()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ep", "4", "--nodes", "3"], "error: --ep 4 does not divide evenly over --nodes 3"),
        (["--ep", "3"], "error: SGLang needs its 4 expert slots (4 experts plus 0 redundant)"),
        (["--node", "1"], "error: --node picks a node directory of an expert-parallel split: add --ep"),
        (["--ep", "4", "--nodes", "2", "--node", "4"], "error: --node 4 is not a node of --pp x --nodes 4"),
        (["--ep", "4", "--node-rank", "1", "--nnodes", "4"], "error: with --ep, OUT has one directory per"),
        (["--ep", "4", "--node", "1", "--rank", "0"], "error: --node picks one node's directory: drop"),
        (["--ep", "4", "--init-expert-location", "x.pt"], "error: --init-expert-location x.pt: a .pt file"),
        (["--nodes", "2"], "error: --nodes spans an expert-parallel group: add --ep"),
    ],
)
def test_layouts_refused_in_one_line_naming_the_flag(make_checkpoint, tmp_path, capsys, args, message):
    model = make_checkpoint(layout="fused")
    code = main(["--pp", "2", *args, str(model), str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith(message) and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_verify_names_a_nodes_missing_expert(make_checkpoint, tmp_path):
    ckpt = read_checkpoint(make_checkpoint(layout="per_expert"))
    plan = make_plan(ckpt, Parallelism(pp=2, ep=4, nodes=2))
    node = plan.stages[1]
    gone = next(t.name for t in node.tensors if "layers.2.mlp.experts.3.up_proj" in t.name)
    kept = [t for t in node.tensors if t.name != gone]
    files = layout_files(
        [t.source for t in kept], [t.replicated for t in kept], {f: i for i, f in enumerate(ckpt.files)},
        Counter(), set(), max_file_bytes=plan.max_file_bytes, max_header_bytes=plan.max_header_bytes,
    )  # fmt: skip
    less = type(node)(node.rank, node.start_layer, node.end_layer, files, node.extras, node.node)
    stages = (*plan.stages[:1], less, *plan.stages[2:])
    write_plan(type(plan)(**{**plan.__dict__, "stages": stages}), tmp_path / "out")
    report = verify(tmp_path / "out")
    assert not report.ok
    (finding,) = [f for f in report.findings if f.tensor and "experts.3" in f.tensor]
    assert finding.tensor == "model.language_model.layers.2.mlp.experts.3.up_proj"
    assert "pp0-node1 lacks expert 3 of layers.2 (up_proj), which its EP ranks 2-3 load" in finding.message
    # A node directory copied on its own (`hf download --include "pp0-node1/*"`), no run record
    # beside it: checked from its manifest's recorded layout, as a copied stage directory is.
    local = Path(shutil.copytree(tmp_path / "out" / "pp0-node1", tmp_path / "local" / "pp0-node1"))
    alone = verify(local)
    assert [s.stage for s in alone.stages] == ["pp0-node1"]
    assert [f.tensor for f in alone.findings] == [finding.tensor]
    assert "lacks expert 3 of layers.2 (up_proj)" in alone.findings[0].message
    whole = Path(shutil.copytree(tmp_path / "out" / "pp1-node0", tmp_path / "local" / "pp1-node0"))
    assert verify(whole).ok and verify(whole, ckpt.root).ok
    assert main(["verify", str(local)]) == 1 and main(["verify", str(whole)]) == 0


def test_a_node_from_the_hub_fetches_about_its_own_bytes(make_checkpoint, tmp_path):
    # Experts are most of the bytes here, as in the real models: 8 experts over 4 nodes, each
    # expert's slice of a fused tensor over 1 MiB (ranges closer than that are fetched as one).
    model = make_checkpoint(
        layout="fused", layers=2, experts=8, hidden=256, moe_intermediate=1024, vision=False, mtp=False
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(PYTHONPATH=str(ROOT), HF_HOME=str(tmp_path / "hf"), HF_HUB_DISABLE_XET="1")
    docs, served = [], 0
    with HubServer() as hub:
        hub.add_repo("Qwen/Tiny", model)
        env["HF_ENDPOINT"] = hub.url
        for dry in (["--dry-run"], []):  # the dry run reads the headers, which the run then keeps
            hub.clear_log()
            args = ["--pp", "1", "--ep", "8", "--nodes", "4", "--node", "1", "--json", *dry, "Qwen/Tiny"]
            p = subprocess.run(
                [sys.executable, "-m", "qwen35_reshard", *args, str(tmp_path / "out")],
                env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert p.returncode == 0, p.stderr
            docs.append(json.loads(p.stdout))
        served = sum(e.sent for e in hub.log if e.file.endswith(".safetensors"))
    preview, doc = docs[0]["fetch"], docs[1]
    node = next(s for s in doc["stages"] if s["dir"] == "node1")
    fetched, whole = doc["fetch"]["fetched_bytes"], doc["fetch"]["checkpoint_bytes"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir()) == ["node1"]
    # Its tensors' bytes, plus headers and side files: far from the whole checkpoint.
    assert node["bytes"] * 0.9 < fetched < node["bytes"] * 1.1 and fetched < 0.5 * whole
    # What the dry run and the report say is fetched is what the shards served, the experts cut
    # from fused tensors included; a tensor inside a shard's first 64 KiB (its header read, kept
    # from the dry run) is counted but not fetched again.
    ranged = [f for f, how in doc["fetch"]["shards"].items() if how == "ranges"]
    assert ranged
    for report in (preview, doc["fetch"]):
        assert served <= report["shard_bytes_to_fetch"] <= served + 65536 * len(ranged)
    assert verify(tmp_path / "out", model, ranks=[1]).ok


def test_sglangs_initial_expert_location_places_and_is_recorded(make_checkpoint, tmp_path, capsys):
    model = make_checkpoint(layout="fused")
    # Each decoder layer's 4 slots hold the experts in another order: node 0 (slots 0-1) holds
    # experts 3 and 1 in layer 0, 0 and 2 in layer 1, ...
    rows = [[(3 * (p + layer)) % 4 for p in range(4)] for layer in range(8)]
    location = tmp_path / "location.json"
    location.write_text(json.dumps({"physical_to_logical_map": rows}))
    out = tmp_path / "out"
    args = ["--pp", "2", "--ep", "2", "--nodes", "2", "--init-expert-location", str(location), "-q"]
    assert main([*args, str(model), str(out)]) == 0, capsys.readouterr().err
    for g, name in enumerate(["pp0-node0", "pp0-node1", "pp1-node0", "pp1-node1"]):
        node = g % 2
        held: dict = {}
        for tname in node_tensors(out / name):
            w = expert_tensor(tname)
            if w is not None and not w.layer.mtp:
                held.setdefault(w.layer.index, set()).add(w.expert)
        assert held == {layer: set(rows[layer][2 * node : 2 * node + 2]) for layer in held} and len(held) == 4
    assert verify(out, model).ok
    data = next((out / "pp1-node1").glob("*.safetensors"))
    os.truncate(data, 100)
    assert repair(out, model).after.ok  # rebuilt for the recorded location
    rows[0][0], rows[0][1] = rows[0][1], rows[0][0]  # another location: another split
    location.write_text(json.dumps({"physical_to_logical_map": rows}))
    assert main([*args, str(model), str(out)]) == 2
    assert "other settings (expert_location" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["--runtime", "sglang", "--redundant-experts", "4"],
         "--tp-size 4 --ep-size 4 --ep-num-redundant-experts 4"),
        (
            ["--runtime", "vllm", "--redundant-experts", "4"],
            "--enable-expert-parallel --data-parallel-size 4 --data-parallel-size-local 2 "
            """--enable-eplb --eplb-config '{"num_redundant_experts":4}'""",
        ),
    ],
    ids=["sglang", "vllm"],
)
def test_the_launch_line_names_the_ep_flags_the_nodes_were_cut_for(
    make_checkpoint, tmp_path, capsys, args, flags
):
    model, out = make_checkpoint(layout="fused"), tmp_path / "out"
    assert main(["--pp", "2", "--ep", "4", "--nodes", "2", *args, str(model), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "with exactly these expert-parallel flags:" in printed and f"  {flags}\n" in printed, printed
    assert main(["--pp", "2", "--ep", "4", "--nodes", "2", *args, "--json", str(model), str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["server_flags"] == flags
