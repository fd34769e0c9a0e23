"""``check_split``: a split checked against its source and the facts doc, with readers that are
not the tool's (``safetensors.safe_open`` for names, dtypes and shapes; plain reads at offsets
parsed with json/struct for the bytes)."""

from __future__ import annotations

import json
import os
import re

from safetensors import safe_open

from qwen35_reshard.format.digest import XXH128, hexdigest

INDEX = "model.safetensors.index.json"
STAGE_MANIFEST = "reshard-stage.json"
RUN_MANIFEST = "reshard.json"
SHARD_RE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")


def check_split(ref, model, out, *, pp, runtime="sglang", partition=None, keep_mtp=True, ranks=None):
    """Check OUT against the source and the facts doc; return the expected tensors per stage."""
    src = ref.read_source(model)
    partition = list(partition or ref.split(src.num_layers, pp, runtime))
    has_mtp = any(n.startswith("mtp.") for n in src.tensors)
    dropped = sorted(n for n in src.tensors if n.startswith("mtp.")) if not keep_mtp else []
    expected: list[set[str]] = [set() for _ in range(pp)]
    for name in src.tensors:
        if name in dropped:
            continue
        for r in ref.owners(
            name, partition=partition, runtime=runtime, tied=src.tied, mtp_kept=has_mtp and keep_mtp
        ):
            expected[r].add(name)
    built = sorted(set(ranks)) if ranks is not None else list(range(pp))
    mtp = "absent" if not has_mtp else "kept" if keep_mtp else "dropped"
    env = ref.launch_env(runtime, partition)
    starts = [sum(partition[:r]) for r in range(pp)]
    layers = [{"start": starts[r], "end": starts[r] + partition[r]} for r in range(pp)]

    # vLLM serves OUT itself with --load-format qwen35-stages: its config and tokenizer are there too.
    root_files = src.side_files
    assert sorted(os.listdir(out)) == sorted([RUN_MANIFEST, *(f"pp{r}" for r in built), *root_files])
    for name, data in root_files.items():
        assert (out / name).read_bytes() == data, name
    run = json.loads((out / RUN_MANIFEST).read_bytes())
    assert (run["pp"], run["runtime"], run["partition"], run["launch_env"]) == (pp, runtime, partition, env)
    assert run["mtp"] == mtp and sorted(run["dropped"]) == dropped
    assert [s["layers"] for s in run["stages"]] == layers
    assert [s["dir"] for s in run["stages"]] == [f"pp{r}" for r in range(pp)]
    copies = {n: sum(n in e for e in expected) for n in src.tensors}
    for r, s in enumerate(run["stages"]):
        assert s["complete"] == (r in built)
        assert s["tensors"] == len(expected[r])
        assert s["source_files"] == sorted({src.tensors[n].file for n in expected[r]})
        assert s["replicated"] == sorted(n for n in expected[r] if copies[n] > 1)

    for r in built:
        stage = out / f"pp{r}"
        listing = sorted(os.listdir(stage))
        weights = [n for n in listing if n.endswith(".safetensors")]
        assert listing == sorted([*src.side_files, INDEX, STAGE_MANIFEST, *weights]), stage
        assert "config.json" in src.side_files
        for name, data in src.side_files.items():
            assert not (stage / name).is_symlink()
            assert (stage / name).read_bytes() == data, f"{stage / name} differs from the source"

        index = json.loads((stage / INDEX).read_bytes())
        weight_map = index["weight_map"]
        assert set(weight_map) == expected[r], f"pp{r} holds the wrong tensors"
        assert set(weight_map.values()) == set(weights), "index and directory disagree on files"
        assert index["metadata"]["total_size"] == sum(len(src.tensors[n].data) for n in weight_map)
        assert run["stages"][r]["files"] == len(weights)
        assert run["stages"][r]["bytes"] == sum((stage / w).stat().st_size for w in weights)
        numbers = sorted(tuple(map(int, SHARD_RE.fullmatch(w).groups())) for w in weights)
        assert numbers == [(k, len(weights)) for k in range(1, len(weights) + 1)]

        manifest = json.loads((stage / STAGE_MANIFEST).read_bytes())
        assert (manifest["stage"], manifest["pp"], manifest["runtime"]) == (r, pp, runtime)
        assert manifest["partition"] == partition and manifest["launch_env"] == env
        assert manifest["layers"] == layers[r] and manifest["mtp"] == mtp
        assert set(manifest["tensors"]) == expected[r]

        for w in weights:
            path = stage / w
            assert not path.is_symlink()
            in_file = {n for n, f in weight_map.items() if f == w}
            with safe_open(str(path), "pt") as f:  # the reference reader accepts the file
                assert set(f.keys()) == in_file
                assert f.metadata() == {"format": "pt"}
                for name in in_file:
                    s = src.tensors[name]
                    assert f.get_slice(name).get_dtype() == s.dtype, name
                    assert tuple(f.get_slice(name).get_shape()) == s.shape, name
            _, got = ref.read_safetensors(path)
            for name in in_file:
                s = src.tensors[name]
                assert got[name].data == s.data, f"{name}: bytes differ from the source"
                entry = manifest["tensors"][name]
                assert entry["file"] == w and entry["source_file"] == s.file, name
                assert (entry["dtype"], tuple(entry["shape"]), entry["nbytes"]) == (
                    s.dtype,
                    s.shape,
                    len(s.data),
                )
                assert entry["xxh128"] == hexdigest(XXH128, s.data), name
                assert entry["replicated"] == (copies[name] > 1), name
    return expected
