"""The servers' messages in a server operator's terms (qwen35_reshard/servers/terms.py, issues 37
and 44): a stage read in place is the user's own checkpoint, never to be deleted; the library's
parameters and advice become the stage cache, its variable and the server's next start; every
error class of the package, with every parameter and every kind of advice the package names,
reads so. (A full disk and a refused token: tests/e2e/test_serve.py.)"""

from __future__ import annotations

import ast
import errno
import json
import re
import shutil
import struct
import types
from pathlib import Path

import pytest

from qwen35_reshard import errors, reshard
from qwen35_reshard.cli.cache import CACHE_FLAGS
from qwen35_reshard.cli.flags import FLAGS, VERIFY_FLAGS
from qwen35_reshard.errors import AGAIN, ELSEWHERE, OutError, ReshardError, StageError, advice, param
from qwen35_reshard.model.parallelism import Parallelism
from qwen35_reshard.servers.deployment import rank_stage
from qwen35_reshard.servers.terms import (
    CACHE,
    SPLIT,
    STAGE_CACHE_ENV,
    cache_error,
    for_operator,
    operator_terms,
)
from qwen35_reshard.servers.unsplit import server_stage
from qwen35_reshard.stage.findings import REPAIR

from support.helpers import ROOT


def test_a_shard_read_in_place_that_changes_while_loading_is_not_to_be_deleted(make_checkpoint, tmp_path):
    model = shutil.copytree(make_checkpoint(), tmp_path / "model")
    layout = Parallelism(pp=2, runtime="vllm", partition=(4, 4))
    served = server_stage(model, layout, rank=1, cache=tmp_path / "stages")
    assert served.how == "in place"
    shard = Path(model) / served.stage.files[0]
    with open(shard, "ab") as f:  # the checkpoint rewritten while the server starts
        f.write(b"\0" * 8)
    with pytest.raises(StageError) as e:
        for _ in served.stage.iter_weights():
            pass
    message = str(e.value)
    assert "changed while loading" in message and "checkpoint's own file" in message, message
    assert "delete" not in message and "same" not in message, message


def test_library_errors_read_in_the_servers_terms():
    error = OutError(f"{param('out_dir')} /c: no space left; free space and {AGAIN} to resume or {ELSEWHERE}")
    assert str(error) == (
        "out_dir /c: no space left; free space and run the same command again to resume or "
        "choose another directory"
    )
    assert for_operator(error) == (
        f"the stage cache ({STAGE_CACHE_ENV}) /c: no space left; free space and start the server again to "
        f"resume or point {STAGE_CACHE_ENV} at another disk"
    )


def error_classes() -> list[type[ReshardError]]:
    """ReshardError and every class under it that errors.py defines, found, not listed."""
    found, todo = [], [ReshardError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return sorted({c for c in found if c.__module__ == errors.__name__}, key=lambda c: c.__name__)


def package_sources() -> dict[Path, str]:
    return {p: p.read_text() for p in (ROOT / "qwen35_reshard").rglob("*.py")}


def parameters() -> set[str]:
    """Every parameter an error may name: each the CLI spells as a flag, and each the package
    names with param() (found in its source)."""
    named = {m for text in package_sources().values() for m in re.findall(r"param\(['\"](\w+)['\"]", text)}
    return named | set(FLAGS) | set(VERIFY_FLAGS) | set(CACHE_FLAGS)


def advice_kinds() -> set[str]:
    """Every kind of advice the package gives (found in its source)."""
    return {m for text in package_sources().values() for m in re.findall(r"advice\(['\"](\w+)['\"]", text)}


def instance(cls: type[ReshardError], message: str) -> ReshardError:
    """An error of ``cls`` saying ``message`` (DamagedStage also names its file and tensor)."""
    if cls is errors.DamagedStage:
        return cls(message, "/c/pp1/model.safetensors", "model.norm.weight")
    return cls(message)


CLI_FLAGS = sorted({f for t in (FLAGS, VERIFY_FLAGS, CACHE_FLAGS) for f in t.values() if f.startswith("-")})
LEAKS = re.compile(r"run the same .*command|out_dir|model_dir|(?<![\w-])--[a-z]")


@pytest.mark.parametrize("audience", ["cache", "split"])
@pytest.mark.parametrize("cls", error_classes(), ids=lambda c: c.__name__)
def test_every_error_class_reads_in_the_operators_terms(cls, audience):
    """Every parameter named and every advice given, with and without a value, in one message of
    each class: the operator's line names no flag of the command line, no library parameter,
    and never asks to run the same command again. A new class, parameter or kind of advice is
    covered as soon as it exists; each kind must be worded for the operator."""
    kinds = advice_kinds()
    assert {"rerun", "rebuild", "repair", "elsewhere", "replace"} <= kinds  # the scan finds them
    assert kinds <= set(CACHE.advice) and kinds <= set(SPLIT.advice), "advice not worded for operators"
    named = sorted(parameters())
    assert {"pp", "ranks", "out_dir", "model_dir", "overwrite"} <= set(named)
    parts = [f"{param(n)} and {param(n, 4)} and {param(n, True)}" for n in named]
    parts += [advice(k, f"run the same qwen35-reshard command again ({k})") for k in sorted(kinds)]
    error = instance(cls, "; ".join(parts))
    line = for_operator(error, split=audience == "split")
    assert LEAKS.search(line) is None, (LEAKS.search(line), line)
    assert not [f for f in CLI_FLAGS if f in line]
    assert not [n for n in named if "_" in n and n in line]  # a library parameter's own name
    assert "\n" not in line and "\x1f" not in line and "\x1d" not in line
    # The library's caller still reads the library's terms.
    assert "run the same qwen35-reshard command again (rebuild)" in str(error) and "out_dir" in str(error)


def test_advice_is_never_written_out_of_the_mechanism():
    """Outside the command line (which only its user reads), "run the same ... command" is said
    only as advice (inside an advice() call): each server audience words it its own way."""
    found = []
    for path, text in package_sources().items():
        if "cli" in path.relative_to(ROOT / "qwen35_reshard").parts:
            continue
        tree = ast.parse(text)
        docstrings = {
            id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node)
        }  # fmt: skip
        advised = {
            id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "advice"
            for inner in ast.walk(node)
        }  # fmt: skip
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant) and "run the same" in str(node.value)
                and id(node) not in docstrings | advised
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value.strip()}")
    assert found == []


def test_an_escaping_error_keeps_its_class_and_says_the_operators_line():
    with pytest.raises(errors.DamagedStage) as e:
        with operator_terms(split=True):
            raise errors.DamagedStage(f"/s/pp1/x.safetensors: damaged: {REPAIR}", "/s/pp1/x.safetensors", "t")
    assert e.value.tensor == "t" and "--source" not in str(e.value) and "--repair" not in str(e.value)
    assert str(e.value) == f"/s/pp1/x.safetensors: damaged: {SPLIT.advice['repair']}"


def test_an_os_error_names_its_file_or_the_fuller_cache(tmp_path):
    named = cache_error(OSError(errno.EACCES, "Permission denied", str(tmp_path / "x")), tmp_path)
    assert named.startswith(f"cannot write {tmp_path / 'x'}: Permission denied") and STAGE_CACHE_ENV in named
    # No file named (a write on a full disk): the cache with less free space; the stage cache
    # here is a path on no disk at all (0 bytes free), so it is the one named.
    nowhere = Path("/proc/no/such/cache")
    unnamed = cache_error(OSError(errno.ENOSPC, "No space left on device"), nowhere)
    assert unnamed.startswith(f"the stage cache {nowhere} (set by {STAGE_CACHE_ENV}): No space left"), unnamed


def retype_first_tensor(data_file: Path) -> None:
    """Rewrite ``data_file``'s header in place, same length: its first F32 tensor said to be I32."""
    raw = bytearray(data_file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n].decode()
    assert '"F32"' in header
    raw[8 : 8 + n] = header.replace('"F32"', '"I32"', 1).encode()
    data_file.write_bytes(bytes(raw))


VLLM_4_4 = Parallelism(pp=2, runtime="vllm", partition=(4, 4))


def test_a_cached_file_whose_header_changed_says_what_to_do_and_that_works(make_checkpoint, tmp_path):
    """Issue 44: a stage cache's file whose header no longer matches its manifest told the operator
    to "delete it and run the same qwen35-reshard command again". Now: delete it and start the
    server again, which is what mends it (the same start again still refuses it)."""
    model, cache = make_checkpoint(), tmp_path / "stages"
    first = server_stage(model, VLLM_4_4, rank=1, cache=cache, copy=True)
    damaged = first.stage.path / first.stage.files[0]
    retype_first_tensor(damaged)
    for _ in range(2):  # starting again alone does not mend it: the line must say more
        with pytest.raises(StageError) as e:
            server_stage(model, VLLM_4_4, rank=1, cache=cache, copy=True)
        line = str(e.value)
        assert line.startswith(f"{damaged}: tensor ") and "records F32" in line, line
        assert line.endswith("; delete it and start the server again: the stage cache builds it anew"), line
    damaged.unlink()
    again = server_stage(model, VLLM_4_4, rank=1, cache=cache, copy=True)
    assert again.stage.rank == 1 and damaged.is_file()


def test_a_split_given_to_a_server_is_mended_with_the_tool_said_without_its_flags(make_checkpoint, tmp_path):
    """A split's stage whose index lists a tensor its manifest does not: the server's line tells
    its operator to write the split again, naming no flag (the loader's own line says "run the
    same qwen35-reshard command again")."""
    out = tmp_path / "out"
    reshard(make_checkpoint(), out, pp=2, runtime="vllm")
    index = out / "pp1" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.language_model.layers.4.bogus.weight"] = next(iter(doc["weight_map"].values()))
    index.write_text(json.dumps(doc))
    alone = types.SimpleNamespace(world_size=1, rank_in_group=0, cpu_group=None)
    even = lambda layers, rank, size: (rank * layers // size, (rank + 1) * layers // size)  # noqa: E731
    with pytest.raises(StageError) as e:
        rank_stage(str(out), runtime="vllm", group=alone, pp_rank=1, pp_size=2, layers=8, pp_indices=even,
                   revision=None, token=None, log=lambda line: None)  # fmt: skip
    line = str(e.value)
    assert "lists tensor 'model.language_model.layers.4.bogus.weight'" in line, line
    assert line.endswith(f"; {SPLIT.advice['rebuild']}") and LEAKS.search(line) is None, line
