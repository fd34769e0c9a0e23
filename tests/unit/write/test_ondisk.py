"""The on-disk formats: a stage manifest encoded column by column (``ManifestDraft``) is, byte
for byte, what ``dumps`` writes for the manifest as a dict, whatever the tensor names."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from qwen35_reshard import Parallelism, make_plan, read_checkpoint
from qwen35_reshard.format.jsonio import dumps
from qwen35_reshard.write.manifest import ManifestDraft, stage_manifest

# Names json has to escape (quote, backslash, control character) or keeps as they are
# (non-ASCII, since manifests are written with ensure_ascii=False).
ODD = ['a"quoted"', "back\\slash", "tab\there", "newline\n", "ünïcödé", "日本", "€", "x" * 300]


def _expected(head: dict, files, digests: dict) -> dict:
    """The manifest as a dict, built the plain way."""
    tensors = {
        t.name: {
            "file": f.name,
            "dtype": t.source.dtype,
            "shape": list(t.source.shape),
            "nbytes": t.source.nbytes,
            "xxh128": digests[t.name],
            "source_file": t.source.file,
            "replicated": t.replicated,
        }
        for f in files
        for t in f.tensors
    }
    return {**head, "tensors": dict(sorted(tensors.items()))}


def _renamed(files, names: dict[str, str]):
    return tuple(
        dataclasses.replace(
            f, tensors=tuple(t._replace(source=t.source._replace(name=names[t.name])) for t in f.tensors)
        )
        for f in files
    )


@pytest.mark.parametrize("layout", ["fused", "per_expert_fp8"])
def test_a_manifest_draft_encodes_as_dumps_of_the_manifest(make_checkpoint, layout):
    plan = make_plan(read_checkpoint(make_checkpoint(layout=layout)), pp=2, runtime="sglang")
    rng = random.Random(layout)
    for stage in plan.stages:
        # Names shuffled against the data order, some odd, so that sorting and escaping both count.
        names = [t.name for t in stage.tensors]
        odd = {n: (ODD[i % len(ODD)] + n if i % 7 == 0 else n) for i, n in enumerate(names)}
        files = _renamed(stage.files, odd)
        digests = {n: (rng.randbytes(32).hex() if rng.random() < 0.5 else None) for n in odd.values()}
        head = {"format": "test", "stage": stage.rank, "files": {f.name: {"bytes": f.size} for f in files}}
        expected = _expected(head, files, digests)
        encoded = ManifestDraft(head, files).encode(digests)
        assert encoded == dumps(expected)
        assert json.loads(encoded) == expected


def test_a_stage_manifest_needs_every_digest(make_checkpoint):
    plan = make_plan(read_checkpoint(make_checkpoint(layout="fused")), pp=2, runtime="sglang")
    stage = plan.stages[0]
    digests = dict.fromkeys(t.name for t in stage.tensors)
    draft = stage_manifest(plan, stage, b"{}", {})
    assert json.loads(draft.encode(digests))["tensors"].keys() == digests.keys()
    missing = next(iter(digests))
    del digests[missing]
    with pytest.raises(KeyError, match=missing):
        draft.encode(digests)


def test_a_manifest_without_tensors():
    head = {"format": "test", "files": {}}
    assert ManifestDraft(head, ()).encode({}) == dumps({**head, "tensors": {}})


@pytest.mark.parametrize("ep", [1, 4])
def test_a_written_stage_manifest_has_the_fields_its_reader_decodes_in_one_pass(make_checkpoint, ep):
    """The reader decodes a manifest of exactly STAGE_FIELDS in one typed pass (any other field
    sends it down the exact, slower path): the writer writes exactly those, in that order (a
    node's "node" entry only in a node's)."""
    from qwen35_reshard.format.manifest import STAGE_FIELDS
    from qwen35_reshard.stage.manifest import decode_stage_manifest

    ckpt = read_checkpoint(make_checkpoint(layout="per_expert_fp8"))
    plan = make_plan(ckpt, Parallelism(pp=2, runtime="vllm", ep=ep, nodes=2 if ep > 1 else 1))
    stage = plan.stages[1]
    raw = stage_manifest(plan, stage, b"{}", {}).encode(dict.fromkeys(t.name for t in stage.tensors))
    assert tuple(json.loads(raw)) == tuple(f for f in STAGE_FIELDS if ep > 1 or f != "node")
    assert decode_stage_manifest(raw) == json.loads(raw) | {"tensors": decode_stage_manifest(raw)["tensors"]}
    assert decode_stage_manifest(raw.replace(b'"format"', b'"formats"', 1)) is None
