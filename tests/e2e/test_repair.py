"""``verify OUT --source MODEL --repair`` (issue 10): exactly the damaged, missing or truncated
files are rebuilt from the source (and a stage's index and manifest when they are among them),
files that are fine are not rewritten, and the result is byte-identical to a clean split.
"""

from __future__ import annotations

import filecmp
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import ROOT

# Real runs of the command: a split, damage, a repair, a clean split to compare with.
pytestmark = pytest.mark.slow

PP = 3


def cli(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "qwen35_reshard", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def files(out: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under ``out``: (inode, modification time, size), which a rewrite changes."""
    return {
        str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
        for p in sorted(out.rglob("*"))
        if p.is_file()
    }


def same_bytes(a: Path, b: Path) -> None:
    assert sorted(files(a)) == sorted(files(b))
    for name in files(a):
        assert filecmp.cmp(a / name, b / name, shallow=False), name


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint(layout="per_expert_fp8", shard_bytes=100_000)


@pytest.fixture(scope="module")
def clean(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    r = cli("--pp", PP, model, out, "--max-file-size", "150000")
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def out(clean, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(clean, out)
    return out


def data_files(stage: Path) -> list[Path]:
    return sorted(stage.glob("model-*.safetensors"))


def test_flipped_byte_truncated_and_deleted_files_are_rebuilt_and_nothing_else(model, clean, out):
    flipped, truncated, deleted = (
        data_files(out / "pp1")[1],
        data_files(out / "pp2")[0],
        data_files(out / "pp0")[-1],
    )
    raw = bytearray(flipped.read_bytes())
    raw[-100] ^= 0x01
    flipped.write_bytes(raw)
    before = files(out)

    r = cli("verify", out)
    assert r.returncode == 1
    last = r.stdout.rstrip("\n").splitlines()[-1]
    assert f"qwen35-reshard verify {out} --source {model.resolve()} --repair" in last, last

    # A plain re-run judges completeness by sizes and manifests: fast, and says who checks bytes.
    r = cli("--pp", PP, model, out, "--max-file-size", "150000")
    assert r.returncode == 0 and "nothing to do" in r.stdout and f"verify {out} --source" in r.stdout, (
        r.stderr
    )
    assert files(out) == before

    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size - 1000)
    deleted.unlink()
    damaged = {str(p.relative_to(out)) for p in (flipped, truncated, deleted)}
    before = files(out)
    r = cli("verify", out, "--source", model, "--repair")
    assert r.returncode == 0, r.stderr
    repaired = {
        line.split(str(out) + "/", 1)[1] for line in r.stdout.splitlines() if line.startswith("repaired: ")
    }
    assert repaired == damaged
    assert "verify OK" in r.stdout.splitlines()[-1]
    after = files(out)
    for name, st in before.items():
        if name not in damaged:  # untouched: same inode, same modification time
            assert after[name] == st, name
    same_bytes(out, clean)


@pytest.mark.parametrize(
    "lost",
    ["pp1/reshard-stage.json", "pp1/model.safetensors.index.json", "pp2/config.json", "reshard.json", "pp0"],
)
def test_lost_metadata_or_stage_is_rebuilt(model, clean, out, lost):
    target = out / lost
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    before = files(out)
    r = cli("verify", out, "--source", model, "--repair")
    assert r.returncode == 0, r.stderr
    after = files(out)
    data_kept = [n for n in before if n.endswith(".safetensors")]
    for name in data_kept:
        assert after[name] == before[name], f"{name} was rewritten"
    same_bytes(out, clean)


def test_repair_needs_the_source(out):
    r = cli("verify", out, "--repair")
    assert r.returncode == 2 and "--source" in r.stderr.splitlines()[-1]
    # A Hub repo id is a source too (test_trust repairs from one): offline and not cached, one line naming it.
    r = cli("verify", out, "--source", "org/name", "--repair", "--offline")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "org/name" in r.stderr and r.stderr.startswith("error: "), r.stderr


def test_verify_names_its_own_flag_for_a_bad_source(out, tmp_path):
    """The library says model_dir; verify has no MODEL argument: its error says --source."""
    (tmp_path / "empty").mkdir()
    r = cli("verify", out, "--source", tmp_path / "empty")
    assert r.returncode == 2 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert "--source must be a Hugging Face model directory" in r.stderr and "MODEL" not in r.stderr


def test_one_stage_directory_is_repaired_on_its_own(model, clean, out):
    damaged = data_files(out / "pp2")[-1]
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0x80
    damaged.write_bytes(raw)
    r = cli("verify", out / "pp2", "--source", model, "--repair")
    assert r.returncode == 0, r.stderr
    assert [line for line in r.stdout.splitlines() if line.startswith("repaired: ")] == [
        f"repaired: {damaged}"
    ]
    same_bytes(out, clean)


@pytest.mark.parametrize("alone", [True, False], ids=["stage-on-its-own", "in-its-run-directory"])
def test_a_repair_that_cannot_remove_a_file_says_so_in_one_line(model, out, tmp_path, alone):
    """A stray data file verify finds that is a directory (it cannot be unlinked): one error line
    naming it, exit 2, whether the stage is repaired on its own (outside OUT's lock: that used
    to end in a traceback) or in its run directory."""
    stage = out / "pp1"
    if alone:
        stage = Path(shutil.copytree(out / "pp1", tmp_path / "solo" / "pp1"))
    (stage / "stale.safetensors").mkdir()
    r = cli("verify", stage, "--source", model, "--repair")
    assert r.returncode == 2, r.stdout + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stale.safetensors" in errors[0] and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("leftover", ["data", "index"])
def test_a_leftover_partial_symlink_is_not_written_through(model, clean, out, tmp_path, leftover):
    """A ``.NAME.partial`` left in a stage (here a symlink out of OUT) is the repair's to replace,
    never to write through: the file it points at stays as it was and the stage gets real files."""
    damaged = data_files(out / "pp1")[0]
    raw = bytearray(damaged.read_bytes())
    raw[-1] ^= 0x80
    damaged.write_bytes(raw)
    if leftover == "index":  # the index is rewritten too: its temporary is written through the same way
        (out / "pp1" / "model.safetensors.index.json").unlink()
    name = damaged.name if leftover == "data" else "model.safetensors.index.json"
    outside = tmp_path / "precious"
    outside.write_bytes(b"not the repair's to write")
    (out / "pp1" / f".{name}.partial").symlink_to(outside)
    r = cli("verify", out, "--source", model, "--repair")
    assert r.returncode == 0, r.stderr
    assert outside.read_bytes() == b"not the repair's to write"
    assert not (out / "pp1" / name).is_symlink()
    same_bytes(out, clean)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "deleted"])
def test_a_damaged_data_file_beside_a_damaged_manifest_is_rebuilt(model, clean, out, damage):
    """With its stage's manifest unreadable, verify cannot check a data file against it: the
    repair must not take that file's bytes on trust (and bless them in the new manifest)."""
    stage = out / "pp1"
    (stage / "reshard-stage.json").write_text("{damaged")
    data = data_files(stage)[0]
    if damage == "flipped":
        raw = bytearray(data.read_bytes())
        raw[-100] ^= 0x01
        data.write_bytes(raw)
    elif damage == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    else:
        data.unlink()
    r = cli("verify", out, "--source", model, "--repair")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "verify OK" in r.stdout.splitlines()[-1]
    same_bytes(out, clean)
