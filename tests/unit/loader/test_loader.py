"""The loader shim on small synthetic stages: what it yields, what it reads, what it refuses."""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import struct
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import qwen35_reshard
from qwen35_reshard import loader
from qwen35_reshard.errors import DamagedStage, ReshardError
from qwen35_reshard.format.digest import XXH128, hexdigest
from qwen35_reshard.format.dtypes import DTYPE_SIZES, DTYPES
from qwen35_reshard.source.header import encode_header, read_header
from qwen35_reshard.stage import digestpool
from qwen35_reshard.write import writer as write

from support.helpers import run_without

INDEX = "model.safetensors.index.json"
MANIFEST = "reshard-stage.json"


@pytest.fixture(scope="module")
def source(make_checkpoint):
    """An FP8 per-expert checkpoint (F32, BF16 and F8_E4M3 tensors) with mtp.* and a vision tower."""
    return make_checkpoint(layout="per_expert_fp8", mtp=True, vision=True, shard_bytes=100_000)


def split(source, out, *, pp, runtime="sglang", max_file_bytes=150_000):
    """Split with small output files, so that every stage spans several files."""
    plan = qwen35_reshard.make_plan(qwen35_reshard.read_checkpoint(source), pp=pp, runtime=runtime,
                                    max_file_bytes=max_file_bytes)
    qwen35_reshard.write_plan(plan, out)
    return out


@pytest.fixture
def out(source, tmp_path):
    """A fresh pp=3 SGLang split: partition 2,3,3 of the 8 layers, several files per stage."""
    out = split(source, tmp_path / "out", pp=3)
    assert all(len(loader.open_stage(out, pp_rank=r).files) >= 2 for r in range(3))
    return out


def raw_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert isinstance(e.value, loader.StageError) and isinstance(e.value, ReshardError)
    assert "\n" not in msg and msg
    return msg


# --------------------------------------------------------------------------- opening


def test_run_dir_with_rank_and_stage_dir_open_the_same_stage(out):
    a = loader.open_stage(out, pp_rank=1)
    b = loader.open_stage(out / "pp1")
    c = loader.open_stage(str(out / "pp1"), pp_rank=1)
    for s in (a, b, c):
        assert (s.rank, s.pp, s.runtime, s.partition) == (1, 3, "sglang", (2, 3, 3))
        assert (s.start_layer, s.end_layer, s.num_layers, s.mtp) == (2, 5, 8, "kept")
        assert s.launch_env == "SGLANG_PP_LAYER_PARTITION=2,3,3"
        assert s.names == a.names
    index = json.loads((out / "pp1" / INDEX).read_text())
    assert set(a.names) == set(index["weight_map"]) and len(a) == len(index["weight_map"])
    assert a.files == tuple(sorted(set(index["weight_map"].values())))
    assert a.nbytes == index["metadata"]["total_size"]
    assert a.display == os.path.join(str(out), "pp1")


def test_iter_weights_yields_exactly_the_stage_tensors_with_the_source_bytes(out, source):
    src_index = json.loads((source / INDEX).read_text())["weight_map"]
    for rank in range(3):
        stage = loader.open_stage(out, pp_rank=rank)
        # file order, then offset order inside each file, as the headers lay them out
        expected = [t.name for f in stage.files for t in read_header(stage.path / f).tensors]
        got = []
        for name, tensor in stage.iter_weights(verify=True):
            got.append(name)
            assert tuple(tensor.shape) == stage.tensors[name].shape
            assert tensor.device.type == "cpu"
            with safe_open(source / src_index[name], "pt") as f:
                want = f.get_tensor(name)
            assert tensor.dtype == want.dtype
            assert raw_bytes(tensor) == raw_bytes(want), name
            recorded = stage.tensors[name]
            assert hexdigest(XXH128, raw_bytes(tensor)) == recorded.digest == recorded.xxh128
        assert got == expected == stage.names
    dtypes = {t.dtype for t in loader.open_stage(out, pp_rank=2).tensors.values()}
    assert {"F32", "BF16", "F8_E4M3"} <= dtypes


def test_every_safetensors_dtype_loads_bit_exactly(make_checkpoint, tmp_path):
    """A hand-made source with every dtype, a scalar and an empty tensor, split and read back."""
    # Both layers full attention: vLLM needs one in each of the 2 stages.
    src = make_checkpoint(
        fresh=True, layers=2, mtp=False, vision=False, shard_bytes=10**9, full_attention_interval=1
    )
    gen = torch.Generator().manual_seed(0)
    specs = {
        "F64": [3, 2], "F32": [], "F16": [5], "BF16": [0, 4], "I64": [2, 2], "I32": [3], "I16": [4],
        "I8": [7], "U8": [9], "U16": [2], "U32": [2], "U64": [2], "BOOL": [6], "C64": [3],
        "F8_E4M3": [4, 4], "F8_E5M2": [8], "F8_E8M0": [5],
    }
    entries, blobs = [], []
    for dtype, shape in specs.items():
        size = DTYPE_SIZES[dtype]
        n = size * int(torch.tensor(shape).prod().item() if shape else 1)
        data = torch.randint(0, 2 if dtype == "BOOL" else 256, (n,), generator=gen, dtype=torch.uint8)
        if dtype.startswith("F") or dtype == "C64":  # keep float payloads finite: clear the top exponent bit
            data = data & 0x3F
        layer = 0 if len(entries) % 2 else 1
        entries.append((f"model.language_model.layers.{layer}.extra.{dtype.lower()}", dtype, tuple(shape), n))
        blobs.append(bytes(data.tolist()))
    (src / "model-extra.safetensors").write_bytes(encode_header(entries) + b"".join(blobs))
    index = json.loads((src / INDEX).read_text())
    for name, _, _, n in entries:
        index["weight_map"][name] = "model-extra.safetensors"
        index["metadata"]["total_size"] += n
    (src / INDEX).write_text(json.dumps(index))

    qwen35_reshard.reshard(src, tmp_path / "out", pp=2, runtime="vllm")
    want = {name: blob for (name, *_), blob in zip(entries, blobs, strict=True)}
    seen = {}
    for rank in range(2):
        for name, tensor in loader.open_stage(tmp_path / "out", pp_rank=rank).iter_weights(verify=True):
            if name in want:
                seen[name] = tensor
    assert set(seen) == set(want)
    for (name, dtype, shape, _), blob in zip(entries, blobs, strict=True):
        t = seen[name]
        assert tuple(t.shape) == shape and t.dtype == getattr(torch, DTYPES[dtype][1]), name
        assert raw_bytes(t) == blob, name
        with safe_open(src / "model-extra.safetensors", "pt") as f:
            assert raw_bytes(f.get_tensor(name)) == blob


def test_reads_lazily_one_tensor_at_a_time_and_only_this_stage_files(out, monkeypatch):
    stage = loader.open_stage(out, pp_rank=1)
    # a stray weights file beside the stage: not in the index, so never read
    (out / "pp1" / "model-00009-of-00009.safetensors").write_bytes(b"garbage")
    stage = loader.open_stage(out, pp_rank=1)
    opened, read = [], []  # the files the loader maps, the tensors it views in them (by offset)
    real_map, real_view = loader._mapped, loader._tensor_at

    def mapping(torch, fd, *args):
        opened.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        return real_map(torch, fd, *args)

    def viewing(torch, storage, offset, *args):
        read.append(offset)
        return real_view(torch, storage, offset, *args)

    monkeypatch.setattr(loader, "_mapped", mapping)
    monkeypatch.setattr(loader, "_tensor_at", viewing)
    it = stage.iter_weights()
    assert read == [] and opened == []  # nothing happens until iterated
    name, tensor = next(it)
    assert read == [stage.tensors[name].offset] and len(opened) == 1
    names = [name] + [n for n, _ in it]
    assert names == stage.names
    assert read == [stage.tensors[n].offset for n in names]
    assert sorted(opened) == sorted(stage.path / f for f in stage.files)


def test_device_argument(out):
    stage = loader.open_stage(out, pp_rank=0)
    name, tensor = next(stage.iter_weights(device="meta"))
    assert tensor.device.type == "meta" and tuple(tensor.shape) == stage.tensors[name].shape


def test_package_imports_and_validates_without_torch(out):
    code = (
        "import qwen35_reshard, qwen35_reshard.loader as loader\n"
        f"s = loader.open_stage({str(out)!r}, pp_rank=2)\n"
        "s.check(pp_size=3, start_layer=5, end_layer=8)\n"
        "try:\n"
        "    next(s.iter_weights())\n"
        "except loader.StageError as e:\n"
        "    print(e)\n"
    )
    printed = run_without(["torch"], code)
    assert "needs torch" in printed and "pip install torch" in printed


def test_vllm_plugin_imports_without_vllm():
    """The load format's module is importable without vllm; only registering needs it."""
    code = (
        "from qwen35_reshard.servers import vllm as vllm_plugin\n"
        "print(vllm_plugin.LOAD_FORMAT)\n"
        "try:\n"
        "    vllm_plugin.register()\n"
        "except ImportError:\n"
        "    print('vllm needed only to register')\n"
    )
    printed = run_without(["vllm", "torch"], code)
    assert printed.split("\n")[:2] == ["qwen35-stages", "vllm needed only to register"]


# --------------------------------------------------------------------------- check()


def test_check_accepts_the_servers_matching_view(out):
    stage = loader.open_stage(out, pp_rank=1)
    stage.check(pp_size=3, start_layer=2, end_layer=5)
    stage.check(3, 2, 5, pp_rank=1, runtime="sglang")


def test_check_mismatch_shows_both_views_and_the_launch_variable(out):
    stage = loader.open_stage(out, pp_rank=1)
    with pytest.raises(loader.StageError) as e:
        stage.check(pp_size=3, start_layer=3, end_layer=6)  # e.g. a server's own default split
    msg = one_line(e)
    assert "pp=3 layers [2, 5)" in msg and "pp=3 layers [3, 6)" in msg
    assert "SGLANG_PP_LAYER_PARTITION=2,3,3" in msg
    with pytest.raises(loader.StageError) as e:
        stage.check(pp_size=4, start_layer=2, end_layer=4)
    msg = one_line(e)
    assert "pp=4" in msg and "--pp-size 3" in msg and "--pp 4" in msg
    with pytest.raises(loader.StageError) as e:
        stage.check(3, 2, 5, pp_rank=2)
    assert "pp2" in one_line(e)
    with pytest.raises(loader.StageError) as e:
        stage.check(3, 2, 5, runtime="vllm")
    assert "--runtime vllm" in one_line(e)


def test_check_names_vllms_variable_for_a_vllm_split(ref, make_checkpoint, tmp_path):
    source = make_checkpoint(layout="per_expert_fp8", **ref.servable_attention("vllm", 3))
    qwen35_reshard.reshard(source, tmp_path / "v", pp=3, runtime="vllm")
    stage = loader.open_stage(tmp_path / "v", pp_rank=0)
    assert stage.partition == (3, 3, 2)
    stage.check(3, 0, 3)
    with pytest.raises(loader.StageError) as e:
        stage.check(3, 0, 2)
    assert "VLLM_PP_LAYER_PARTITION=3,3,2" in one_line(e)


# --------------------------------------------------------------------------- refusals


def _rewrite_header(path: Path, mutate) -> None:
    """Rewrite a data file's header in place, same length, so the file size does not change."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    mutate(header)
    new = json.dumps(header, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(data[:8] + new + b" " * (n - len(new)) + data[8 + n :])


def _first(header: dict, dtype: str) -> str:
    return next(
        k for k, v in header.items()
        if k != "__metadata__" and v["dtype"] == dtype and len(set(v["shape"])) == len(v["shape"]) == 2
    )


def _dtype_to_f16(h):
    h[_first(h, "BF16")]["dtype"] = "F16"


def _swap_shape(h):
    h[_first(h, "BF16")]["shape"].reverse()


def _rename(h):
    name = _first(h, "BF16")
    h[name[:-1] + ("x" if name[-1] != "x" else "y")] = h.pop(name)


def _data_file(stage_dir: Path) -> Path:
    return sorted(stage_dir.glob("model-*.safetensors"))[0]


RERUN = "run the same qwen35-reshard command again"


def _reformat_index(d: Path) -> None:
    (d / INDEX).write_text(json.dumps(json.loads((d / INDEX).read_text())))


DAMAGE = {
    "no manifest": (lambda d: (d / MANIFEST).unlink(), ["incomplete (no reshard-stage.json)", RERUN]),
    "no index": (lambda d: (d / INDEX).unlink(), ["incomplete (no model.safetensors.index.json)", RERUN]),
    "index not the manifest's": (_reformat_index, ["incomplete", "not the one reshard-stage.json records"]),
    "manifest not JSON": (lambda d: (d / MANIFEST).write_text("{"), ["damaged", "run the same"]),
    **{
        f"index {what}": (
            lambda d, text=text: (d / INDEX).write_text(text),
            [f"{INDEX} is damaged", "run the same"],
        )
        for what, text in {
            "not JSON": "{",
            "a list": "[]",
            "without weight_map": '{"metadata": {"total_size": 0}}',
            "with a list for weight_map": '{"metadata": {"total_size": 0}, "weight_map": []}',
            "with a list for metadata": '{"metadata": [], "weight_map": {}}',
            "without total_size": '{"metadata": {}, "weight_map": {}}',
        }.items()
    },
    "other format": (lambda d: (d / MANIFEST).write_text(
        json.dumps({**json.loads((d / MANIFEST).read_text()), "format": "qwen35-reshard/stage-v9"})),
        ["stage-v9", "another version"]),
    "data file missing": (lambda d: _data_file(d).unlink(), ["is missing", "run the same"]),
    "data file truncated": (lambda d: os.truncate(_data_file(d), _data_file(d).stat().st_size - 1),
                            ["bytes but reshard-stage.json records", "truncated"]),
    "dtype differs": (lambda d: _rewrite_header(_data_file(d), _dtype_to_f16), ["is F16", "records BF16"]),
    "shape differs": (lambda d: _rewrite_header(_data_file(d), _swap_shape), ["records BF16"]),
    "name differs": (lambda d: _rewrite_header(_data_file(d), _rename), ["reshard-stage.json does not list"]),
    "config edited": (lambda d: (d / "config.json").write_bytes((d / "config.json").read_bytes() + b" "),
                      ["config.json differs"]),
    "config missing": (lambda d: (d / "config.json").unlink(), ["has no config.json"]),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_refuses_a_damaged_or_incomplete_stage(out, damage):
    fn, fragments = DAMAGE[damage]
    loader.open_stage(out, pp_rank=1)  # fine before
    fn(out / "pp1")
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(out, pp_rank=1)
    msg = one_line(e)
    assert "pp1" in msg
    for fragment in fragments:
        assert fragment in msg, msg
    loader.open_stage(out, pp_rank=0)  # the other stages are untouched


def test_refuses_an_interrupted_run_then_accepts_the_resumed_one(source, tmp_path, monkeypatch):
    real = os.replace

    def crash(src, dst):
        # A stage gets its index last, once its data and manifest are durable: stop at pp1's.
        if Path(dst).name == INDEX and Path(dst).parent.name == "pp1":
            raise RuntimeError("simulated crash before pp1's index was in place")
        real(src, dst)

    monkeypatch.setattr(write.os, "replace", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        qwen35_reshard.reshard(source, tmp_path / "out", pp=3)
    monkeypatch.setattr(write.os, "replace", real)
    assert (tmp_path / "out" / "pp1" / MANIFEST).exists()
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(tmp_path / "out", pp_rank=1)
    assert f"incomplete (no {INDEX})" in one_line(e)
    for rank in (0, 2):  # stages finish as their files are copied: each is finished or refused
        if (tmp_path / "out" / f"pp{rank}" / INDEX).exists():
            loader.open_stage(tmp_path / "out", pp_rank=rank)
        else:
            with pytest.raises(loader.StageError):
                loader.open_stage(tmp_path / "out", pp_rank=rank)
    qwen35_reshard.reshard(source, tmp_path / "out", pp=3)  # the same command again
    for rank in range(3):
        loader.open_stage(tmp_path / "out", pp_rank=rank)


def test_refuses_a_stage_of_another_split(source, out, tmp_path):
    qwen35_reshard.reshard(source, tmp_path / "other", pp=2)
    shutil.rmtree(out / "pp1")
    shutil.copytree(tmp_path / "other" / "pp1", out / "pp1")  # stage 1 of pp=2 beside a pp=3 run
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(out, pp_rank=1)
    msg = one_line(e)
    # the settings that differ, the run's value first, then the stage's
    assert "another split" in msg and "pp 3 -> 2" in msg and "partition [2, 3, 3] -> [4, 4]" in msg
    loader.open_stage(tmp_path / "other" / "pp1")  # fine where it belongs


def test_refuses_a_stage_directory_under_the_wrong_rank(out):
    os.rename(out / "pp1", out / "tmp")
    os.rename(out / "pp2", out / "pp1")
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(out, pp_rank=1)
    assert "holds stage 2" in one_line(e)
    loader.open_stage(out / "tmp", pp_rank=1)  # a renamed copy still knows its rank


def test_refuses_what_is_not_a_stage(out, source, tmp_path):
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(out)
    assert "run directory" in one_line(e) and "pp_rank" in str(e.value)
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(out, pp_rank=7)
    assert "outside the split" in one_line(e) and "3 stages (pp0..pp2)" in one_line(e)
    shutil.rmtree(out / "pp2")
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(out, pp_rank=2)
    assert "has no pp2/" in one_line(e) and "--rank 2" in one_line(e)
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(source)
    assert "not a finished qwen35-reshard stage" in one_line(e)
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(tmp_path / "nowhere")
    assert "not a directory" in one_line(e)
    with pytest.raises(loader.StageError):
        loader.open_stage(out, pp_rank=-1)


def _flip_a_byte(out: Path, rank: int) -> tuple[Path, str]:
    """Flip one byte in the middle tensor of ``out``'s stage ``rank``'s first data file: the
    file and the tensor."""
    path = _data_file(out / f"pp{rank}")
    header = read_header(path)
    victim = header.tensors[len(header.tensors) // 2]
    with open(path, "r+b") as f:
        f.seek(header.data_start + victim.begin)
        b = f.read(1)
        f.seek(header.data_start + victim.begin)
        f.write(bytes([b[0] ^ 0xFF]))
    return path, victim.name


def test_a_flipped_data_byte_stops_the_load_naming_tensor_and_file(out, monkeypatch, caplog):
    path, victim = _flip_a_byte(out, 2)
    stage = loader.open_stage(out, pp_rank=2)  # sizes and headers still match
    with pytest.raises(DamagedStage) as e:
        for _ in stage.iter_weights():  # checked by default: the load never finishes
            pass
    msg = one_line(e)
    assert repr(victim) in msg and f"{out / 'pp2'}/{path.name}" in msg and "xxh128" in msg, msg
    assert "--repair" in msg, msg  # a split's stage: mended from its source
    assert (e.value.path, e.value.tensor) == (str(path), victim)

    # Asked not to check (verify=False, or the opt-out for those who check elsewhere): it loads,
    # and the opt-out says so in the log.
    assert sum(1 for _ in stage.iter_weights(verify=False)) == len(stage)
    assert not caplog.records
    monkeypatch.setenv(loader.VERIFY_LOAD_ENV, "0")
    with caplog.at_level(logging.WARNING, logger="qwen35_reshard.loader"):
        assert sum(1 for _ in stage.iter_weights()) == len(stage)
    said = [r.getMessage() for r in caplog.records]
    opt_out = "loaded without checking its bytes' digests (QWEN35_RESHARD_VERIFY_LOAD=0)"
    assert said == [f"qwen35-reshard: {out / 'pp2'}: {opt_out}"]
    monkeypatch.setenv(loader.VERIFY_LOAD_ENV, "1")
    with pytest.raises(DamagedStage):
        list(stage.iter_weights())


def test_a_damaged_last_tensor_stops_a_load_that_takes_exactly_the_stage_count(out, monkeypatch):
    """A caller that takes exactly ``len(names)`` tensors (zip, islice) never asks for one more:
    the final tensor is handed out only once every hash is checked. Hashes complete late here
    (each job waits 0.3 s in a thread, as a large tensor's does), so none is known when the
    reader reaches the final tensor."""
    check = digestpool._Job.check
    monkeypatch.setattr(digestpool, "SMALL", 0)  # every range hashed in a thread
    monkeypatch.setattr(digestpool._Job, "check", lambda job: time.sleep(0.3) or check(job))
    stage = loader.open_stage(out, pp_rank=1)
    last = stage.path / stage.files[-1]
    header = read_header(last)
    victim = max(header.tensors, key=lambda t: t.begin)  # the final tensor in load order
    assert victim.name == stage.names[-1]
    with open(last, "r+b") as f:
        f.seek(header.data_start + victim.end - 1)
        b = f.read(1)
        f.seek(header.data_start + victim.end - 1)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(DamagedStage) as e:
        for _ in zip(stage.names, stage.iter_weights(), strict=False):  # never asks for one more
            pass
    assert (e.value.path, e.value.tensor) == (str(last), victim.name)
    with pytest.raises(DamagedStage):
        list(itertools.islice(stage.iter_weights(), len(stage)))


def test_a_server_writing_into_the_views_it_was_handed_changes_no_verdict_and_no_file(out):
    """Each range is hashed through the loader's own copy-on-write map before it is handed on:
    a server that writes into a view it was handed (its copy-on-write page, never the file)
    makes no tensor look damaged, and the files keep their bytes."""
    import torch

    stage = loader.open_stage(out, pp_rank=1)
    files = {f: (stage.path / f).read_bytes() for f in stage.files}
    for _, tensor in stage.iter_weights():
        at = tensor.storage_offset() * tensor.element_size()
        mine = torch.empty(0, dtype=torch.uint8).set_(tensor.untyped_storage(), at, (tensor.nbytes,))
        mine.fill_(0xA5)  # this tensor's bytes only
    assert {f: (stage.path / f).read_bytes() for f in stage.files} == files


def test_an_intact_stage_loads_checked_with_nothing_logged(out, caplog):
    with caplog.at_level(logging.INFO, logger="qwen35_reshard.loader"):
        for rank in range(3):
            stage = loader.open_stage(out, pp_rank=rank)
            assert [n for n, _ in stage.iter_weights()] == stage.names
    assert not caplog.records


# --------------------------------------------------------------------------- a stage at the real scale


@pytest.fixture(scope="module")
def many(make_checkpoint, tmp_path_factory):
    """A stage of tens of thousands of tensors, as at the real scale (a 397B FP8 stage has
    ~47,000): per-expert FP8 with a scale each, 512 experts, small dimensions, pp=2."""
    source = make_checkpoint(
        layout="per_expert_fp8", layers=16, experts=512, hidden=64, moe_intermediate=32, vocab=256,
        vision=False, mtp=False, shard_bytes=5_000_000,
    )
    out = tmp_path_factory.mktemp("many") / "out"
    qwen35_reshard.reshard(source, out, pp=2, runtime="vllm")
    return source, out


@pytest.mark.slow  # tens of thousands of tensors
def test_a_stage_of_tens_of_thousands_of_tensors_opens_loads_and_verifies(many):
    source, out = many
    stage = loader.open_stage(out, pp_rank=0)
    index = json.loads((out / "pp0" / INDEX).read_text())["weight_map"]
    assert len(stage) == len(index) >= 20_000
    assert set(stage.names) == set(index)
    src_index = json.loads((source / INDEX).read_text())["weight_map"]
    handles = {f: safe_open(source / f, "pt") for f in set(src_index.values())}
    seen = []
    for name, tensor in stage.iter_weights(verify=True):
        t = stage.tensors[name]
        assert tensor.dtype == getattr(torch, DTYPES[t.dtype][1]) and tuple(tensor.shape) == t.shape, name
        want = handles[src_index[name]].get_tensor(name)
        assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), name
        seen.append(name)
    assert seen == stage.names and len(set(seen)) == len(index)
    from qwen35_reshard.verify import verify

    report = verify(out, source)  # every stage, and against the source
    assert report.ok, report.findings[:3]


def _uppercase_a_digest(d: Path) -> None:
    text = (d / MANIFEST).read_text()
    digest = json.loads(text)["tensors"]
    name = next(n for n, t in digest.items() if t["xxh128"])
    (d / MANIFEST).write_text(text.replace(digest[name]["xxh128"], digest[name]["xxh128"].upper(), 1))


def _drop_from_index(d: Path) -> None:
    index = json.loads((d / INDEX).read_text())
    index["weight_map"].pop(sorted(index["weight_map"])[len(index["weight_map"]) // 2])
    (d / INDEX).write_text(json.dumps(index))


def _manifest_without_a_tensor(d: Path) -> None:
    manifest = json.loads((d / MANIFEST).read_text())
    name = sorted(manifest["tensors"])[-1]
    file = manifest["tensors"].pop(name)["file"]
    manifest["files"][file]["tensors"] -= 1
    (d / MANIFEST).write_text(json.dumps(manifest))


# The checks the opener makes one tensor at a time on a small stage (DAMAGE above), on a stage
# large enough for its fast paths: each still refuses, naming what is wrong.
MANY_DAMAGE = {
    "a digest in capitals": (_uppercase_a_digest, ["damaged (xxh128 of tensor"]),
    "index lacks a tensor": (_drop_from_index, ["lacks tensor", "model.safetensors.index.json"]),
    "manifest lacks a tensor": (_manifest_without_a_tensor, ["lists tensor", "reshard-stage.json does not"]),
    "dtype differs": (lambda d: _rewrite_header(_data_file(d), _dtype_to_f16), ["is F16", "records BF16"]),
    "name differs": (lambda d: _rewrite_header(_data_file(d), _rename), ["reshard-stage.json does not list"]),
}


@pytest.mark.slow  # tens of thousands of tensors
@pytest.mark.parametrize("damage", list(MANY_DAMAGE))
def test_a_damaged_stage_of_tens_of_thousands_of_tensors_is_refused(many, tmp_path, damage):
    _, out = many
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    fn, fragments = MANY_DAMAGE[damage]
    fn(copy / "pp0")
    with pytest.raises(loader.StageError) as e:
        loader.open_stage(copy, pp_rank=0)
    msg = one_line(e)
    for fragment in ["pp0", *fragments]:
        assert fragment in msg, msg


def test_a_file_changed_after_opening_is_refused_while_loading(out):
    stage = loader.open_stage(out, pp_rank=1)
    path = _data_file(out / "pp1")
    _rewrite_header(path, _swap_shape)  # same size: only the header differs
    with pytest.raises(loader.StageError) as e:
        list(stage.iter_weights())
    msg = one_line(e)
    assert path.name in msg and "changed while loading" in msg and "another header" in msg
