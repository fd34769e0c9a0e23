"""Shared fixtures: synthetic checkpoints with the real naming, and reference helpers.

Checkpoints come from ``examples/tiny_checkpoint.py``. ``make_checkpoint(**kwargs)`` builds
one per distinct set of arguments per session (they are read-only inputs); pass
``fresh=True`` for a private copy that a test may modify.

The ``ref`` helpers re-derive what the output must be straight from the facts doc and the
safetensors format, without importing ``qwen35_reshard``, so a test compares the tool with
an independent expectation rather than with itself.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

# Fixtures shared by modules of several folders (the 397B-shaped checkpoint).
pytest_plugins = ["support.checkpoints"]

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Weight files, never carried into a stage as side files (pickles are never even opened).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


@pytest.fixture(autouse=True)
def _own_node_record(tmp_path_factory, monkeypatch):
    """Each test its own node record of checked files (loader: ``stage.nodechecks``), its
    subprocesses too: a check one test's load made is not another test's to trust."""
    monkeypatch.setenv("QWEN35_RESHARD_CHECKED_DIR", str(tmp_path_factory.mktemp("node") / "checked"))


# --------------------------------------------------------------------------- checkpoints


@pytest.fixture
def other_fs_dir(tmp_path):
    """A directory on another filesystem than ``tmp_path`` (tmpfs /dev/shm), between which
    and ``tmp_path`` the kernel refuses copy_file_range, as it does across filesystems."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm: no second filesystem to copy across")
    path = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="qwen35-reshard-test-"))
    try:
        (path / "probe").write_bytes(b"x")
        src = os.open(path / "probe", os.O_RDONLY)
        dst = os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.copy_file_range(src, dst, 1, 0, 0)
            refused = None
        except OSError as e:
            refused = e.errno
        finally:
            os.close(src)
            os.close(dst)
            os.remove(tmp_path / "probe")
        if refused not in (errno.EXDEV, errno.EOPNOTSUPP, errno.ENOSYS):
            pytest.skip(f"this kernel copies between {path} and {tmp_path}: the fallback is unreachable so")
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny():
    """The ``examples/tiny_checkpoint.py`` module, with examples/ put on sys.path."""
    if str(EXAMPLES_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLES_DIR))
    import tiny_checkpoint

    return tiny_checkpoint


@pytest.fixture(scope="session")
def make_checkpoint(tiny, tmp_path_factory):
    """Factory: ``make_checkpoint(**build_checkpoint_kwargs, fresh=False) -> model dir``.

    Identical arguments share one build per session; ``fresh=True`` always builds anew.
    """
    cache: dict[str, Path] = {}

    def make(*, fresh: bool = False, **kwargs) -> Path:
        key = repr(sorted(kwargs.items()))
        if fresh or key not in cache:
            path = Path(tiny.build_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", **kwargs))
            if fresh:
                return path
            cache[key] = path
        return cache[key]

    return make


# --------------------------------------------------------------------------- reference helpers


@dataclass(frozen=True)
class RefTensor:
    """A tensor as read by the reference helpers: its file, dtype, shape and raw bytes."""

    file: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class RefSource:
    """A source checkpoint as read independently of the tool."""

    root: Path
    config: dict
    num_layers: int
    tied: bool
    tensors: dict[str, RefTensor]
    side_files: dict[str, bytes]  # top-level non-weight, non-hidden files except the index


class Ref:
    """Expectations computed from the facts doc and the format spec only."""

    ENV = {"sglang": "SGLANG_PP_LAYER_PARTITION", "vllm": "VLLM_PP_LAYER_PARTITION"}
    LAYER_RE = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.")

    @staticmethod
    def split(num_layers: int, pp: int, runtime: str) -> list[int]:
        """Facts doc §3: SGLang gives the remainder to the LAST ranks; vLLM to the
        2nd-to-last, 3rd-to-last, ... ranks (partitions[-i] += 1 for i in 2..rem+1)."""
        base, rem = divmod(num_layers, pp)
        sizes = [base] * pp
        for i in range(rem):
            if runtime == "sglang":
                sizes[pp - 1 - i] += 1
            else:
                sizes[-(i + 2)] += 1
        return sizes

    @staticmethod
    def launch_env(runtime: str, partition: list[int]) -> str:
        return f"{Ref.ENV[runtime]}={','.join(map(str, partition))}"

    @staticmethod
    def servable_attention(runtime: str, pp: int) -> dict:
        """``build_checkpoint`` kwargs with which ``runtime`` can serve the default 8-layer
        checkpoint's default split over ``pp`` stages. vLLM needs a full-attention layer in every
        stage (vllm-cpu-notes.md); the checkpoint has them at layers 3 and 7 only, so its vLLM
        splits of more than 2 stages are made of a twin whose every layer is full attention."""
        return {"full_attention_interval": 1} if runtime == "vllm" and pp > 2 else {}

    @staticmethod
    def owners(name: str, *, partition: list[int], runtime: str, tied: bool, mtp_kept: bool) -> set[int]:
        """Stages that must hold ``name`` (facts doc §3 placement table)."""
        pp = len(partition)
        first, last, every = {0}, {pp - 1}, set(range(pp))
        m = Ref.LAYER_RE.match(name)
        if m:
            layer, start = int(m.group(1)), 0
            for rank, size in enumerate(partition):
                if start <= layer < start + size:
                    return {rank}
                start += size
            raise AssertionError(f"layer of {name} outside the partition")
        if name.startswith(("model.language_model.embed_tokens.", "model.embed_tokens.")):
            if runtime == "vllm":
                return every
            return first | last if (tied or mtp_kept) else first
        if name.startswith(("model.language_model.norm.", "model.norm.", "lm_head.", "mtp.")):
            return last
        if name.startswith("model.visual."):
            # SGLang builds the vision tower on every rank, its pos_embed on the first only.
            return first if runtime == "sglang" and name.startswith("model.visual.pos_embed.") else every
        raise AssertionError(f"no placement rule in the facts doc for {name}")

    @staticmethod
    def read_safetensors(path: Path) -> tuple[dict, dict[str, RefTensor]]:
        """Parse a safetensors file with struct/json and plain reads: (metadata, tensors)."""
        raw = Path(path).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + n])
        metadata = header.pop("__metadata__", {})
        data = raw[8 + n :]
        tensors = {}
        for name, info in header.items():
            begin, end = info["data_offsets"]
            tensors[name] = RefTensor(Path(path).name, info["dtype"], tuple(info["shape"]), data[begin:end])
        return metadata, tensors

    @staticmethod
    def read_source(model_dir: Path) -> RefSource:
        """Read a source checkpoint (index or single file; symlinks followed)."""
        root = Path(model_dir)
        config = json.loads((root / "config.json").read_bytes())
        text = config.get("text_config", config)
        if (root / INDEX_NAME).exists():
            weight_map = json.loads((root / INDEX_NAME).read_bytes())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            weight_map, files = None, [SINGLE_FILE]
        tensors: dict[str, RefTensor] = {}
        for file in files:
            _, found = Ref.read_safetensors(root / file)
            tensors.update(found)
        if weight_map is not None:
            assert set(weight_map) == set(tensors)
        side = {
            p.name: p.read_bytes()
            for p in sorted(root.iterdir())
            if p.is_file()
            and p.name != INDEX_NAME
            and not p.name.startswith(".")
            and not p.name.endswith(WEIGHT_SUFFIXES)
        }
        tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
        return RefSource(root, config, text["num_hidden_layers"], tied, tensors, side)


@pytest.fixture(scope="session")
def ref():
    """The independent reference helpers (see :class:`Ref`)."""
    return Ref
