"""SGLang's own Qwen3.5 MoE model code judges the SGLang split (issue 15).

Tiny Qwen3.5 MoE checkpoints are saved by transformers (per-expert and fused experts; with a
vision tower; tied and untied embeddings; with ``mtp.*`` added; text-only naming too) and
split with qwen35-reshard for pp=2, pp=3 and pp=3 under an uneven
``SGLANG_PP_LAYER_PARTITION``. For every rank, ``sglang_worker.py`` runs in an environment
with SGLang installed (one process per rank: SGLang's parallel context is process-global),
builds the model class SGLang picks for the stage's ``config.json``, sets every parameter to
NaN and feeds its ``load_weights`` exactly the stage through ``qwen35_reshard.loader``. Here
the results must show:

- no parameter is left NaN, and every parameter equals what the same model holds after being
  fed the whole checkpoint (the stage is complete and exact);
- every stage tensor fills some parameter, except on the last stage those that SGLang's MTP
  draft model (built and fed the same way) takes: ``mtp.*`` and its own embed_tokens copy.
  The draft takes every one of them and then equals the draft fed the whole checkpoint.

The SGLang environment: ``bash .ci/sglang/build-venv.sh .venv-sglang`` (what CI does), or any
Python with an SGLang installed, named by ``QWEN35_RESHARD_SGLANG_PYTHON``. Without one the
test is skipped, except under ``CI=true``, where it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest
import torch
from test_loader_transformers import add_mtp
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

import qwen35_reshard

from support.helpers import ROOT as REPO
from support.helpers import SUPPORT
from support.tiny_model import DTYPE, IMPL, INDEX, perturb, tiny_config

# Real model code in SGLang's environment, seconds to minutes a case.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

WORKER = SUPPORT / "sglang_worker.py"
PYTHON_ENV = "QWEN35_RESHARD_SGLANG_PYTHON"
DEFAULT_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
# (pp, SGLANG_PP_LAYER_PARTITION): SGLang's default splits (4,4 and 2,3,3) and an uneven one.
LAYOUTS = {"pp2": (2, None), "pp3": (3, None), "pp3-uneven": (3, "4,1,3")}
# checkpoint id -> (class saved by transformers, expert layout, tied embeddings, mtp.* added)
CHECKPOINTS = {
    "per_expert": ("vision", "per_expert", False, False),
    "fused_mtp": ("vision", "fused", False, True),
    "tied_mtp": ("vision", "per_expert", True, True),
    "tied_fused": ("vision", "fused", True, False),
    "text_mtp": ("text", "per_expert", False, True),
    "text_tied_fused": ("text", "fused", True, False),
}
# split id -> (checkpoint, drop mtp.*)
SPLITS = {name: (name, False) for name in CHECKPOINTS} | {"fused_mtp-no_mtp": ("fused_mtp", True)}
EMBED_NAMES = ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight")
# The control: the last pp=2 stage fed without one vision block (what the old rule never placed
# there) and with a layer of the first stage; the checks must catch both.
CONTROL_DROP = "model.visual.blocks.0."
CONTROL_EXTRA = "model.language_model.layers.0.input_layernorm.weight"


def sglang_python() -> Path | None:
    path = Path(os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON)
    return path if path.exists() else None


def require_sglang_python() -> Path:
    """The SGLang environment's Python; the test is skipped without one, except under CI=true."""
    python = sglang_python()
    if python is None:
        message = (f"no SGLang environment: run `bash .ci/sglang/build-venv.sh .venv-sglang` "
                   f"or set {PYTHON_ENV} to a Python with SGLang installed")
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return python


# --------------------------------------------------------------------------- checkpoints


def save_checkpoint(out: Path, kind: str, layout: str, tied: bool, mtp: bool) -> None:
    """A tiny Qwen3.5 MoE saved by transformers, with the config fields the releases carry."""
    cfg = tiny_config()
    cfg.tie_word_embeddings = cfg.text_config.tie_word_embeddings = tied
    if kind == "vision":
        model = Qwen3_5MoeForConditionalGeneration._from_config(cfg, dtype=DTYPE, **IMPL)
    else:
        model = Qwen3_5MoeForCausalLM._from_config(cfg.text_config, dtype=DTYPE, **IMPL)
    perturb(model, seed=1)
    model.save_pretrained(out, max_shard_size="100KB", save_original_format=layout == "per_expert")
    config = json.loads((out / "config.json").read_text())
    text = config.get("text_config", config)
    # Qwen3.5 releases carry both; SGLang derives its layer types from the first (so it must
    # agree with the layer_types transformers saved) and would build Qwen3-VL's deepstack
    # mergers without the second.
    types = text["layer_types"]
    interval = types.index("full_attention") + 1
    pattern = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]
    assert types == pattern, types
    text["full_attention_interval"] = interval
    if "vision_config" in config:
        config["vision_config"]["deepstack_visual_indexes"] = []
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if mtp:
        add_mtp(out, model.config.get_text_config())


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """Every checkpoint split for every layout: {(split id, layout id): (source, split dir)}."""
    python = require_sglang_python()
    root = tmp_path_factory.mktemp("sglang")
    torch.manual_seed(0)
    sources = {}
    for name, spec in CHECKPOINTS.items():
        sources[name] = root / "src" / name
        save_checkpoint(sources[name], *spec)
    out = {}
    for split, (ckpt, no_mtp) in SPLITS.items():
        read = qwen35_reshard.read_checkpoint(sources[ckpt])
        for layout, (pp, partition) in LAYOUTS.items():
            sizes = None if partition is None else [int(x) for x in partition.split(",")]
            plan = qwen35_reshard.make_plan(read, pp=pp, runtime="sglang", partition=sizes,
                                            keep_mtp=not no_mtp, max_file_bytes=200_000)
            qwen35_reshard.write_plan(plan, root / "out" / split / layout)
            out[split, layout] = (sources[ckpt], root / "out" / split / layout)
    return python, root, out


@pytest.fixture(scope="module")
def results(splits):
    """Run every (layout, rank) in its own process; {(split, layout, rank): result}."""
    python, root, out = splits
    jobs = []
    for layout, (pp, partition) in LAYOUTS.items():
        for rank in range(pp):
            cases = [
                {"id": split, "source": str(src), "split": str(dst), "drop": [], "extra": [],
                 "draft": rank == pp - 1 and CHECKPOINTS[SPLITS[split][0]][3] and not SPLITS[split][1]}
                for (split, lay), (src, dst) in out.items() if lay == layout
            ]
            if layout == "pp2" and rank == 1:
                src, dst = out["fused_mtp", "pp2"]
                cases.append({"id": "control", "source": str(src), "split": str(dst), "draft": True,
                              "drop": [CONTROL_DROP], "extra": [CONTROL_EXTRA]})
            jobs.append({"pp": pp, "rank": rank, "partition": partition, "cases": cases,
                         "layout": layout, "result": str(root / f"result-{layout}-{rank}.json")})
    found = run_worker(python, WORKER, root, jobs)
    print_counts(found)
    return found


def run_worker(
    python: Path, worker: Path, root: Path, jobs: list[dict], timeout: int = 1200, env: dict | None = None
) -> dict:
    """Run ``worker`` on ``jobs`` (two ranks at a time) in the SGLang environment (``env``
    added to it); the results by (case, layout, rank)."""
    (root / "jobs.json").write_text(json.dumps({"parallel": 2, "jobs": jobs}))
    extra, env = env or {}, {k: v for k, v in os.environ.items() if k != "SGLANG_PP_LAYER_PARTITION"}
    env.update(extra)
    env["PYTHONPATH"] = str(REPO)  # this checkout's qwen35_reshard (an entry point is the installed one)
    t = time.perf_counter()
    proc = subprocess.run([str(python), str(worker), str(root / "jobs.json")], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{worker.name} failed:\n{proc.stderr[-8000:]}"
    print(f"\n{proc.stderr.splitlines()[-1]} ({time.perf_counter() - t:.1f} s with the import)")
    found = {}
    for job in jobs:
        for case, r in json.loads(Path(job["result"]).read_text()).items():
            found[case, job["layout"], job["rank"]] = r
    return found


def print_counts(found) -> None:
    """Parameters per rank (count and elements) for each split; shown with pytest -s."""
    print("\nSGLang", next(iter(found.values()))["sglang"], "parameters per rank (tensors/elements):")
    for (case, layout, rank), r in sorted(found.items()):
        draft = r["draft"]
        extra = f"  draft {len(draft['params'])}/{sum(draft['params'].values())}" if draft else ""
        print(f"  {case:18} {layout:11} rank {rank} layers {r['layers']}: "
              f"{len(r['params'])}/{sum(r['params'].values())}  stage tensors {len(r['stage_names'])}{extra}")


def test_checkpoints_are_what_the_cases_say(splits):
    """The premises: each saved checkpoint has the naming, expert layout, head and MTP claimed."""
    _, root, _ = splits
    for name, (kind, layout, tied, mtp) in CHECKPOINTS.items():
        names = set(json.loads((root / "src" / name / INDEX).read_text())["weight_map"])
        prefix = "model.language_model." if kind == "vision" else "model."
        assert f"{prefix}layers.0.input_layernorm.weight" in names, name
        assert any(n.startswith("model.visual.") for n in names) == (kind == "vision"), name
        fused = f"{prefix}layers.0.mlp.experts.gate_up_proj" in names
        assert fused == (layout == "fused") != (f"{prefix}layers.0.mlp.experts.7.up_proj.weight" in names)
        assert ("lm_head.weight" not in names) == tied, name
        assert ("mtp.fc.weight" in names) == mtp, name


CASES = [(split, layout, rank) for split in SPLITS for layout, (pp, _) in LAYOUTS.items()
         for rank in range(pp)]


@pytest.mark.parametrize(("split", "layout", "rank"), CASES)
def test_sglang_loads_exactly_its_stage(results, split, layout, rank):
    r = results[split, layout, rank]
    ckpt, no_mtp = SPLITS[split]
    kind, _, tied, mtp = CHECKPOINTS[ckpt]
    pp, _ = LAYOUTS[layout]
    last, draft_served = rank == pp - 1, mtp and not no_mtp
    # The class SGLang's registry picks for the stage's config.json.
    want = "Qwen3_5MoeForConditionalGeneration" if kind == "vision" else "Qwen3_5MoeForCausalLM"
    assert r["arch"] == want
    assert sorted(r["fed"]) == r["stage_names"]  # the loader yields exactly the stage

    unused = sorted(set(r["stage_names"]) - set(r["taken"]))
    if kind == "text" and tied and last:
        # SGLang 0.5.23's text-only class leaves a tied lm_head unloaded under pipeline
        # parallelism whatever it is fed (qwen3_5_text.py skips lm_head.weight when tied and,
        # unlike the multimodal class, copies nothing from embed_tokens into it), so the
        # embed_tokens copy the split places there for it goes unused.
        assert r["nan_after_stage"] == r["nan_after_whole"] == ["lm_head.weight"]
        assert r["differs_from_whole"] == []
        assert unused == ["model.embed_tokens.weight"] and r["draft"] is None
        return

    # The stage is complete: nothing SGLang builds on this rank stays NaN ...
    assert r["nan_after_stage"] == [], f"parameters no stage tensor reached: {r['nan_after_stage']}"
    # ... and exact: the same values as when SGLang picks its tensors out of the whole checkpoint.
    assert r["nan_after_whole"] == []
    assert r["differs_from_whole"] == []

    # Nothing in the stage is dropped: every tensor fills a parameter of the model or the draft.
    if not (last and draft_served):
        assert r["draft"] is None
        assert unused == [], f"stage tensors SGLang has no parameter for: {unused}"
        return
    draft = r["draft"]
    assert draft["arch"] == "Qwen3_5ForCausalLMMTP"
    assert unused, "the MTP tensors should be the draft's, not the main model's"
    assert all(n.startswith("mtp.") or n in EMBED_NAMES for n in unused), unused
    assert set(unused) <= set(draft["taken"]), sorted(set(unused) - set(draft["taken"]))
    assert any(n in EMBED_NAMES for n in draft["taken"]), "the draft keeps its own embed_tokens copy"
    # The draft's lm_head is the target's own (shared at run time, never loaded from a tensor)
    # unless it is tied to the draft's embed_tokens.
    assert draft["nan_after_stage"] == ([] if tied else ["lm_head.weight"])
    assert draft["differs_from_whole"] == []


def test_checks_catch_a_short_or_foreign_stage(results):
    """The control: a vision block missing from the last stage (as the old placement left it)
    leaves NaN parameters that the whole checkpoint fills; a first-stage layer tensor fed to the
    last stage fills nothing, in the model or the draft."""
    r = results["control", "pp2", 1]
    assert r["nan_after_stage"] and all(n.startswith("visual.blocks.0.") for n in r["nan_after_stage"])
    assert r["nan_after_whole"] == [] and r["differs_from_whole"] == r["nan_after_stage"]
    assert CONTROL_EXTRA in r["fed"] and CONTROL_EXTRA not in r["taken"] + r["draft"]["taken"]


def test_worker_ran_the_pinned_sglang(results):
    """The environment CI builds holds the SGLang version the placement was checked against."""
    versions = {r["sglang"] for r in results.values()}
    assert len(versions) == 1
    if sglang_python() == DEFAULT_PYTHON or os.environ.get("CI") == "true":
        assert versions == {"0.5.23"}
