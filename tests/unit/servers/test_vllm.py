"""The vLLM loader's agreement on the partition (qwen35_reshard/servers/vllm.py), without vLLM:
the comparison of the ranks' views, and the exchange over a real two-process gloo group with a
``pp_indices`` that reads VLLM_PP_LAYER_PARTITION as vLLM's ``get_pp_indices`` does (the
engine tests run it with vLLM's own)."""

from __future__ import annotations

import sys

import pytest

from qwen35_reshard.loader import StageError
from qwen35_reshard.servers.vllm import one_partition

from support.helpers import partition_exchange


def test_views_agree_on_the_partition_whatever_its_source():
    assert one_partition([([4, 4], "4,4"), ([4, 4], None)]) == [4, 4]
    assert one_partition([([5, 3], "5,3"), ([5, 3], "5, 3")]) == [5, 3]


@pytest.mark.parametrize("views", [
    [([4, 4], None), ([5, 3], "5,3")],
    [([4, 4], None), ("ValueError: bad", "x")],
    [("ValueError: bad", "x")],
])
def test_other_or_invalid_partitions_are_refused_naming_each_view(views):
    with pytest.raises(StageError) as e:
        one_partition(views)
    assert "\n" not in str(e.value)
    for rank, (partition, var) in enumerate(views):
        shown = ",".join(map(str, partition)) if isinstance(partition, list) else partition
        source = f"={var}" if var else " unset"
        assert f"rank {rank}: {shown} (VLLM_PP_LAYER_PARTITION{source})" in str(e.value)


AGREE = """
import os, sys, types
import torch.distributed as dist
from qwen35_reshard.loader import StageError
from qwen35_reshard.servers.vllm import agreed_partition

def pp_indices(layers, rank, size):  # vLLM's get_pp_indices: the variable, else an even split
    var = os.environ.get("VLLM_PP_LAYER_PARTITION")
    parts = [int(n) for n in var.split(",")] if var else [layers // size] * size
    return sum(parts[:rank]), sum(parts[:rank + 1])

dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
try:
    print("AGREED", agreed_partition(types.SimpleNamespace(world_size=2, cpu_group=None), 8, pp_indices))
except StageError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("variables, want", [
    (("4,4", None), "AGREED [4, 4]"),
    ((None, "5,3"), "REFUSED "),
])
def test_ranks_exchange_their_partitions_not_their_variables(variables, want):
    lines, out = partition_exchange(sys.executable, AGREE, variables)
    assert all(ln.startswith(want) for ln in lines), out
