"""Exit 0 means the stages hold the source's bytes (issue 29, items 1-4): a rerun into an
existing OUT, a repair, a split built in part, and the advice verify prints. Real processes
and files; two checkpoints of one layout and other bytes stand for two steps of a training run."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_trust import cli, ok

from support.helpers import lone_error_line as error_line

# Real runs of the command, several per case.
pytestmark = pytest.mark.slow


def run_advice(command: str) -> subprocess.CompletedProcess:
    """Run a ``qwen35-reshard ...`` command as printed by the tool."""
    argv = shlex.split(command)
    assert argv[0] == "qwen35-reshard", command
    return cli(*argv[1:])


def data_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.glob("pp*/*.safetensors"))}


def shards(model: Path) -> list[Path]:
    return sorted(model.glob("*.safetensors"))


@pytest.fixture(scope="module")
def a(make_checkpoint):
    return make_checkpoint(layers=6)


@pytest.fixture(scope="module")
def b(make_checkpoint):
    """A's config and headers, other bytes: the next checkpoint of a training run."""
    return make_checkpoint(layers=6, seed=1)


def test_two_checkpoints_have_one_layout(a, b):
    """The premise of this file: only the tensors' bytes tell A and B apart."""
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()
    for x, y in zip(shards(a), shards(b), strict=True):
        n = 8 + int.from_bytes(x.read_bytes()[:8], "little")
        assert x.read_bytes()[:n] == y.read_bytes()[:n]
        assert x.read_bytes() != y.read_bytes()


# --------------------------------------------------------------------------- 1: reruns


def test_split_of_other_bytes_into_a_finished_split_is_refused_then_replaced(a, b, tmp_path):
    """Split A, then B into the same OUT: refused in one line naming a tensor and --overwrite
    (was "nothing to do", exit 0, OUT still A); the advice replaces the split with B's."""
    out = tmp_path / "out"
    ok(cli("--pp", 3, a, out))
    before = data_bytes(out)
    line = error_line(cli("--pp", 3, b, out))
    assert re.search(r"tensor '[^']+' of \S+\.safetensors differs", line), line
    assert "--overwrite" in line
    assert data_bytes(out) == before  # nothing written
    ok(cli("--pp", 3, b, out, "--overwrite"))
    ok(cli("verify", out, "--source", b))


def test_overwrite_replaces_a_finished_split_of_other_bytes(a, b, tmp_path):
    """``--overwrite`` over a finished split of A from B replaces it (was: "nothing to do")."""
    out = tmp_path / "out"
    ok(cli("--pp", 3, a, out))
    proc = ok(cli("--pp", 3, b, out, "--overwrite"))
    assert "nothing to do" not in proc.stdout + proc.stderr
    ok(cli("verify", out, "--source", b))


def test_source_replaced_in_place_is_another_split(a, b, make_checkpoint, tmp_path):
    """MODEL's shards overwritten in place by a fresh download of other bytes (same paths, new
    mtimes): the rerun refuses naming a tensor; with --overwrite the split is B's."""
    model = make_checkpoint(layers=6, fresh=True)
    out = tmp_path / "out"
    ok(cli("--pp", 2, model, out))
    for shard in shards(model):
        with open(shard, "r+b") as f:  # same inode
            f.write((b / shard.name).read_bytes())
    line = error_line(cli("--pp", 2, model, out))
    assert "differs" in line and "--overwrite" in line, line
    ok(cli("--pp", 2, model, out, "--overwrite"))
    ok(cli("verify", out, "--source", b))


def test_same_bytes_stamped_anew_are_rehashed_once_then_recorded(a, make_checkpoint, tmp_path):
    """The same bytes with new stamps (a fresh download of the same release): the rerun hashes
    them, finds them the split's, exits 0 and records the new stamps; the next rerun finds the
    stamps matching (nothing more recorded)."""
    model = make_checkpoint(layers=6, fresh=True)
    out = tmp_path / "out"
    ok(cli("--pp", 2, model, out))
    recorded = json.loads((out / "reshard.json").read_text())["source_files"]
    for shard in shards(model):
        data = shard.read_bytes()
        shard.unlink()
        shard.write_bytes(data)  # another inode, new times
    ok(cli("--pp", 2, model, out))
    restamped = json.loads((out / "reshard.json").read_text())["source_files"]
    assert restamped != recorded
    assert restamped.keys() == recorded.keys()
    mtime = (out / "reshard.json").stat().st_mtime_ns
    proc = ok(cli("--pp", 2, model, out))
    assert "nothing to do" in proc.stdout, proc.stdout
    assert (out / "reshard.json").stat().st_mtime_ns == mtime
    ok(cli("verify", out, "--source", model))


def test_interrupted_split_resumed_from_other_bytes_is_refused(a, b, tmp_path):
    """A run of A stopped after stage 0 (``--rank 0``), then B's run of every stage: refused
    naming a tensor (the finished stage holds A's bytes)."""
    out = tmp_path / "out"
    ok(cli("--pp", 2, "--rank", 0, a, out))
    line = error_line(cli("--pp", 2, b, out))
    assert "differs" in line, line
    ok(cli("--pp", 2, b, out, "--overwrite"))
    ok(cli("verify", out, "--source", b))


# SIGKILLs the CLI at its first file opened in OUT/pp1 once pp1's journal records a finished
# data file (audit hooks run before the operation): a run killed holding a file worth keeping.
_KILLED_JOURNALED = (
    "import os, runpy, signal, sys\n"
    "journal = sys.argv[1]\n"
    "def hook(name, args):\n"
    "    if name == 'open' and '/pp1/' in str(args[0]) and os.path.exists(journal) \\\n"
    "            and os.path.getsize(journal):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "sys.addaudithook(hook)\n"
    "sys.argv = ['qwen35_reshard', *sys.argv[2:]]\n"
    "runpy.run_module('qwen35_reshard', run_name='__main__')\n"
)


def test_files_a_killed_run_left_in_another_stage_are_proven_against_a_changed_source(a, b, tmp_path):
    """``--rank 1`` of A killed with a finished, journaled file in pp1; MODEL then becomes B
    (same layout); ``--rank 0`` is refused naming a tensor (pp1 holds A's bytes), and so is
    ``--rank 1``. Was: ``--rank 0`` exit 0 rewrote the marker with B's stamps, so ``--rank 1``
    kept pp1's file of A's bytes unhashed and exited 0 (verify --source MODEL failed)."""
    model, out = tmp_path / "model", tmp_path / "out"
    shutil.copytree(a, model)
    journal = out / "pp1" / ".reshard-journal.jsonl"
    args = ["--pp", "2", "--rank", "1", str(model), str(out), "--workers", "1"]
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_JOURNALED, str(journal), *args], capture_output=True, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert not (out / "pp1" / "model.safetensors.index.json").exists()  # pp1 unfinished
    assert journal.read_text().strip()  # with a finished file a resume would keep
    for shard in shards(b):
        shutil.copyfile(shard, model / shard.name)
    before = data_bytes(out)
    for rank in (0, 1):
        line = error_line(cli("--pp", 2, "--rank", rank, model, out))
        assert re.search(r"tensor '[^']+' of \S+\.safetensors differs", line), line
        assert "--overwrite" in line, line
    assert data_bytes(out) == before  # nothing written
    ok(cli("--pp", 2, "--rank", 0, model, out, "--overwrite"))
    ok(cli("--pp", 2, "--rank", 1, model, out))
    ok(cli("verify", out, "--source", model))


# --------------------------------------------------------------------------- 2: repair


def stamps(out: Path) -> dict[str, tuple[int, int]]:
    """Each stage data file's inode and mtime: what a rewrite changes."""
    files = out.glob("pp*/*.safetensors")
    return {str(p.relative_to(out)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}


def first_tensor(path: Path) -> tuple[str, int, int]:
    """Name, absolute offset and size of the first tensor (in data order) of a safetensors file."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    name, entry = min(
        ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"][0]
    )
    begin, end = entry["data_offsets"]
    return name, 8 + n + begin, end - begin


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_repair_from_other_bytes_over_an_intact_split_is_refused_and_writes_nothing(a, b, tmp_path):
    """``verify OUT --source B --repair`` over an intact split of A: one line naming a tensor,
    nothing written (was: every data file rewritten from B, then "verify FAILED")."""
    out = tmp_path / "out"
    ok(cli("--pp", 3, a, out))
    before = stamps(out)
    line = error_line(cli("verify", out, "--source", b, "--repair"))
    assert re.search(r"tensor '[^']+'", line) and "--source" in line, line
    assert stamps(out) == before
    ok(cli("verify", out, "--source", a))


def test_repair_from_other_bytes_with_a_damaged_file_writes_nothing(a, b, tmp_path):
    """One data file of a split of A damaged, repaired from B: refused, nothing written (was:
    every file rewritten, the intact ones too)."""
    out = tmp_path / "out"
    ok(cli("--pp", 3, a, out))
    damaged = sorted(out.glob("pp1/*.safetensors"))[0]
    flip(damaged, damaged.stat().st_size - 1)
    before, damaged_bytes = stamps(out), damaged.read_bytes()
    line = error_line(cli("verify", out, "--source", b, "--repair"))
    assert stamps(out) == before and damaged.read_bytes() == damaged_bytes
    # The advice: the checkpoint the split was made from, as --source.
    assert "pass the checkpoint the split was made from as --source" in line, line
    ok(cli("verify", out, "--source", a, "--repair"))
    ok(cli("verify", out, "--source", a))


def test_repair_rewrites_only_the_damaged_file(a, tmp_path):
    """From the right source, the damaged file alone is rewritten; the intact ones keep their
    inode and mtime."""
    out = tmp_path / "out"
    ok(cli("--pp", 3, a, out))
    damaged = sorted(out.glob("pp1/*.safetensors"))[0]
    flip(damaged, damaged.stat().st_size - 1)
    before = stamps(out)
    proc = ok(cli("verify", out, "--source", a, "--repair"))
    after = stamps(out)
    rel = str(damaged.relative_to(out))
    assert after[rel] != before[rel]
    assert {k: v for k, v in after.items() if k != rel} == {k: v for k, v in before.items() if k != rel}
    assert proc.stdout.count("repaired: ") == 1, proc.stdout


def test_repair_checks_the_source_bytes_of_the_files_it_rewrites(a, make_checkpoint, tmp_path):
    """A source that differs from the split only in the one tensor whose stage file is damaged:
    nothing else tells it apart, yet its bytes are not the manifest's; refused naming that
    tensor, nothing written (was: the file rewritten with the other bytes, exit 0)."""
    out = tmp_path / "out"
    ok(cli("--pp", 2, a, out))
    damaged = sorted(out.glob("pp1/*.safetensors"))[0]
    name, offset, _ = first_tensor(damaged)
    flip(damaged, offset)
    source = make_checkpoint(layers=6, fresh=True)
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    shard = source / index[name]
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    flip(shard, 8 + n + json.loads(raw[8 : 8 + n])[name]["data_offsets"][0])
    before = stamps(out)
    line = error_line(cli("verify", out, "--source", source, "--repair"))
    assert repr(name) in line, line
    assert stamps(out) == before


# --------------------------------------------------------------------------- 3: stages missing


def test_verify_of_a_split_built_in_part_fails_naming_the_stages_missing(a, tmp_path):
    """A split built with ``--rank 2`` of ``--pp 4``: ``verify OUT`` fails (exit 1) naming the
    three stages missing (was "verify OK ..., 1 stage", exit 0); --json lists the stages checked
    and missing; the printed advice (``--rank 2``) passes."""
    out = tmp_path / "out"
    ok(cli("--pp", 4, "--rank", 2, a, out))
    proc = cli("verify", out, "--json")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["checked"] == [2] and doc["missing_stages"] == [0, 1, 3], doc
    for name in ("pp0", "pp1", "pp3"):
        assert f"{out}/{name} of this pp=4 split is missing" in proc.stderr, proc.stderr
    advice = re.search(r"check only the stages here \(pp2\): (qwen35-reshard verify .*)$", proc.stderr, re.M)
    assert advice, proc.stderr
    proc = ok(run_advice(advice.group(1)))
    assert "not checked" in proc.stdout
    doc = json.loads(ok(cli("verify", out, "--rank", 2, "--json")).stdout)
    assert doc["checked"] == [2] and doc["missing_stages"] == [] and doc["not_built"] == [0, 1, 3]
    # No repair is advised: stages never built are not damaged files (a repair would build
    # them on this node).
    assert "--repair" not in cli("verify", out).stdout


def test_verify_rank_auto_checks_the_stages_of_this_node(a, tmp_path):
    """``verify OUT --rank auto`` takes the node's stages from the scheduler's variables, as a
    split does; a stage of the node that is missing fails it."""
    out = tmp_path / "out"
    node = {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2"}  # stages 2 and 3 of pp=4
    ok(cli("--pp", 4, "--rank", "auto", a, out, env=node))
    doc = json.loads(ok(cli("verify", out, "--rank", "auto", "--json", env=node)).stdout)
    assert doc["checked"] == [2, 3] and doc["missing_stages"] == []
    shutil.rmtree(out / "pp3")
    proc = cli("verify", out, "--rank", "auto", "--json", env=node)
    assert proc.returncode == 1 and json.loads(proc.stdout)["missing_stages"] == [3]


def test_a_deleted_stage_fails_verify_and_the_advice_rebuilds_it(a, tmp_path):
    """A stage directory of a finished split deleted: verify names it; the same command again
    (as the message says) builds it, and verify passes."""
    out = tmp_path / "out"
    ok(cli("--pp", 3, a, out))
    shutil.rmtree(out / "pp1")
    proc = cli("verify", out)
    assert proc.returncode == 1 and f"{out}/pp1 of this pp=3 split is missing" in proc.stdout, proc.stdout
    assert "run the same qwen35-reshard command again" in proc.stdout
    ok(cli("--pp", 3, a, out))
    ok(cli("verify", out, "--source", a))


# --------------------------------------------------------------------------- 4: advice


def test_verify_against_other_bytes_advises_what_works(a, b, tmp_path):
    """``verify OUT --source B`` of a split of A: no repair advice (it would be refused); the
    command it prints replaces the split with B's, which then verifies."""
    out = tmp_path / "out"
    ok(cli("--pp", 3, "--partition", "1,2,3", a, out))
    proc = cli("verify", out, "--source", b)
    assert proc.returncode == 1
    assert "--repair" not in proc.stdout, proc.stdout
    advice = re.search(r"(qwen35-reshard split .*)$", proc.stdout.strip().splitlines()[-1])
    assert advice, proc.stdout
    ok(run_advice(advice.group(1)))
    ok(cli("verify", out, "--source", b))
    assert json.loads((out / "reshard.json").read_text())["partition"] == [1, 2, 3]


def test_copied_stages_are_checked_on_their_own_and_told_how_to_check_them_as_one_split(a, tmp_path):
    """``cp -a OUT/pp1 node/q/pp1; verify node/q``: not "the run that wrote it did not finish"
    (nothing was interrupted); the stage is checked on its own manifest, and the printed command
    checks it as a stage of its split, and passes."""
    out, node = tmp_path / "out", tmp_path / "node" / "q"
    ok(cli("--pp", 3, a, out))
    node.mkdir(parents=True)
    subprocess.run(["cp", "-a", str(out / "pp1"), str(node / "pp1")], check=True)
    proc = cli("verify", node)
    text = proc.stdout + proc.stderr
    assert "did not finish" not in text and "run the same" not in text, text
    assert "copied stages" in text and f"{node}/pp1: ok" in text, text
    advice = re.search(r"(qwen35-reshard verify .*)$", text.strip().splitlines()[1])
    assert advice, text
    assert "--repair" not in text
    ok(run_advice(advice.group(1)))
    subprocess.run(["cp", "-a", str(out / "pp0"), str(out / "pp2"), str(node)], check=True)
    ok(cli("verify", node))


# --------------------------------------------------------------------------- 1 with shared blocks


@pytest.fixture(scope="module")
def xfs(tmp_path_factory):
    """A loop-mounted XFS filesystem, as test_reflink makes them, unmounted after."""
    from test_reflink import _mount

    mnt = _mount("xfs", tmp_path_factory.mktemp("xfs"))
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False, capture_output=True)


def test_a_split_that_shared_blocks_is_compared_with_its_own_bytes(xfs, tiny):
    """On XFS the split shares the source's blocks and records no digest for those tensors: a
    rerun from other bytes of one layout is still refused naming a tensor (compared with the
    stage's own bytes), and the same bytes stamped anew are still nothing to do."""
    from test_reflink import CKPT

    root = xfs / "rerun"
    a = tiny.build_checkpoint(root / "a", **CKPT)
    b = tiny.build_checkpoint(root / "b", **{**CKPT, "seed": 1})
    out = root / "out"
    ok(cli("--pp", 2, "--reflink", "always", a, out))
    manifest = json.loads((out / "pp0" / "reshard-stage.json").read_text())
    assert any(t["xxh128"] is None for t in manifest["tensors"].values())  # shared, not hashed
    line = error_line(cli("--pp", 2, b, out))
    assert "differs" in line and "--overwrite" in line, line
    for shard in shards(a):
        data = shard.read_bytes()
        shard.unlink()
        shard.write_bytes(data)
    ok(cli("--pp", 2, a, out))
    ok(cli("verify", out, "--source", a))
