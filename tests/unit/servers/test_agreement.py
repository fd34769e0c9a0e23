"""The servers' agreement on the partition and the commit (qwen35_reshard/servers/deployment.py),
without a server: the comparison of the ranks' views, and the exchange over a real two-process
gloo group with a ``pp_indices`` that reads VLLM_PP_LAYER_PARTITION as vLLM's ``get_pp_indices``
does (the engine tests run it with vLLM's own; tests/e2e/test_deployment.py moves a branch)."""

from __future__ import annotations

import sys

import pytest

from qwen35_reshard.loader import StageError
from qwen35_reshard.servers.deployment import one_commit, one_partition

from support.helpers import partition_exchange


def test_views_agree_on_the_partition_whatever_its_source():
    assert one_partition("vllm", [([4, 4], "4,4"), ([4, 4], None)]) == [4, 4]
    assert one_partition("vllm", [([5, 3], "5,3"), ([5, 3], "5, 3")]) == [5, 3]


@pytest.mark.parametrize("views", [
    [([4, 4], None), ([5, 3], "5,3")],
    [([4, 4], None), ("ValueError: bad", "x")],
    [("ValueError: bad", "x")],
])
def test_other_or_invalid_partitions_are_refused_naming_each_view(views):
    with pytest.raises(StageError) as e:
        one_partition("vllm", views)
    assert "\n" not in str(e.value)
    for rank, (partition, var) in enumerate(views):
        shown = ",".join(map(str, partition)) if isinstance(partition, list) else partition
        source = f"={var}" if var else " unset"
        assert f"rank {rank}: {shown} (VLLM_PP_LAYER_PARTITION{source})" in str(e.value)


AGREE = """
import os, sys, types
import torch.distributed as dist
from qwen35_reshard.loader import StageError
from qwen35_reshard.servers.deployment import agree, own_view

RUNTIME, VAR = sys.argv[3], sys.argv[4]

def pp_indices(layers, rank, size):  # the servers' get_pp_indices: the variable, else an even split
    var = os.environ.get(VAR)
    parts = [int(n) for n in var.split(",")] if var else [layers // size] * size
    return sum(parts[:rank]), sum(parts[:rank + 1])

dist.init_process_group("gloo", init_method=sys.argv[1], rank=int(sys.argv[2]), world_size=2)
try:
    group = types.SimpleNamespace(world_size=2, rank_in_group=int(sys.argv[2]), cpu_group=None)
    view = own_view("OUT", RUNTIME, group, 2, 8, pp_indices, None, None, split=True)
    print("AGREED", agree(RUNTIME, group, view)[0])
except StageError as e:
    print("REFUSED", e)
"""


@pytest.mark.parametrize("runtime, var", [
    ("vllm", "VLLM_PP_LAYER_PARTITION"), ("sglang", "SGLANG_PP_LAYER_PARTITION"),  # SGLang had none
])
@pytest.mark.parametrize("variables, want", [
    (("4,4", None), "AGREED [4, 4]"),
    ((None, "5,3"), "REFUSED the pipeline ranks' layers per rank (rank 0: 4,4 (VAR unset); "
                    "rank 1: 5,3 (VAR=5,3))"),
])
def test_ranks_exchange_their_partitions_not_their_variables(runtime, var, variables, want):
    lines, out = partition_exchange(sys.executable, AGREE, variables, variable=var, args=(runtime, var))
    assert all(ln.startswith(want.replace("VAR", var)) for ln in lines), out


A, B = "a" * 40, "b" * 40


def test_every_rank_takes_the_commit_rank_0_resolved():
    views = [{"revision": None, "commit": A, "error": None},
             {"revision": "main", "commit": None, "error": None},
             {"revision": A, "commit": None, "error": None}]
    assert one_commit(views) == A
    assert one_commit([{"revision": None, "commit": None, "error": None}] * 2) is None  # not a Hub repo


def test_a_rank_given_another_commit_is_refused_naming_both():
    views = [{"revision": "main", "commit": A, "error": None}, {"revision": B, "commit": None, "error": None}]
    with pytest.raises(StageError, match=f"rank 0 serves revision 'main' at commit {A}, rank 1 was given "
                                         f"revision '{B}'.*--revision {A}$"):
        one_commit(views)


def test_rank_0_failing_to_resolve_is_every_ranks_error():
    views = [{"revision": "x", "commit": None, "error": "Qwen/Tiny: revision 'x' not found"},
             {"revision": "x", "commit": None, "error": None}]
    with pytest.raises(StageError, match="rank 0 resolves the model's revision for every rank: Qwen/Tiny"):
        one_commit(views)
