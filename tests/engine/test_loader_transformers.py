"""Proof against the real transformers Qwen3.5 MoE model (issue 3).

A tiny random ``Qwen3_5MoeForConditionalGeneration`` (8 layers, linear and full attention,
8 experts, a vision tower) is saved by transformers itself in several shards, in both
expert layouts; ``mtp.*`` tensors are added to one of them. Each save is split with
qwen35-reshard for pp = 2, 3, 4 and both runtimes. For every stage the test builds the
stage's model the way a server does (its own decoder layers; parameter-less placeholders
for the others; embed_tokens, vision tower, norm, lm_head and the MTP head where the runtime
builds them), loads it through ``loader.open_stage(...).iter_weights()`` with a strict
reference ``load_weights`` that has no layer-range skip logic (an unknown name raises, every
parameter must be filled exactly once), then runs the stages one after another and compares
the logits with the unsplit model's, bit for bit.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, Qwen3_5MoeForConditionalGeneration
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qm

import qwen35_reshard
from qwen35_reshard import loader
from qwen35_reshard.errors import DamagedStage

from support.tiny_model import DTYPE, IMPL, INDEX, LAYERS, VOCAB, perturb, tiny_config

# Real model code (transformers), seconds a case.
pytestmark = [pytest.mark.engine, pytest.mark.slow]

EXPERT_RE = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<j>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def test_transformers_is_new_enough():
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    assert (major, minor) >= (5, 2), transformers.__version__


# --------------------------------------------------------------------------- the model


class MissingLayer(nn.Module):
    """A server's placeholder for a layer another stage owns (PPMissingLayer): no parameters."""

    def forward(self, *args, **kwargs):
        raise AssertionError("a stage ran a decoder layer it does not own")


class StageText(nn.Module):
    def __init__(self, tcfg, start, end, *, embed, norm):
        super().__init__()
        if embed:
            self.embed_tokens = nn.Embedding(tcfg.vocab_size, tcfg.hidden_size)
        self.layers = nn.ModuleList(
            qm.Qwen3_5MoeDecoderLayer(tcfg, i) if start <= i < end else MissingLayer()
            for i in range(tcfg.num_hidden_layers)
        )
        if norm:
            self.norm = qm.Qwen3_5MoeRMSNorm(tcfg.hidden_size, eps=tcfg.rms_norm_eps)
        self.rotary_emb = qm.Qwen3_5MoeTextRotaryEmbedding(tcfg)  # buffers only, not in checkpoints


class MTPHead(nn.Module):
    """The multi-token-prediction head's parameters as the checkpoints name them (mtp.*)."""

    def __init__(self, tcfg):
        super().__init__()
        h = tcfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = qm.Qwen3_5MoeRMSNorm(h, eps=tcfg.rms_norm_eps)
        self.pre_fc_norm_hidden = qm.Qwen3_5MoeRMSNorm(h, eps=tcfg.rms_norm_eps)
        self.norm = qm.Qwen3_5MoeRMSNorm(h, eps=tcfg.rms_norm_eps)
        # One full-attention MoE decoder layer.
        full = tcfg.layer_types.index("full_attention")
        self.layers = nn.ModuleList([qm.Qwen3_5MoeDecoderLayer(tcfg, full)])


class StageModel(nn.Module):
    """What a server builds on one pipeline rank; parameter names are the checkpoint's names."""

    def __init__(self, cfg, start, end, owns):
        super().__init__()
        tcfg = cfg.text_config
        self.model = nn.Module()
        self.model.language_model = StageText(tcfg, start, end, embed=owns["embed"], norm=owns["norm"])
        if owns["visual"]:
            self.model.visual = qm.Qwen3_5MoeVisionModel._from_config(cfg.vision_config)
            if not owns["pos_embed"]:
                del self.model.visual.pos_embed  # SGLang's PPMissingLayer: no parameters
        if owns["lm_head"]:
            self.lm_head = nn.Linear(tcfg.hidden_size, tcfg.vocab_size, bias=False)
        if owns["mtp"]:
            self.mtp = MTPHead(tcfg)
        self.tcfg, self.start, self.end = tcfg, start, end
        # Poison every parameter: anything the loader does not fill stays NaN.
        for p in self.parameters():
            p.data = torch.full(p.shape, float("nan"), dtype=DTYPE)


def load_weights(model: nn.Module, weights) -> list[str]:
    """Strict reference load_weights, shaped like SGLang's and vLLM's, minus any PP skip logic.

    Checkpoint names map to parameters by name; per-expert ``experts.{j}.{gate,up,down}_proj.weight``
    tensors are stacked by expert index into the fused ``gate_up_proj`` [E, 2I, H] (gate rows first)
    and ``down_proj`` [E, H, I]. A name with no parameter raises; a shape or dtype that does not fit
    raises; a piece filled twice raises; a parameter left (partly) unfilled raises.
    """
    params = dict(model.named_parameters())

    def pieces(name):
        p = params[name]
        if name.endswith(".mlp.experts.gate_up_proj"):
            return {(j, half) for j in range(p.shape[0]) for half in ("gate", "up")}
        if name.endswith(".mlp.experts.down_proj"):
            return {(j, "down") for j in range(p.shape[0])}
        return {"whole"}

    filled = {name: set() for name in params}
    seen = []
    with torch.no_grad():
        for name, tensor in weights:
            seen.append(name)
            m = EXPERT_RE.match(name)
            if m:
                target = m["base"] + (".down_proj" if m["proj"] == "down" else ".gate_up_proj")
                if target not in params:
                    raise KeyError(f"{name}: no parameter {target} on this stage")
                p, j = params[target], int(m["j"])
                if not 0 <= j < p.shape[0]:
                    raise KeyError(f"{name}: expert {j} out of range")
                if m["proj"] == "down":
                    dst, piece = p.data[j], {(j, "down")}
                else:
                    half = p.shape[1] // 2
                    gate = m["proj"] == "gate"
                    dst = p.data[j, :half] if gate else p.data[j, half:]
                    piece = {(j, "gate" if gate else "up")}
            else:
                if name not in params:
                    raise KeyError(f"{name}: no parameter on this stage")
                target, dst, piece = name, params[name].data, pieces(name)
            if tuple(tensor.shape) != tuple(dst.shape) or tensor.dtype != dst.dtype:
                raise ValueError(f"{name}: {tuple(tensor.shape)} {tensor.dtype} does not fit {target} "
                                 f"{tuple(dst.shape)} {dst.dtype}")
            if filled[target] & piece:
                raise ValueError(f"{name}: {target} was already loaded")
            filled[target] |= piece
            dst.copy_(tensor)
    unfilled = sorted(n for n in params if filled[n] != pieces(n))
    if unfilled:
        raise ValueError(f"{len(unfilled)} parameters got no tensor, e.g. {unfilled[:3]}")
    return seen


def run_stage(stage: StageModel, input_ids, hidden):
    """One pipeline stage's forward: embeddings on the first, norm and lm_head on the last."""
    lm, tcfg = stage.model.language_model, stage.tcfg
    if hidden is None:
        hidden = lm.embed_tokens(input_ids)
    batch, seq = input_ids.shape
    # Text-only positions as Qwen3_5MoeTextModel builds them: row 0 text, rows 1-3 the M-RoPE grid.
    pos = torch.arange(seq).view(1, 1, -1).expand(4, batch, -1)
    text_pos, mrope_pos = pos[0], pos[1:]
    masks = {
        "full_attention": create_causal_mask(
            config=tcfg, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=text_pos
        ),
        "linear_attention": create_recurrent_attention_mask(tcfg, hidden, None, None),
    }
    rope = lm.rotary_emb(hidden, mrope_pos)
    for i in range(stage.start, stage.end):
        hidden = lm.layers[i](
            hidden, position_embeddings=rope, attention_mask=masks[tcfg.layer_types[i]],
            position_ids=text_pos, cache=None,
        )
    if hasattr(stage, "lm_head"):
        return stage.lm_head(lm.norm(hidden))
    return hidden


# --------------------------------------------------------------------------- what servers do


def server_partition(num_layers, pp, runtime):
    """The layer split each server computes for itself when the partition variable is unset."""
    base, rem = divmod(num_layers, pp)
    sizes = [base] * pp
    if runtime == "sglang":  # the last rem ranks get one more
        for i in range(rem):
            sizes[pp - 1 - i] += 1
    else:  # vLLM: 2nd-to-last, 3rd-to-last, ...
        for i in range(2, rem + 2):
            sizes[-i] += 1
    return sizes


def owned(runtime, rank, pp, *, mtp_kept, tied=False):
    """Which non-layer modules a rank builds (and so must get weights for)."""
    first, last = rank == 0, rank == pp - 1
    if runtime == "sglang":  # the vision tower on every rank, its pos_embed on the first only
        embed, pos_embed = first or (last and (tied or mtp_kept)), first
    else:
        embed, pos_embed = True, True
    return {"embed": embed, "visual": True, "pos_embed": pos_embed, "norm": last, "lm_head": last,
            "mtp": last and mtp_kept}


# --------------------------------------------------------------------------- fixtures


def fused_to_per_expert(state):
    out = {}
    for name, t in state.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            base, half = name[: -len(".gate_up_proj")], t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{base}.{j}.gate_proj.weight"] = t[j, :half].clone()
                out[f"{base}.{j}.up_proj.weight"] = t[j, half:].clone()
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len(".down_proj")]
            for j in range(t.shape[0]):
                out[f"{base}.{j}.down_proj.weight"] = t[j].clone()
        else:
            out[name] = t.clone()
    return out


def add_mtp(model_dir: Path, tcfg) -> dict[str, torch.Tensor]:
    """Add plausible mtp.* tensors (per-expert experts, as in the releases) to the last shard."""
    head = MTPHead(tcfg)
    perturb(head, seed=7, fresh=True)
    fused = {f"mtp.{k}": v.detach().to(DTYPE) for k, v in head.state_dict().items()}
    tensors = fused_to_per_expert(fused)
    index_path = model_dir / INDEX
    index = json.loads(index_path.read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    shard = load_file(model_dir / last)
    assert not set(shard) & set(tensors)
    shard.update(tensors)
    save_file(shard, model_dir / last, metadata={"format": "pt"})
    for name, t in tensors.items():
        index["weight_map"][name] = last
        index["metadata"]["total_size"] += t.numel() * t.element_size()
        if "total_parameters" in index["metadata"]:
            index["metadata"]["total_parameters"] += t.numel()
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    return fused


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35-transformers")
    torch.manual_seed(0)
    ref = Qwen3_5MoeForConditionalGeneration._from_config(tiny_config(), dtype=DTYPE, **IMPL).eval()
    perturb(ref, seed=1)
    sources = {"per_expert": root / "per_expert", "fused_mtp": root / "fused_mtp"}
    ref.save_pretrained(sources["per_expert"], max_shard_size="100KB")  # default: per-expert layout
    ref.save_pretrained(sources["fused_mtp"], max_shard_size="100KB", save_original_format=False)
    mtp = add_mtp(sources["fused_mtp"], ref.config.text_config)

    input_ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    pixel_values = torch.randn(16, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(4)).to(DTYPE)
    grid_thw = torch.tensor([[1, 4, 4]])
    with torch.no_grad():
        logits = ref(input_ids=input_ids, use_cache=False).logits
        vision = ref.model.visual(pixel_values, grid_thw=grid_thw).pooler_output
    return {
        "ref": ref, "sources": sources, "mtp": mtp, "input_ids": input_ids, "logits": logits,
        "pixel_values": pixel_values, "grid_thw": grid_thw, "vision": vision,
    }


# --------------------------------------------------------------------------- tests


def test_sources_are_what_transformers_writes(world):
    """The premises: two real layouts, several shards, and transformers ignores mtp.*."""
    per_expert = json.loads((world["sources"]["per_expert"] / INDEX).read_text())["weight_map"]
    fused = json.loads((world["sources"]["fused_mtp"] / INDEX).read_text())["weight_map"]
    layer0 = "model.language_model.layers.0.mlp.experts"
    assert f"{layer0}.7.gate_proj.weight" in per_expert and f"{layer0}.gate_up_proj" not in per_expert
    assert f"{layer0}.gate_up_proj" in fused and f"{layer0}.0.gate_proj.weight" not in fused
    assert len(set(per_expert.values())) >= 4 and len(set(fused.values())) >= 4
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in fused and "mtp.fc.weight" in fused
    assert not any(n.startswith("mtp.") for n in per_expert)
    assert any(n.startswith("model.visual.blocks.1.") for n in fused)
    types = world["ref"].config.text_config.layer_types
    assert {"linear_attention", "full_attention"} <= set(types) and len(types) == LAYERS
    for src in world["sources"].values():
        back = Qwen3_5MoeForConditionalGeneration.from_pretrained(src, **IMPL).eval()
        with torch.no_grad():
            assert torch.equal(back(input_ids=world["input_ids"], use_cache=False).logits, world["logits"])


def test_reference_loader_is_strict(world):
    """The proof's loader has teeth: foreign, missing and duplicate tensors all raise."""
    src = world["sources"]["per_expert"]
    cfg = AutoConfig.from_pretrained(src, **IMPL)
    index = json.loads((src / INDEX).read_text())["weight_map"]
    every = {}
    for file in sorted(set(index.values())):
        every.update(load_file(src / file))
    owns = owned("sglang", 0, 2, mtp_kept=False)
    mine = {n: t for n, t in every.items()
            if n.startswith(("model.visual.", "model.language_model.embed_tokens."))
            or re.match(r"model\.language_model\.layers\.[0-3]\.", n)}
    load_weights(StageModel(cfg, 0, 4, owns), mine.items())  # exactly right: fine
    with pytest.raises(KeyError, match="no parameter"):
        load_weights(StageModel(cfg, 0, 4, owns), sorted(every.items()))  # other stages' tensors
    short = dict(mine)
    short.pop("model.language_model.layers.2.mlp.experts.5.up_proj.weight")
    with pytest.raises(ValueError, match="got no tensor"):
        load_weights(StageModel(cfg, 0, 4, owns), short.items())
    twice = [*mine.items(), ("model.language_model.layers.1.input_layernorm.weight",
                             mine["model.language_model.layers.1.input_layernorm.weight"])]
    with pytest.raises(ValueError, match="already loaded"):
        load_weights(StageModel(cfg, 0, 4, owns), twice)


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
@pytest.mark.parametrize("layout", ["per_expert", "fused_mtp"])
def test_stages_load_strictly_and_reproduce_logits(world, tmp_path, layout, runtime):
    src = world["sources"][layout]
    ref_params = dict(world["ref"].named_parameters())
    source_names = set(json.loads((src / INDEX).read_text())["weight_map"])
    mtp_kept = layout == "fused_mtp"
    timings = {}
    for pp in (2, 3, 4):
        t0 = time.perf_counter()
        out = tmp_path / f"pp{pp}"
        # Small output files, so that every stage's tensors span several files.
        plan = qwen35_reshard.make_plan(qwen35_reshard.read_checkpoint(src), pp=pp, runtime=runtime,
                                        max_file_bytes=200_000)
        qwen35_reshard.write_plan(plan, out)
        sizes = server_partition(LAYERS, pp, runtime)
        starts = [sum(sizes[:r]) for r in range(pp)]
        hidden, union = None, set()
        for rank in range(pp):
            start, end = starts[rank], starts[rank] + sizes[rank]
            stage = loader.open_stage(out, pp_rank=rank)
            stage.check(pp_size=pp, start_layer=start, end_layer=end)  # the server's own view
            assert (stage.rank, stage.pp, stage.runtime) == (rank, pp, runtime)
            assert stage.mtp == ("kept" if mtp_kept else "absent")
            assert len(stage.files) >= 2

            cfg = AutoConfig.from_pretrained(stage.path, **IMPL)  # the stage's own config.json
            assert cfg.text_config.num_hidden_layers == LAYERS  # unchanged on every stage
            owns = owned(runtime, rank, pp, mtp_kept=mtp_kept)
            model = StageModel(cfg, start, end, owns).eval()
            names = load_weights(model, stage.iter_weights(device="cpu", verify=True))
            assert len(names) == len(set(names)) == len(stage.names)
            assert set(names) == set(stage.names)
            union |= set(names)

            for name, p in model.named_parameters():
                want = world["mtp"][name] if name.startswith("mtp.") else ref_params[name]
                assert torch.equal(p.data, want.data), name
            with torch.no_grad():
                if owns["pos_embed"]:  # the vision tower runs where its pos_embed is
                    got = model.model.visual(world["pixel_values"], grid_thw=world["grid_thw"]).pooler_output
                    assert torch.equal(got, world["vision"])
                hidden = run_stage(model, world["input_ids"], hidden)
        assert hidden.shape == world["logits"].shape
        assert torch.equal(hidden, world["logits"]), f"pp={pp}: logits differ from the unsplit model"
        assert union == source_names  # every source tensor reached some stage
        timings[pp] = round(time.perf_counter() - t0, 2)
    print(f"{layout}/{runtime} seconds per pp: {timings}")


def test_a_damaged_byte_stops_the_load_naming_tensor_and_file(world, tmp_path):
    """The real model's ``load_weights`` fed ``iter_weights()`` as a server does (checked by
    default, issue 37): one flipped byte in a stage file and the load raises, naming the
    tensor and the file, instead of finishing with the damaged value in a parameter."""
    src = world["sources"]["per_expert"]
    out = tmp_path / "out"
    plan = qwen35_reshard.make_plan(qwen35_reshard.read_checkpoint(src), pp=2, runtime="sglang",
                                    max_file_bytes=200_000)
    qwen35_reshard.write_plan(plan, out)
    stage = loader.open_stage(out, pp_rank=1)
    victim = [t for t in stage.tensors.values() if t.file == stage.files[0]][-1]
    with open(stage.path / victim.file, "r+b") as f:
        f.seek(victim.offset)
        byte = f.read(1)
        f.seek(victim.offset)
        f.write(bytes([byte[0] ^ 0x40]))
    sizes = server_partition(LAYERS, 2, "sglang")
    cfg = AutoConfig.from_pretrained(stage.path, **IMPL)
    model = StageModel(cfg, sizes[0], LAYERS, owned("sglang", 1, 2, mtp_kept=False)).eval()
    with pytest.raises(loader.StageError) as e:
        load_weights(model, stage.iter_weights())
    assert isinstance(e.value, DamagedStage), e.value
    assert f"{out / 'pp1' / victim.file}: the bytes of tensor {victim.name!r}" in str(e.value)
