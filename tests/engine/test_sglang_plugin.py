"""The SGLang plugin (qwen35_reshard/servers/sglang.py, issue 24) inside SGLang's own loader.

The checkpoints of test_sglang_loading.py (per-expert and fused experts, MTP kept and dropped,
text-only and multimodal, tied embeddings) and a block-FP8 one (weights with their scales) are
split for pp=2, 3 and 4, each with SGLang's
default partition and with an explicit ``SGLANG_PP_LAYER_PARTITION``. For every rank of every
layout ``sglang_plugin_worker.py`` runs in an SGLang environment in which this package is
installed (so that its entry point is in the environment's metadata; what
``.ci/sglang/build-venv.sh`` does), one process per rank, every rank given the same model path
OUT (as on one node that runs them all). There SGLang's ``load_plugins()`` discovers the plugin,
and SGLang's own ``get_model_loader`` / ``load_model`` build and load each rank's model (and, on
the last rank, the MTP draft) with every parameter NaN before loading. Here the results must show:

- the plugin's loader was chosen for a split, SGLang's own for the whole checkpoint;
- nothing is left NaN, every parameter is byte-equal to the same model loaded by SGLang from the
  whole checkpoint, and every stage tensor filled a parameter of the model or of its draft;
- the controls (a split for another partition or pp size, for vLLM, a stage with a tensor
  removed or added, a stage directory on the wrong rank, an MTP draft from a ``--no-mtp``
  split) are refused with one line before any model is built or any weight fed.

What stands in for the engine: the pipeline group object (its four fields), as in
test_sglang_loading.py; no process group is made and no kernel runs (SGLang's CPU engine needs
an ``sgl_kernel`` CPU build that no package provides).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_sglang_loading import (
    CHECKPOINTS,
    EMBED_NAMES,
    SPLITS,
    require_sglang_python,
    run_worker,
    save_checkpoint,
)
from test_sglang_loading import CHECKPOINTS as BF16_CHECKPOINTS

import qwen35_reshard
from qwen35_reshard.format.digest import XXH128, hexdigest

from support.helpers import SUPPORT, header_reads, run_without
from support.tiny_model import INDEX

# Real model code in SGLang's environment, seconds to minutes a case.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

WORKER = SUPPORT / "sglang_plugin_worker.py"
# test_sglang_loading.py's checkpoints and one FP8 (block-FP8 F8_E4M3 weights with F32
# weight_scale_inv, as the -FP8 releases; vision tower, mtp.*) made by examples/tiny_checkpoint.py.
CHECKPOINTS = {**CHECKPOINTS, "fp8_mtp": ("vision", "per_expert_fp8", False, True)}
SPLITS = {**SPLITS, "fp8_mtp": ("fp8_mtp", False)}
MANIFEST = "reshard-stage.json"
# layout id -> (pp, SGLANG_PP_LAYER_PARTITION): SGLang's default split and an explicit one each.
LAYOUTS = {
    "pp2": (2, None), "pp2-5,3": (2, "5,3"),
    "pp3": (3, None), "pp3-4,1,3": (3, "4,1,3"),
    "pp4": (4, None), "pp4-1,3,2,2": (4, "1,3,2,2"),
}
# The forged stages of the controls: the last pp=2 stage without one of its vision tensors, and
# with a tensor of layer 0 (the first stage's), each recorded in its manifest and index as if
# the split had written it.
REMOVED = "model.visual.blocks.0.norm1.weight"
ADDED = "model.language_model.layers.0.input_layernorm.weight"
# control id -> (layout, rank, split of per_expert to load, the message must contain)
CONTROLS = {
    "other-partition": ("pp3", 0, ("pp3-4,1,3", None),
                        "launch the server with SGLANG_PP_LAYER_PARTITION=4,1,3"),
    "default-partition": ("pp3-4,1,3", 1, ("pp3", None),
                          "launch the server with SGLANG_PP_LAYER_PARTITION=2,3,3"),
    "other-pp": ("pp3", 0, ("pp2", None), "--pp-size 2"),
    "vllm": ("pp2", 1, ("pp2-vllm", None), "was split for vllm but the server is sglang"),
    "removed": ("pp2", 1, ("pp2", "removed"), f"lacks tensor {REMOVED!r}"),
    "added": ("pp2", 1, ("pp2", "added"),
              f"tensor {ADDED!r} is for layer 0, outside the stage's layers [4, 8)"),
    "wrong-stage-dir": ("pp2", 1, ("pp2", "pp0"), "give rank 1 its own directory (pp1)"),
}


def save_fp8_checkpoint(tiny, out: Path) -> None:
    """The FP8 checkpoint, sized for SGLang's block-FP8 layers (every output partition a multiple
    of the 128-wide block), with the vision field SGLang needs (see save_checkpoint), and its
    seeded bytes' NaN patterns replaced, so that a NaN parameter means one left unloaded."""
    tiny.build_checkpoint(out, layout="per_expert_fp8", hidden=256, moe_intermediate=128)
    config = json.loads((out / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = []
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            metadata = f.metadata()
        tensors = load_file(file)
        for t in tensors.values():
            if t.dtype == torch.float8_e4m3fn:
                raw = t.view(torch.uint8)
                raw[(raw & 0x7F) == 0x7F] = 0x7E  # e4m3fn's only NaN pattern -> its largest finite value
            elif t.is_floating_point():
                t.nan_to_num_(0.0, 0.0, 0.0)
        file.unlink()
        save_file(tensors, file, metadata=metadata)


def split(read, out: Path, pp: int, partition: str | None, *, no_mtp: bool, runtime: str = "sglang") -> Path:
    sizes = None if partition is None else [int(x) for x in partition.split(",")]
    # Small files, so that stages hold several (but no limit below what the largest tensor needs:
    # the split refuses that, and the block-FP8 checkpoint's tensors are larger).
    largest = max(t.nbytes for t in read.tensors.values())
    plan = qwen35_reshard.make_plan(read, pp=pp, runtime=runtime, partition=sizes, keep_mtp=not no_mtp,
                                    max_file_bytes=max(200_000, 2 * largest))
    qwen35_reshard.write_plan(plan, out)
    return out


def forge(out: Path, dst: Path, *, drop: str | None = None, add: tuple | None = None) -> Path:
    """A copy of the split ``out`` whose last stage lacks ``drop`` or holds ``add``, with its data
    file, index and manifest rewritten to agree (so only the stage's content is wrong)."""
    shutil.copytree(out, dst)
    stage = dst / "pp1"
    manifest = json.loads((stage / MANIFEST).read_text())
    index = json.loads((stage / INDEX).read_text())
    name = drop or add[0]
    file = manifest["tensors"][drop or next(iter(manifest["tensors"]))]["file"]
    tensors = load_file(stage / file)
    if drop:
        del tensors[drop], manifest["tensors"][drop], index["weight_map"][drop]
    else:
        tensor = add[1].contiguous()
        tensors[name] = tensor
        raw = tensor.view(torch.uint8).numpy().tobytes()
        manifest["tensors"][name] = {"file": file, "dtype": "BF16", "shape": list(tensor.shape),
                                     "nbytes": len(raw), "xxh128": hexdigest(XXH128, raw),
                                     "replicated": False}
        index["weight_map"][name] = file
    (stage / file).unlink()  # the split may share its blocks with the source: never write through
    save_file(tensors, stage / file, metadata={"format": "pt"})
    size = (stage / file).stat().st_size
    manifest["files"][file] = {"bytes": size, "tensors": len(tensors), "layout": "gathered"}
    index["metadata"]["total_size"] = sum(t["nbytes"] for t in manifest["tensors"].values())
    (stage / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    manifest["index_sha256"] = hashlib.sha256((stage / INDEX).read_bytes()).hexdigest()
    (stage / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return dst


def test_plugin_imports_without_sglang(tmp_path):
    """The plugin's module imports without sglang and torch, and tells a split from another
    path; only registering needs SGLang."""
    (tmp_path / "pp0").mkdir()
    code = (
        "from qwen35_reshard.servers import sglang as plugin\n"
        f"print(plugin.is_split({str(tmp_path)!r}), plugin.is_split({str(tmp_path / 'pp0')!r}))\n"
        "try:\n"
        "    plugin.register()\n"
        "except ImportError:\n"
        "    print('sglang needed only to register')\n"
    )
    printed = run_without(["sglang", "torch"], code)
    assert printed.split("\n")[:2] == ["True False", "sglang needed only to register"]


@pytest.fixture(scope="module")
def results(tmp_path_factory, tiny):
    """Every checkpoint split for every layout, loaded on every rank; {(case, layout, rank): result}."""
    python = require_sglang_python()
    root = tmp_path_factory.mktemp("sglang-plugin")
    torch.manual_seed(0)
    sources, reads, outs = {}, {}, {}
    for name, spec in CHECKPOINTS.items():
        sources[name] = root / "src" / name
        if name in BF16_CHECKPOINTS:
            save_checkpoint(sources[name], *spec)
        else:
            save_fp8_checkpoint(tiny, sources[name])
        reads[name] = qwen35_reshard.read_checkpoint(sources[name])
    for sid, (ckpt, no_mtp) in SPLITS.items():
        for layout, (pp, partition) in LAYOUTS.items():
            outs[sid, layout] = split(reads[ckpt], root / "out" / sid / layout, pp, partition, no_mtp=no_mtp)
    outs["per_expert", "pp2-vllm"] = split(reads["per_expert"], root / "out" / "vllm", 2, None, no_mtp=False,
                                           runtime="vllm")
    added = load_file(sources["per_expert"] / json.loads((sources["per_expert"] / INDEX).read_text())
                      ["weight_map"][ADDED])[ADDED]
    forged = {"removed": forge(outs["per_expert", "pp2"], root / "out" / "removed", drop=REMOVED),
              "added": forge(outs["per_expert", "pp2"], root / "out" / "added", add=(ADDED, added)),
              "pp0": outs["per_expert", "pp2"] / "pp0"}

    jobs = []
    for layout, (pp, partition) in LAYOUTS.items():
        for rank in range(pp):
            cases = [{"id": sid, "kind": "load", "source": str(sources[ckpt]),
                      "split": str(outs[sid, layout]), "mtp_source": CHECKPOINTS[ckpt][3],
                      "mtp_kept": not no_mtp}
                     for sid, (ckpt, no_mtp) in SPLITS.items()]
            if layout == "pp2":  # today's recipe: the stage directory itself as the model path
                stage_dir = outs["per_expert", "pp2"] / f"pp{rank}"
                cases.append({**cases[0], "id": "stage-dir", "split": str(stage_dir)})
            for cid, (lay, r, (of, variant), _) in CONTROLS.items():
                if (lay, r) == (layout, rank):
                    path = forged[variant] if variant else outs["per_expert", of]
                    cases.append({"id": cid, "kind": "refused", "split": str(path)})
            jobs.append({"pp": pp, "rank": rank, "partition": partition, "cases": cases, "layout": layout,
                         "result": str(root / f"result-{layout}-{rank}.json")})
    found = run_worker(python, WORKER, root, jobs, timeout=1500)
    print_counts(found)
    return found


def print_counts(found) -> None:
    """Parameters loaded per rank (tensors/elements) and the refusals; shown with pytest -s."""
    print("\nSGLang plugin: parameters loaded per rank (tensors/elements):")
    for (case, layout, rank), r in sorted(found.items()):
        if case in ("discovered", "sglang", "debug"):
            continue
        if "error" in r:
            print(f"  {case:18} {layout:12} rank {rank}: refused: {r['error']}")
            continue
        draft = r["draft"]
        extra = f"  draft {len(draft['params'])}/{sum(draft['params'].values())}" if draft else ""
        if r["draft_refused"]:
            extra = f"  draft refused: {r['draft_refused']['error']}"
        print(f"  {case:18} {layout:12} rank {rank} layers {r['layers']}: "
              f"{len(r['params'])}/{sum(r['params'].values())}  stage tensors {len(r['stage_names'])}{extra}")


CASES = [(sid, layout, rank) for sid in [*SPLITS, "stage-dir"] for layout, (pp, _) in LAYOUTS.items()
         for rank in range(pp) if sid != "stage-dir" or layout == "pp2"]


def test_sglang_discovers_the_plugin(results):
    """SGLang's load_plugins() found the entry point and wrapped get_model_loader, in every rank;
    for a path that is not a split the plugin did nothing but say so once, at debug level."""
    jobs = {(layout, rank) for _, layout, rank in results}
    for layout, rank in jobs:
        assert results["discovered", layout, rank] == {"hooked_by": ["qwen35_stages"], "wrapped": True}
        notes = [m for m in results["debug", layout, rank] if "not a qwen35-reshard split" in m]
        assert len(notes) == len(CHECKPOINTS), notes  # once per checkpoint path, however often loaded
    assert {results["sglang", layout, rank] for layout, rank in jobs} == {"0.5.23"}


@pytest.mark.parametrize(("sid", "layout", "rank"), CASES)
def test_each_rank_loads_exactly_its_stage(results, sid, layout, rank):
    r = results[sid, layout, rank]
    ckpt, no_mtp = SPLITS.get(sid, ("per_expert", False))
    kind, _, tied, mtp = CHECKPOINTS[ckpt]
    pp, _ = LAYOUTS[layout]
    last = rank == pp - 1
    # The plugin's loader for the split; SGLang's own, unchanged, for the whole checkpoint.
    assert r["loader"] == "Qwen35StagesLoader" and r["sglang_own_loader"] == "DefaultModelLoader"
    assert r["ref_loader"] == r["ref_sglang_own_loader"] == "DefaultModelLoader"
    want = "Qwen3_5MoeForConditionalGeneration" if kind == "vision" else "Qwen3_5MoeForCausalLM"
    assert r["arch"] == want
    # load_weights got exactly the stage, the draft's mtp.* aside.
    assert r["fed"] == [n for n in r["stage_names"] if not n.startswith("mtp.")]

    draft = r["draft"]
    used = set(r["taken"]) | set(draft["taken"] if draft else ())
    unused = sorted(set(r["stage_names"]) - used)
    if kind == "text" and tied and last:
        # SGLang 0.5.23's text-only class leaves a tied lm_head unloaded under pipeline
        # parallelism whatever it is fed (see test_sglang_loading.py): the same with the plugin.
        assert r["nan"] == r["nan_after_whole"] == ["lm_head.weight"]
        assert r["differs_from_whole"] == [] and unused == ["model.embed_tokens.weight"]
        return
    assert r["nan"] == [], f"parameters no stage tensor reached: {r['nan']}"
    assert r["nan_after_whole"] == [] and r["differs_from_whole"] == []
    assert unused == [], f"stage tensors nothing took: {unused}"

    if not (last and mtp):
        assert draft is None and r["draft_refused"] is None
        return
    if no_mtp:  # a speculative launch from a --no-mtp split: refused before the draft is built
        refused = r["draft_refused"]
        assert refused["built"] == refused["fed"] == 0 and "\n" not in refused["error"]
        assert "was split with --no-mtp" in refused["error"] and "--speculative-algorithm" in refused["error"]
        return
    assert draft["loader"] == "Qwen35StagesLoader" and draft["arch"] == "Qwen3_5ForCausalLMMTP"
    assert draft["fed"] == [n for n in r["stage_names"] if n.startswith("mtp.") or n in EMBED_NAMES]
    assert set(draft["taken"]) == set(draft["fed"])  # every tensor fed to the draft filled some parameter
    # The draft's lm_head is the target's own (shared at run time, never loaded from a tensor)
    # unless it is tied to the draft's embed_tokens.
    assert draft["nan"] == draft["nan_after_whole"] == ([] if tied else ["lm_head.weight"])
    assert draft["differs_from_whole"] == []


@pytest.mark.parametrize("cid", CONTROLS)
def test_a_wrong_stage_is_refused_before_any_weight_is_read(results, cid):
    layout, rank, _, message = CONTROLS[cid]
    r = results[cid, layout, rank]
    assert r["error"] is not None, "the stage was loaded"
    assert message in r["error"] and "\n" not in r["error"]
    assert r["built"] == 0 and r["fed"] == 0  # no model built, no weight fed


# ---------------------------------------------------------------------------- unsplit (issue 33)

UNSPLIT_REPO = "Qwen/TinySGLang"
UNSPLIT_SOURCE = "fused_mtp"  # an MTP head: the last rank's draft loads from the same stage


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory, tiny):
    """pp=2, each rank in SGLang's own loading path, opted in: the unsplit checkpoint as a repo
    id on the tests' Hub server and as a local directory; the results, the split's stage names
    for comparison, and the safetensors bytes each rank's requests fetched."""
    from support.hub_server import HubServer

    python = require_sglang_python()
    root = tmp_path_factory.mktemp("sglang-unsplit")
    torch.manual_seed(0)
    source = root / "src" / UNSPLIT_SOURCE
    save_checkpoint(source, *CHECKPOINTS[UNSPLIT_SOURCE])
    read = qwen35_reshard.read_checkpoint(source)
    out = split(read, root / "out", 2, None, no_mtp=False)
    plan = qwen35_reshard.make_plan(read, pp=2, runtime="sglang")
    base = {"kind": "load", "unsplit": True, "source": str(source), "mtp_source": True, "mtp_kept": True}
    fp8 = root / "src" / "fp8_mtp"  # quantized: weights and their scales placed together, in place
    save_fp8_checkpoint(tiny, fp8)
    cases = [{**base, "id": "repo", "split": UNSPLIT_REPO}, {**base, "id": "local", "split": str(source)},
             {**base, "id": "local-fp8", "source": str(fp8), "split": str(fp8)}]
    jobs = [{"pp": 2, "rank": rank, "partition": None, "layout": "pp2", "cases": cases,
             "result": str(root / f"result-unsplit-{rank}.json")} for rank in (0, 1)]
    fp8_out = split(qwen35_reshard.read_checkpoint(fp8), root / "out-fp8", 2, None, no_mtp=False)
    with HubServer() as hub:
        hub.add_repo(UNSPLIT_REPO, source)
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(root / "hf-home"), "HF_HUB_DISABLE_XET": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "QWEN35_RESHARD_STAGE_CACHE": str(root / "stages"),
               "QWEN35_RESHARD_SGLANG_UNSPLIT": "1"}
        found = run_worker(python, WORKER, root, jobs, env=env)
        sent = {rank: sum(e.sent for e in hub.log if e.file.endswith(".safetensors") and e.method == "GET"
                          and f"qwen35-stages/pp{rank}" in e.agent) for rank in (0, 1)}
        others = sum(e.sent for e in hub.log if e.file.endswith(".safetensors") and e.method == "GET"
                     and "qwen35-stages/pp" not in e.agent)
    headers = sum(header_reads(source).values())  # the tool's first read of each, or the longer header
    split_names = {(cid, rank): qwen35_reshard.open_stage(o, pp_rank=rank).names for rank in (0, 1)
                   for cid, o in (("repo", out), ("local", out), ("local-fp8", fp8_out))}
    return {"found": found, "sent": sent, "others": others, "headers": headers, "plan": plan,
            "split_names": split_names, "root": root}


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("cid", ["repo", "local", "local-fp8"])
def test_unsplit_checkpoint_each_rank_loads_exactly_its_stage(unsplit, cid, rank):
    r = unsplit["found"][cid, "pp2", rank]
    assert r["loader"] == "Qwen35StagesLoader" and r["ref_loader"] == "DefaultModelLoader"
    assert sorted(r["stage_names"]) == sorted(unsplit["split_names"][cid, rank])  # the split's stage
    assert r["fed"] == [n for n in r["stage_names"] if not n.startswith("mtp.")]
    draft = r["draft"]
    used = set(r["taken"]) | set(draft["taken"] if draft else ())
    assert sorted(set(r["stage_names"]) - used) == []
    assert r["nan"] == [] and r["differs_from_whole"] == []
    if rank == 1:  # the MTP draft, from the stage this rank loaded
        assert draft["loader"] == "Qwen35StagesLoader" and draft["differs_from_whole"] == []
        assert draft["fed"] == [n for n in r["stage_names"] if n.startswith("mtp.") or n in EMBED_NAMES]
    else:
        assert draft is None
    log = unsplit["found"]["debug", "pp2", rank]
    assert any("QWEN35_RESHARD_SGLANG_UNSPLIT is set" in m for m in log), log  # the opt-in, said at start
    how = {"repo": "fetched in", "local": "in place", "local-fp8": "in place"}[cid]
    assert any(m.startswith("qwen35-stages: ") and f"stage {rank} {how}" in m for m in log), log


def test_unsplit_repo_each_rank_fetched_only_its_stage(unsplit):
    plan, headers = unsplit["plan"], unsplit["headers"]
    for rank in (0, 1):
        # Headers twice at most: every shard's when planning, again in a shard fetched whole.
        # Less where the other rank fetched a shard both need whole into the shared cache first.
        assert unsplit["sent"][rank] <= plan.stages[rank].data_bytes + 2 * headers
    union = {t.name: t.source.nbytes for stage in plan.stages for t in stage.tensors}
    assert sum(unsplit["sent"].values()) >= sum(union.values())  # every tensor came, at least once
    assert unsplit["others"] == 0  # nothing else read a weight file
    assert not (unsplit["root"] / "stages" / "local").exists()  # the local directory was read in place
