"""Default layer splits of both runtimes, explicit partitions and the launch line."""

from __future__ import annotations

import pytest

from qwen35_reshard.errors import ReshardError
from qwen35_reshard.model.runtimes import (
    check_pp,
    default_partition,
    launch_env,
    layer_ranges,
    parse_partition,
)

# The worked examples of the facts doc, §3, verbatim.
WORKED_EXAMPLES = [
    ("sglang", 48, 5, [9, 9, 10, 10, 10]),
    ("sglang", 94, 8, [11, 11, 12, 12, 12, 12, 12, 12]),
    ("vllm", 48, 5, [9, 10, 10, 10, 9]),
    ("vllm", 40, 3, [13, 14, 13]),
    ("vllm", 94, 8, [11, 12, 12, 12, 12, 12, 12, 11]),
]


@pytest.mark.parametrize(("runtime", "layers", "pp", "expected"), WORKED_EXAMPLES)
def test_worked_examples(runtime, layers, pp, expected):
    assert default_partition(layers, pp, runtime) == expected


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
@pytest.mark.parametrize(("layers", "pp"), [(8, 1), (8, 2), (8, 4), (60, 4), (48, 6), (40, 40)])
def test_even_splits(runtime, layers, pp):
    assert default_partition(layers, pp, runtime) == [layers // pp] * pp


def test_every_split_up_to_100_layers_matches_the_doc_rule(ref):
    for layers in range(1, 101):
        for pp in range(1, layers + 1):
            for runtime in ("sglang", "vllm"):
                sizes = default_partition(layers, pp, runtime)
                assert sizes == ref.split(layers, pp, runtime), (runtime, layers, pp)


@pytest.mark.parametrize(("layers", "pp"), [(48, 5), (94, 8), (40, 3), (8, 3), (10, 4), (61, 7), (9, 8)])
def test_split_shapes(layers, pp):
    base, rem = divmod(layers, pp)
    sg = default_partition(layers, pp, "sglang")
    vl = default_partition(layers, pp, "vllm")
    for sizes in (sg, vl):
        assert sum(sizes) == layers and len(sizes) == pp
        assert set(sizes) <= {base, base + 1} and sizes.count(base + 1) == rem
    # SGLang: non-decreasing, the extras at the end. vLLM: the last rank never gets one.
    assert sg == sorted(sg) and sg[pp - rem :] == [base + 1] * rem
    assert vl[-1] == base
    if rem:
        assert vl[pp - 1 - rem : pp - 1] == [base + 1] * rem


def test_pp_equal_to_layers_gives_one_layer_each():
    assert default_partition(8, 8, "sglang") == [1] * 8
    assert default_partition(8, 8, "vllm") == [1] * 8


@pytest.mark.parametrize("pp", [0, -1, 9, 100])
def test_bad_pp_is_refused(pp):
    with pytest.raises(ReshardError, match=r"\bpp\b"):
        check_pp(8, pp)
    with pytest.raises(ReshardError):
        default_partition(8, pp, "sglang")


def test_unknown_runtime_is_refused():
    with pytest.raises(ReshardError, match="tgi"):
        default_partition(8, 2, "tgi")


def test_layer_ranges_are_contiguous_global_ids():
    assert layer_ranges([9, 9, 10, 10, 10]) == [(0, 9), (9, 18), (18, 28), (28, 38), (38, 48)]
    assert layer_ranges([8]) == [(0, 8)]


@pytest.mark.parametrize(
    ("runtime", "sizes", "line"),
    [
        ("sglang", [2, 3, 3], "SGLANG_PP_LAYER_PARTITION=2,3,3"),
        ("vllm", [13, 14, 13], "VLLM_PP_LAYER_PARTITION=13,14,13"),
        ("sglang", [8], "SGLANG_PP_LAYER_PARTITION=8"),
    ],
)
def test_launch_env(runtime, sizes, line):
    assert launch_env(runtime, sizes) == line


@pytest.mark.parametrize(
    ("text", "pp", "expected"),
    [
        ("15,15,15,15", 4, [15, 15, 15, 15]),
        ("1,59", 2, [1, 59]),
        ("60", 1, [60]),
        (" 20, 20 ,20", 3, [20] * 3),
    ],
)
def test_parse_partition(text, pp, expected):
    assert parse_partition(text, pp=pp, num_layers=60) == expected


@pytest.mark.parametrize(
    ("text", "pp", "needle"),
    [
        ("15,15,15", 4, "3 entries"),  # wrong count
        ("15,15,15,16", 4, "sums to 61"),  # wrong sum
        ("30,30,0,0", 4, "at least one layer"),  # an empty stage
        ("31,30,-1", 3, "at least one layer"),
        ("a,b", 2, "integers"),
        ("30;30", 2, "integers"),
        ("30.0,30", 2, "integers"),
        ("", 1, "integers"),
    ],
)
def test_parse_partition_rejects(text, pp, needle):
    with pytest.raises(ReshardError, match=needle):
        parse_partition(text, pp=pp, num_layers=60)
