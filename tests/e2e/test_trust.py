"""Trust after the happy path (issue 23, findings 1-5): where a split's bytes came from is part
of its identity and every reader compares it; a source replaced during a run is caught; OUT's
own files are part of the split; every limit is honoured or refused; and every suggestion the
tool prints leads to a command that works. Real processes, files and the loopback Hub."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import ROOT, lone_error_line, one_error_line, other_weights

# Real runs of the command (several per case), against a Hub server too.
pytestmark = pytest.mark.slow

STAGE_MANIFEST = "reshard-stage.json"


def cli(*args, env=None) -> subprocess.CompletedProcess:
    """``python -m qwen35_reshard ARGS`` in a subprocess."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "qwen35_reshard", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def data_files(out: Path) -> dict[str, int]:
    return {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.glob("pp*/*.safetensors"))}


# --------------------------------------------------------------------------- 4: limits


@pytest.fixture(scope="module")
def big_shards(make_checkpoint):
    """Shards of ~1.8 MB, the largest tensor 512 KiB."""
    return make_checkpoint(shard_bytes=2_000_000, hidden=256)


def test_max_file_size_holds_for_shards_needed_whole(big_shards, tmp_path):
    """A shard needed whole but larger than --max-file-size is no longer copied whole: every
    data file written is within the limit, and the split verifies against its source."""
    out = tmp_path / "out"
    ok(cli("--pp", 2, "--max-file-size", "1MB", big_shards, out))
    sizes = data_files(out)
    assert sizes and max(sizes.values()) <= 1_000_000, sizes
    ok(cli("verify", out, "--source", big_shards))


def test_nonsense_max_file_size_is_refused_naming_the_tensor_and_a_limit_that_works(big_shards, tmp_path):
    """``--max-file-size 10``: refused before anything is written, in one line naming the
    tensor that cannot fit and the smallest limit that works; that limit then works."""
    out = tmp_path / "out"
    line = lone_error_line(cli("--pp", 2, "--max-file-size", "10", big_shards, out))
    assert not out.exists()
    m = re.search(r"tensor '([^']+)'.*pass --max-file-size (\d+) or more", line)
    assert m, line
    assert "--max-file-size 10 " in line
    limit = int(m.group(2))
    assert 512 * 1024 < limit < 512 * 1024 + 4096, line
    ok(cli("--pp", 2, "--max-file-size", limit, big_shards, out))
    assert max(data_files(out).values()) <= limit
    ok(cli("verify", out, "--source", big_shards))
    refused = lone_error_line(cli("--pp", 2, "--max-file-size", limit - 1, big_shards, tmp_path / "o2"))
    assert f"pass --max-file-size {limit} or more" in refused


# --------------------------------------------------------------------------- 1: the source in the identity


@pytest.fixture
def moving_hub(make_checkpoint, tmp_path):
    """The loopback Hub with ``Qwen/Tiny`` at two commits A and B of the same layout, ``main``
    at A; yields (server, A, B, model A, model B)."""
    import test_hub

    from support.hub_server import HubServer

    model_a = make_checkpoint(shard_bytes=test_hub.SHARD_BYTES)
    model_b = other_weights(model_a, tmp_path / "model-b")
    with HubServer() as server:
        b = server.add_repo(test_hub.REPO, model_b)
        a = server.add_repo(test_hub.REPO, model_a)
        assert a != b
        yield server, a, b, model_a, model_b


def test_stages_of_two_hub_commits_are_refused_into_one_out(moving_hub, tmp_path):
    """``--rank 0`` at commit A, then ``main`` moves to B (same index, config and headers,
    other weights): ``--rank 1`` into the same OUT is refused in one line naming both commits,
    and so is a full rerun of the finished split (not "nothing to do"); ``--overwrite``
    rebuilds it from B, and it verifies against B."""
    import test_hub

    server, a, b, _, model_b = moving_hub
    hf_home, out = tmp_path / "hf", tmp_path / "out"
    hf_home.mkdir()

    def run(*args, **kw):
        return test_hub.run(args, hub=server, hf_home=hf_home, check=False, **kw)

    ok(run("--pp", 2, "--rank", 0, test_hub.REPO, out))
    server.move(test_hub.REPO, b)
    line = lone_error_line(run("--pp", 2, "--rank", 1, test_hub.REPO, out))
    assert f"{test_hub.REPO}@{a}" in line and f"{test_hub.REPO}@{b}" in line, line
    assert "--overwrite" in line
    assert not (out / "pp1").exists()

    server.move(test_hub.REPO, a)
    ok(run("--pp", 2, test_hub.REPO, out))
    server.move(test_hub.REPO, b)
    rerun = run("--pp", 2, test_hub.REPO, out)
    line = lone_error_line(rerun)
    assert f"@{a}" in line and f"@{b}" in line and "nothing to do" not in rerun.stdout + rerun.stderr
    ok(run("--pp", 2, "--overwrite", test_hub.REPO, out))
    for rank in (0, 1):
        manifest = json.loads((out / f"pp{rank}" / STAGE_MANIFEST).read_bytes())
        assert manifest["identity"]["source"] == f"{test_hub.REPO}@{b}"
    ok(run("verify", out, "--source", model_b))


def test_readers_refuse_a_split_whose_stages_come_from_two_commits(moving_hub, tmp_path):
    """A split whose pp1 was built at another commit than pp0 (copied in: what the tool let
    through before) fails ``verify`` and is refused by the loader (the check the vLLM and SGLang
    plugins open their stage with); with the run record lost, verify still tells the stages
    apart."""
    import test_hub

    from qwen35_reshard import loader

    server, a, b, _, _ = moving_hub
    hf_home = tmp_path / "hf"
    hf_home.mkdir()
    out, other = tmp_path / "out", tmp_path / "other"
    ok(test_hub.run(["--pp", 2, test_hub.REPO, out], hub=server, hf_home=hf_home))
    server.move(test_hub.REPO, b)
    ok(test_hub.run(["--pp", 2, test_hub.REPO, other], hub=server, hf_home=hf_home))
    shutil.rmtree(out / "pp1")
    shutil.copytree(other / "pp1", out / "pp1")

    report = cli("verify", out, "--json")
    assert report.returncode == 1, report.stderr
    messages = [f["message"] for f in json.loads(report.stdout)["findings"]]
    assert any(f"@{a}" in m and f"@{b}" in m and "pp1" in m for m in messages), messages
    loader.open_stage(out, pp_rank=0)
    with pytest.raises(loader.StageError, match=f"@{a}.*@{b}"):
        loader.open_stage(out, pp_rank=1)

    # The repair line names the repo at the commit the split records (the shards came straight
    # into the stages, so the cache snapshot lacks them): it mends pp1, with main moved on.
    repair = shlex.split(REPAIR_LINE.search(cli("verify", out).stdout).group(1))
    assert repair[repair.index("--source") + 1] == test_hub.REPO, repair
    assert repair[repair.index("--revision") + 1] == a, repair
    mended = tmp_path / "mended"
    shutil.copytree(out, mended)
    test_hub.run([str(mended) if c == str(out) else c for c in repair[1:]], hub=server, hf_home=hf_home)
    ok(cli("verify", mended))

    (out / "reshard.json").unlink()
    messages = [f["message"] for f in json.loads(cli("verify", out, "--json").stdout)["findings"]]
    assert any("belongs to another split than" in m and f"@{b}" in m for m in messages), messages


# --------------------------------------------------------------------------- 3: OUT's own files


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint()


@pytest.fixture(scope="module")
def clean_split(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    ok(cli("--pp", 2, model, out))
    return out


@pytest.fixture
def split(clean_split, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(clean_split, out, symlinks=True)
    return out


def findings(out: Path, *args) -> list[dict]:
    proc = cli("verify", out, "--json", *args)
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout)["findings"]


def edit_config(path: Path) -> None:
    config = json.loads(path.read_bytes())
    config.setdefault("text_config", config)["num_hidden_layers"] = 4
    path.write_text(json.dumps(config))


@pytest.mark.parametrize("where", ["out", "stage"])
def test_damaged_non_weight_files_are_found_and_not_nothing_to_do(split, model, where):
    """OUT/config.json edited and OUT/tokenizer.json deleted (what ``vllm serve OUT`` reads), or
    the same in a stage: ``verify OUT`` names each file without the source; a rerun of the
    split is not "nothing to do" but writes them again, and the split verifies."""
    base = split if where == "out" else split / "pp1"
    edit_config(base / "config.json")
    (base / "tokenizer.json").unlink()
    found = findings(split)
    named = {(f["stage"], f["file"], f["kind"]) for f in found}
    stage = None if where == "out" else "pp1"
    assert {(stage, "config.json", "different"), (stage, "tokenizer.json", "missing")} <= named, found
    assert any(f"{base.name}/config.json" in f["message"] for f in found)
    assert findings(split, "--source", model)
    rerun = ok(cli("--pp", 2, model, split))
    assert "nothing to do" not in rerun.stdout + rerun.stderr
    assert findings(split, "--source", model) == []
    assert (split / "tokenizer.json").read_bytes() == (model / "tokenizer.json").read_bytes()


def test_repair_restores_out_s_own_files(split, model):
    """``verify OUT --source MODEL --repair`` restores OUT's own config.json and tokenizer.json."""
    edit_config(split / "config.json")
    (split / "tokenizer.json").unlink()
    proc = ok(cli("verify", split, "--source", model, "--repair"))
    assert "verify OK" in proc.stdout, proc.stdout
    assert (split / "config.json").read_bytes() == (model / "config.json").read_bytes()
    assert findings(split) == []


# --------------------------------------------------------------------------- 5: every suggestion works


REPAIR_LINE = re.compile(r"^to rebuild the damaged files from the source: (.+)$", re.M)


def flip_tensor_bytes(stage: Path) -> None:
    path = sorted(stage.glob("*.safetensors"))[0]
    raw = bytearray(path.read_bytes())
    raw[-8:] = bytes(b ^ 0xFF for b in raw[-8:])
    path.write_bytes(bytes(raw))


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def other_split_stage(out: Path, model: Path, tmp: Path) -> None:
    ok(cli("--pp", 2, "--partition", "3,5", model, tmp / "other"))
    shutil.rmtree(out / "pp1")
    shutil.copytree(tmp / "other" / "pp1", out / "pp1")


def first_data_file(out: Path) -> Path:
    return sorted((out / "pp0").glob("*.safetensors"))[0]


DAMAGE = {
    "data_file_truncated": lambda out, model, tmp: truncate(first_data_file(out)),
    "tensor_bytes_changed": lambda out, model, tmp: flip_tensor_bytes(out / "pp1"),
    "data_file_missing": lambda out, model, tmp: first_data_file(out).unlink(),
    "stage_index_missing": lambda out, model, tmp: (out / "pp0" / "model.safetensors.index.json").unlink(),
    "stage_manifest_missing": lambda out, model, tmp: (out / "pp1" / STAGE_MANIFEST).unlink(),
    "stage_manifest_damaged": lambda out, model, tmp: (out / "pp1" / STAGE_MANIFEST).write_text("{"),
    "stray_data_file": lambda out, model, tmp: shutil.copy(first_data_file(out), out / "pp0/x.safetensors"),
    "leftover_partial": lambda out, model, tmp: (out / "pp0" / ".x.safetensors.partial").write_bytes(b"x"),
    "run_record_lost": lambda out, model, tmp: (out / "reshard.json").unlink(),
    "run_record_damaged": lambda out, model, tmp: (out / "reshard.json").write_text("[]"),
    "run_interrupted": lambda out, model, tmp: (out / "reshard.json").rename(out / ".reshard-run.json"),
    "out_tokenizer_changed": lambda out, model, tmp: (out / "tokenizer.json").write_text("{}"),
    "out_config_missing": lambda out, model, tmp: (out / "config.json").unlink(),
    "stage_config_changed": lambda out, model, tmp: edit_config(out / "pp0" / "config.json"),
    "stage_side_file_missing": lambda out, model, tmp: (out / "pp1" / "tokenizer.json").unlink(),
    "stage_outside_split": lambda out, model, tmp: shutil.copytree(out / "pp1", out / "pp5"),
    "stage_of_another_split": other_split_stage,
}


def suggestions(out: Path, model: Path) -> list[tuple[str, list[str]]]:
    """Every way the failed ``verify OUT`` output says to fix what it found, as (what, command
    lines to run), each command a list of arguments of qwen35-reshard."""
    proc = cli("verify", out)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(cli("verify", out, "--json").stdout)
    split = ["--pp", "2", str(model), str(out)]
    found: list[tuple[str, list[list[str]]]] = []
    if m := REPAIR_LINE.search(proc.stdout):
        command = shlex.split(m.group(1))
        assert command[0] == "qwen35-reshard", m.group(1)
        found.append(("the repair line", [command[1:]]))
    for f in report["findings"]:
        message, where = f["message"], out / f["stage"] if f["stage"] else out
        if "delete it and run the same qwen35-reshard command again" in message:
            found.append(("delete the stage, run again", [["rm", str(where)], split]))
        elif "run the same qwen35-reshard command again" in message:
            found.append(("run again", [split]))
        elif "and run the qwen35-reshard command for the split you want again" in message:
            found.append(("delete the stage, run again", [["rm", str(where)], split]))
        elif message.endswith("delete it"):
            found.append(("delete it", [["rm", str(where / f["file"]) if f["file"] else str(where)]]))
        elif "--repair" in message:
            found.append(("repair", [["verify", str(out), "--source", str(model), "--repair"]]))
    assert found, proc.stdout
    return found


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_every_suggestion_verify_prints_leads_to_a_split_that_verifies(clean_split, model, tmp_path, damage):
    """For each kind of damage verify reports, follow each fix it suggests, on a fresh copy:
    the split then verifies against its source. A suggestion that leads nowhere fails here."""
    base = tmp_path / "damaged"
    shutil.copytree(clean_split, base, symlinks=True)
    DAMAGE[damage](base, model, tmp_path)
    for k, (what, commands) in enumerate(suggestions(base, model)):
        out = tmp_path / f"try{k}"
        shutil.copytree(base, out, symlinks=True)
        for command in commands:
            command = [str(out) if c == str(base) else c.replace(str(base), str(out)) for c in command]
            if command[0] == "rm":
                target = Path(command[1])
                shutil.rmtree(target) if target.is_dir() else target.unlink()
            else:
                ok(cli(*command))
        proc = cli("verify", out, "--source", model)
        assert proc.returncode == 0, f"{damage}: following {what!r} {commands}:\n{proc.stdout}{proc.stderr}"


def test_repair_of_a_plain_checkpoint_suggests_nothing_and_refuses_with_exit_2(model):
    """``verify`` of a checkpoint directory (not a split) suggests no --repair, and ``--repair``
    there is refused in one line, exit 2."""
    proc = cli("verify", model)
    assert proc.returncode == 1 and "--repair" not in proc.stdout + proc.stderr, proc.stdout
    line = lone_error_line(cli("verify", model, "--source", model, "--repair"))
    assert "cannot be repaired" in line


def test_repair_checks_free_space_first(split, model, tmp_path):
    """``--repair`` on a device with too little room refuses before touching anything, naming
    what it needs, as a split does (a 1 MB tmpfs could not hold the stage it must rewrite)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root to mount a small tmpfs")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = small / "out"
        shutil.copytree(split / "pp0", out / "pp0", ignore=shutil.ignore_patterns("*.safetensors"))
        shutil.copy(split / "reshard.json", out / "reshard.json")
        before = sorted(p.name for p in (out / "pp0").iterdir())
        line = lone_error_line(cli("verify", out, "--source", model, "--repair"))
        assert "free but this run writes" in line, line
        assert sorted(p.name for p in (out / "pp0").iterdir()) == before
    finally:
        subprocess.run(["umount", str(small)])


# --------------------------------------------------------------------------- 2: a source replaced mid-run


def replace_keeping_size_and_mtime(shard: Path) -> None:
    """Put another file of the same size, header and mtime in ``shard``'s place (a rename over
    it): other tensor bytes that no size, header or mtime check can tell."""
    st = shard.stat()
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n : 8 + n + 64] = bytes(b ^ 0xFF for b in raw[8 + n : 8 + n + 64])
    other = shard.with_name(".replacement")
    other.write_bytes(bytes(raw))
    os.utime(other, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(other, shard)


@pytest.mark.parametrize("which", ["not_yet_read", "already_read"])
def test_a_source_shard_replaced_during_the_run_fails_it_and_no_stage_looks_complete(
    make_checkpoint, tmp_path, which
):
    """With one worker, a shard is replaced (same size, header and mtime) at a chosen point of
    the copy: before it is read (caught as it is opened) or after (caught before any stage is
    declared complete). The run fails in one line naming the shard; no stage looks complete and
    no run record is written; the bytes copied from the other file are never vouched for."""
    from qwen35_reshard import ReshardError
    from qwen35_reshard.plan.planner import make_plan
    from qwen35_reshard.source.checkpoint import read_checkpoint
    from qwen35_reshard.stage.manifest import stage_is_complete
    from qwen35_reshard.write.writer import Reporter, WriteOptions, write_plan

    model = make_checkpoint(fresh=True)
    plan = make_plan(read_checkpoint(model), pp=2)
    shards = plan.checkpoint.files
    victim = model / (shards[-1] if which == "not_yet_read" else shards[0])

    # Each tiny shard is one window of the copy, reported once: at the first report the first
    # shard is being copied (the last one not yet read); at the second, the first one is done.
    replace_at = 1 if which == "not_yet_read" else 2

    class ReplaceOnce(Reporter):
        def __init__(self) -> None:
            self.calls = 0

        def advance(self, nbytes: int) -> None:
            self.calls += 1
            if self.calls == replace_at:
                replace_keeping_size_and_mtime(victim)

    out = tmp_path / "out"
    with pytest.raises(ReshardError) as refused:
        write_plan(plan, out, WriteOptions(workers=1, reflink="never"), reporter=ReplaceOnce())
    message = str(refused.value)
    assert "\n" not in message and str(victim) in message and "changed during the run" in message, message
    assert not any(stage_is_complete(out / s.dirname) for s in plan.stages)
    assert not (out / "reshard.json").exists()
    # The command again (issue 29): a file the run finished holds the old bytes: refused naming
    # a tensor until told to start over; where none does, it resumes from the new bytes.
    proc = cli("--pp", 2, model, out)
    if which == "already_read":
        line = lone_error_line(proc)
        assert "differs" in line and "--overwrite" in line, line
        ok(cli("--pp", 2, "--overwrite", model, out))
    else:
        ok(proc)
    ok(cli("verify", out, "--source", model))


def test_a_cached_hub_blob_that_is_not_the_hub_s_bytes_fails_the_run(make_checkpoint, tmp_path):
    """A shard copied whole from the Hugging Face cache is hashed as it streams and compared
    with the Hub's LFS sha256 (huggingface_hub checks only the size): a cached blob whose bytes
    were changed (same size) fails the run in one line naming the shard; no stage looks
    complete. The clone's manifest records that sha256, so verify checks it without a source."""
    import test_hub

    from support.hub_server import HubServer

    model = make_checkpoint(shard_bytes=test_hub.SHARD_BYTES)
    hf_home = tmp_path / "hf"
    hf_home.mkdir()
    with HubServer() as server:
        server.add_repo(test_hub.REPO, model)
        first = tmp_path / "first"
        # --hf-cache: the shards a stage needs whole go through the Hugging Face cache, as a
        # cache filled by `hf download` holds them (by default they come straight into the stage).
        ok(test_hub.run(["--pp", 2, "--hf-cache", test_hub.REPO, first], hub=server, hf_home=hf_home))
        clones = [
            info["sha256"]
            for p in first.glob("pp*/reshard-stage.json")
            for info in json.loads(p.read_bytes())["files"].values()
            if info["layout"] == "clone"
        ]
        assert clones and all(len(d) == 64 for d in clones)
        ok(cli("verify", first))
        shard = sorted(model.glob("*.safetensors"))[1]
        blob = Path(os.path.realpath(next(hf_home.glob(f"hub/models--*/snapshots/*/{shard.name}"))))
        raw = bytearray(blob.read_bytes())
        raw[-64:] = bytes(b ^ 0xFF for b in raw[-64:])
        blob.chmod(0o644)
        blob.write_bytes(bytes(raw))
        out = tmp_path / "out"
        split = ["--pp", 2, test_hub.REPO, out]
        line = one_error_line(test_hub.run(split, hub=server, hf_home=hf_home, check=False))
        assert shard.name in line and "LFS sha256" in line and f"{blob} is damaged" in line, line
        assert not list(out.glob("pp*/reshard-stage.json")) and not (out / "reshard.json").exists()
        blob.unlink()  # as the message says; then the same command again
        ok(test_hub.run(split, hub=server, hf_home=hf_home))
    ok(cli("verify", out, "--source", model))
