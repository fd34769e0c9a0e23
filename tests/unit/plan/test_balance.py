"""``--partition balanced``: the optimum against an independent brute force, capacity mode by hand.

The reference here shares nothing with the code under test: layer bytes come from parsing the
shard headers with struct/json, the placement of every other tensor from the facts doc
(``ref.owners`` in conftest), and the optimum from an exhaustive search over contiguous splits
(branches cut only when they provably cannot beat the best split found).
"""

from __future__ import annotations

import importlib.util

import pytest

from qwen35_reshard import ReshardError, make_plan, read_checkpoint
from qwen35_reshard.model.runtimes import servable
from qwen35_reshard.plan.balance import Costs, balance, choose, evaluate
from qwen35_reshard.plan.capacity import Capacity, Serving, linear_state_bytes, serving_costs

from support.checkpoints import SMALL, header_sizes
from support.checks import check_split
from support.helpers import ROOT

GB = 1e9
RUNTIMES = ("sglang", "vllm")


# --------------------------------------------------------------------------- the reference


def fixed_costs(ref, others, *, num_layers, pp, runtime, tied, keep_mtp):
    """Bytes on each stage of everything but the decoder layers (facts doc §3 placement)."""
    fixed = [0] * pp
    has_mtp = any(name.startswith("mtp.") for name in others)
    even = ref.split(num_layers, pp, runtime)
    for name, n in others.items():
        if name.startswith("mtp.") and not keep_mtp:
            continue
        for r in ref.owners(name, partition=even, runtime=runtime, tied=tied, mtp_kept=has_mtp and keep_mtp):
            fixed[r] += n
    return fixed


def brute_force(layers, fixed, *, allowed, default):
    """The best split by exhaustive search: the least bytes on the fullest stage, then the
    smallest sum of squared layer counts, then the default split, then the smallest sum of
    squared stage bytes. A branch is cut when its stages so far, or an even spread of what is
    left, already exceed the best fullest stage found (layer bytes are positive)."""
    n, pp = len(layers), len(fixed)
    rest = [sum(layers[i:]) for i in range(n + 1)]
    rest_fixed = [sum(fixed[r:]) for r in range(pp + 1)]
    best = {"key": None, "split": None}

    def consider(split):
        bounds = [0]
        for s in split:
            bounds.append(bounds[-1] + s)
        totals = [sum(layers[bounds[r] : bounds[r + 1]]) + fixed[r] for r in range(pp)]
        key = (max(totals), sum(s * s for s in split), split != list(default), sum(t * t for t in totals))
        if best["key"] is None or key < best["key"]:
            best["key"], best["split"] = key, list(split)

    def search(r, start, split):
        bound = None if best["key"] is None else best["key"][0]
        if bound is not None and rest[start] + rest_fixed[r] > (pp - r) * bound:
            return
        if r == pp - 1:
            if allowed(start, n) and (bound is None or rest[start] + fixed[r] <= bound):
                consider([*split, n - start])
            return
        total = fixed[r]
        for end in range(start + 1, n - (pp - r - 1) + 1):
            total += layers[end - 1]
            if bound is not None and total > bound:
                break
            if allowed(start, end):
                search(r + 1, end, [*split, end - start])

    bounds = [0]
    for s in default:
        bounds.append(bounds[-1] + s)
    if all(allowed(bounds[r], bounds[r + 1]) for r in range(pp)):
        consider(list(default))  # a first bound, so the search cuts early
    search(0, 0, [])
    return best["split"], None if best["key"] is None else best["key"][0]


def full_attention(config, num_layers):
    text = config.get("text_config", config)
    return [text["layer_types"][i] == "full_attention" for i in range(num_layers)]


def check_against_brute_force(ref, ckpt, sizes, *, pp, runtime, keep_mtp):
    layers, others = sizes
    text = ckpt.config.get("text_config", ckpt.config)
    tied = bool(ckpt.config.get("tie_word_embeddings", text.get("tie_word_embeddings")))
    fixed = fixed_costs(
        ref, others, num_layers=ckpt.num_layers, pp=pp, runtime=runtime, tied=tied, keep_mtp=keep_mtp
    )
    full = full_attention(ckpt.config, ckpt.num_layers)
    # vLLM cannot run a stage without a full-attention layer (measured on its CPU build).
    allowed = (lambda i, j: any(full[i:j])) if runtime == "vllm" else (lambda i, j: True)
    default = ref.split(ckpt.num_layers, pp, runtime)
    expected, fullest = brute_force(layers, fixed, allowed=allowed, default=default)
    if expected is None:
        with pytest.raises(ReshardError, match="no split .* can be served by vllm"):
            choose(ckpt, pp=pp, runtime=runtime, keep_mtp=keep_mtp)
        return None
    choice = choose(ckpt, pp=pp, runtime=runtime, keep_mtp=keep_mtp)
    assert list(choice.partition) == expected
    assert max(s.total_bytes for s in choice.stages) == fullest
    assert choice.default_optimal == (expected == default)
    return choice


# --------------------------------------------------------------------------- test checkpoints

@pytest.fixture(scope="module")
def small(ref, make_checkpoint):
    out = {}
    for key, kw in SMALL.items():
        model = make_checkpoint(**kw)
        out[key] = (read_checkpoint(model), header_sizes(ref, model))
    return out


@pytest.mark.parametrize("keep_mtp", [True, False], ids=["mtp", "no_mtp"])
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("kind", sorted(SMALL))
def test_balanced_is_the_brute_force_optimum(ref, small, kind, runtime, keep_mtp):
    ckpt, sizes = small[kind]
    for pp in range(2, 9):
        choice = check_against_brute_force(ref, ckpt, sizes, pp=pp, runtime=runtime, keep_mtp=keep_mtp)
        if choice is None:
            continue
        # What the optimiser counted is what the plan puts in each stage directory.
        plan = make_plan(ckpt, pp=pp, runtime=runtime, partition=list(choice.partition), keep_mtp=keep_mtp)
        assert [s.data_bytes for s in plan.stages] == [s.total_bytes for s in choice.stages]


def test_vllm_never_gets_a_stage_without_full_attention(small):
    ckpt, _ = small["fp8_big_vocab"]  # 24 layers, 6 of them full attention
    types = ckpt.config["text_config"]["layer_types"]
    for pp in range(2, 7):
        choice = choose(ckpt, pp=pp, runtime="vllm")
        assert servable("vllm", types, list(choice.partition)) is None
    with pytest.raises(
        ReshardError, match="no split of the 24 decoder layers into 7 stages can be served by vllm"
    ):
        choose(ckpt, pp=7, runtime="vllm")


@pytest.mark.slow  # the 397B-shaped checkpoint (~189,000 tensors)
@pytest.mark.parametrize("keep_mtp", [True, False], ids=["mtp", "no_mtp"])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_balanced_is_the_brute_force_optimum_on_the_397b_fp8_shape(ref, fixture_397b, runtime, keep_mtp):
    ckpt, sizes = fixture_397b
    for pp in range(2, 9):
        check_against_brute_force(ref, ckpt, sizes, pp=pp, runtime=runtime, keep_mtp=keep_mtp)


@pytest.mark.slow  # the 397B-shaped checkpoint (~189,000 tensors)
def test_balanced_is_quick_on_the_397b_fp8_shape_at_pp16(fixture_397b):
    # Not a timing test: the balanced split must exist for every pp and stay plannable.
    ckpt, _ = fixture_397b
    choice = choose(ckpt, pp=16, runtime="sglang")
    assert sum(choice.partition) == 60 and len(choice.partition) == 16
    with pytest.raises(ReshardError, match="into 16 stages can be served by vllm"):
        choose(ckpt, pp=16, runtime="vllm")  # 15 full-attention layers for 16 stages


# --------------------------------------------------------------------------- the issue's numbers


@pytest.fixture(scope="module")
def shapes():
    """benchmarks/partition_table.py, whose ``checkpoint(shape, dtype)`` gives a headers-only
    Checkpoint of a real model shape (names, shapes, dtypes; no files)."""
    path = ROOT / "benchmarks" / "partition_table.py"
    spec = importlib.util.spec_from_file_location("partition_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def issue_costs(shapes, shape, dtype, pp):
    """SGLang costs with MTP kept, the vision tower counted once on the first stage as the
    issue's numbers did, whatever the current placement rule for it is; and the default."""
    choice = choose(shapes.checkpoint(shape, dtype), pp=pp, runtime="sglang")
    fixed = [{k: v for k, v in f.items() if not k.startswith("visual")} for f in choice.costs.fixed]
    # The first stage holds the whole tower under every rule so far (pos_embed included).
    fixed[0]["visual"] = sum(v for k, v in choice.costs.fixed[0].items() if k.startswith("visual"))
    return Costs(choice.costs.layer_bytes, choice.costs.full_attention, tuple(fixed)), list(choice.default)


def _fullest(costs, partition):
    return max(s.total_bytes for s in evaluate(costs, partition))


def test_the_issues_numbers_from_shapes(shapes):
    c, default = issue_costs(shapes, "397B-A17B", "BF16", 4)
    stages = evaluate(c, default)
    assert [round(s.total_bytes / GB, 2) for s in stages] == [200.12, 197.15, 197.15, 214.41]
    last = stages[-1].parts
    assert (round(last["lm_head"] / GB, 1), round(last["embed"] / GB, 1), round(last["mtp"] / GB, 1)) == (
        2.0,
        2.0,
        13.2,
    )
    best = balance(c, default=default)
    assert best == [15, 15, 16, 14] and round(_fullest(c, best) / GB, 2) == 210.30

    c, default = issue_costs(shapes, "397B-A17B", "BF16", 8)
    best = balance(c, default=default)
    assert round(_fullest(c, default) / GB, 2) == 122.41 and round(_fullest(c, best) / GB, 2) == 105.15
    assert round(1 - _fullest(c, best) / _fullest(c, default), 2) == 0.14

    c, default = issue_costs(shapes, "397B-A17B", "FP8", 8)
    best = balance(c, default=default)
    assert round(1 - _fullest(c, best) / _fullest(c, default), 3) == 0.169

    c, default = issue_costs(shapes, "35B-A3B", "FP8", 8)
    best = balance(c, default=default)
    assert (round(_fullest(c, default) / GB, 2), round(_fullest(c, best) / GB, 2)) == (7.09, 5.05)


# --------------------------------------------------------------------------- capacity mode

TEXT_397B = {  # the state-relevant keys of Qwen3.5-397B-A17B's text_config
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_num_value_heads": 64,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
}


def test_state_per_request_by_hand():
    # conv (2*16*128 + 64*128) * 3 * 2 B = 73,728; recurrent 64 * 128 * 128 * 4 B = 4,194,304.
    assert linear_state_bytes(TEXT_397B, "sglang", 1) == 73_728 + 4_194_304
    assert linear_state_bytes(TEXT_397B, "vllm", 1) == 73_728 + 2_097_152  # BF16 recurrent state
    assert linear_state_bytes({**TEXT_397B, "mamba_ssm_dtype": "float32"}, "vllm", 1) == 73_728 + 4_194_304
    assert linear_state_bytes(TEXT_397B, "sglang", 8) == 73_728 // 8 + 4_194_304 // 8
    kv = {
        tp: serving_costs(TEXT_397B, "sglang", Capacity(80 * 10**9, 0.9, tp, 1024), draft_layers=1)
        for tp in (1, 2, 8)
    }
    # 2 (K, V) x kv heads per GPU (2, then 1: replicated beyond 2) x 256 x 2 B
    assert [kv[tp].kv_bytes_per_token for tp in (1, 2, 8)] == [2048, 1024, 1024]
    assert kv[8].budget_bytes == 72 * 10**9 and kv[8].draft_layers == 1


@pytest.mark.parametrize("ssm", ["float8", ["float32"], {"dtype": "float32"}])
def test_odd_mamba_ssm_dtype_is_refused_in_one_line(ssm):
    # A list or object in config.json is no dtype name either: refused, not a TypeError.
    with pytest.raises(ReshardError, match=r"mamba_ssm_dtype .* is not one of float32"):
        linear_state_bytes({**TEXT_397B, "mamba_ssm_dtype": ssm}, "sglang", 1)


def test_capacity_mode_by_hand():
    # Four layers of 10 bytes, only the last one full attention; the last stage has 5 bytes
    # of lm_head. 100 bytes per GPU, 1-token context, 10 B of KV per token per full layer,
    # 1 B of state per linear layer:
    #   [1,3]: 90 free / 1 per request = 90 | 65 / (10 + 2) = 5   -> 5 requests, fullest 35 B
    #   [2,2]: 80 / 2 = 40                  | 75 / (10 + 1) = 6   -> 6 requests, fullest 25 B
    #   [3,1]: 70 / 3 = 23                  | 85 / 10 = 8         -> 8 requests, fullest 30 B
    costs = Costs((10, 10, 10, 10), (False, False, False, True), ({}, {"lm_head": 5}))
    serving = Serving(
        budget_bytes=100, tp=1, context_length=1, kv_bytes_per_token=10, linear_state_bytes=1, draft_layers=0
    )
    assert balance(costs, default=[2, 2]) == [2, 2]
    assert balance(costs, default=[2, 2], serving=serving) == [3, 1]
    loads = evaluate(costs, [3, 1], serving)
    assert [(s.free_bytes, s.requests) for s in loads] == [(70, 23), (85, 8)]
    # The MTP draft's KV on the last stage: [3,1] 85 / 20 = 4, [2,2] 75 / 21 = 3, [1,3] 65 / 22 = 2.
    draft = Serving(100, 1, 1, 10, 1, 1)
    assert balance(costs, default=[2, 2], serving=draft) == [3, 1]
    assert [s.requests for s in evaluate(costs, [3, 1], draft)] == [23, 4]
    # Two GPUs per stage halve the weights: [3,1] 100-15=85 / 3 = 28 | 100-8=92 / 10 = 9.
    assert [s.requests for s in evaluate(costs, [3, 1], Serving(100, 2, 1, 10, 1, 0))] == [28, 9]
    # Weights that do not fit leave no room: free is negative, requests 0.
    assert [s.requests for s in evaluate(costs, [3, 1], Serving(20, 1, 1, 10, 1, 0))] == [0, 0]


def _compositions(n, k):
    from itertools import combinations

    for cuts in combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        yield [bounds[i + 1] - bounds[i] for i in range(k)]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_capacity_mode_is_the_brute_force_optimum(ref, small, runtime):
    ckpt, (layers, others) = small["fp8_big_vocab"]
    text = ckpt.config["text_config"]
    full = full_attention(ckpt.config, ckpt.num_layers)
    # Per GPU at tp=2, by the formulas of docs/partition.md, computed here from the config.
    tp, context = 2, 64
    kv = 2 * max(1, text["num_key_value_heads"] // tp) * text["head_dim"] * 2
    conv = (
        2 * text["linear_num_key_heads"] * text["linear_key_head_dim"]
        + text["linear_num_value_heads"] * text["linear_value_head_dim"]
    )
    recurrent = text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"]
    state = -(-conv // tp) * 3 * 2 + -(-recurrent // tp) * (4 if runtime == "sglang" else 2)
    for pp in (2, 3, 4):
        fixed = fixed_costs(
            ref, others, num_layers=ckpt.num_layers, pp=pp, runtime=runtime, tied=False, keep_mtp=True
        )
        weights = max(sum(layers[: ckpt.num_layers // pp]) + fixed[0], sum(layers) // pp)
        gpu = 2 * weights  # tight: the split decides how many requests fit
        budget = int(gpu * 0.9)
        default = ref.split(ckpt.num_layers, pp, runtime)
        best = None
        for split in _compositions(ckpt.num_layers, pp):
            bounds = [0]
            for s in split:
                bounds.append(bounds[-1] + s)
            if runtime == "vllm" and not all(any(full[bounds[r] : bounds[r + 1]]) for r in range(pp)):
                continue
            totals, requests = [], []
            for r in range(pp):
                total = sum(layers[bounds[r] : bounds[r + 1]]) + fixed[r]
                n_full = sum(full[bounds[r] : bounds[r + 1]])
                per = context * kv * (n_full + (1 if r == pp - 1 else 0)) + (split[r] - n_full) * state
                totals.append(total)
                requests.append(max(0, (budget - -(-total // tp)) // per))
            key = (
                -min(requests),
                max(totals),
                sum(s * s for s in split),
                split != default,
                sum(t * t for t in totals),
            )
            if best is None or key < best[0]:
                best = (key, split)
        choice = choose(ckpt, pp=pp, runtime=runtime, capacity=Capacity(gpu, 0.9, tp, context))
        assert list(choice.partition) == best[1]
        assert min(s.requests for s in choice.stages) == -best[0][0]


@pytest.mark.slow  # the 397B-shaped checkpoint (~189,000 tensors)
def test_the_default_is_reported_optimal_where_it_is(fixture_397b):
    # Without MTP the runtimes' even splits are already the best for the 397B shape.
    ckpt, _ = fixture_397b
    for runtime, pp in (("sglang", 4), ("vllm", 8)):
        choice = choose(ckpt, pp=pp, runtime=runtime, keep_mtp=False)
        assert choice.default_optimal and choice.partition == choice.default
        assert choice.default_stages == choice.stages
    assert not choose(ckpt, pp=4, runtime="sglang", keep_mtp=True).default_optimal


def test_the_balanced_split_is_written_and_verified_like_an_explicit_one(ref, make_checkpoint, tmp_path):
    from qwen35_reshard import reshard
    from qwen35_reshard.verify import verify

    model = make_checkpoint(**SMALL["untied"])
    choice = choose(read_checkpoint(model), pp=3, runtime="vllm")
    assert not choice.default_optimal  # MTP on the last stage: the even split is not the best
    out = tmp_path / "out"
    reshard(model, out, pp=3, runtime="vllm", partition=list(choice.partition))
    check_split(ref, model, out, pp=3, runtime="vllm", partition=list(choice.partition))
    assert verify(out, model).ok
