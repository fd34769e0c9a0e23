"""Crash safety and resume, with real processes, real signals and real kernel limits.

A real ``python -m qwen35_reshard`` run is killed (SIGKILL) or interrupted (SIGINT, SIGTERM)
while it copies, stopped by a full filesystem (a small tmpfs in a private mount namespace) or
by a file-size limit (RLIMIT_FSIZE). After each: nothing looks complete to the loader, to
``verify`` or to a server (no stage index, no run manifest), and running the same command
again finishes the job with output byte-identical to a clean run.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen35_reshard import loader
from qwen35_reshard.verify import verify

from support.helpers import digests, mount_namespace, one_error_line

# Real runs killed and resumed, on a checkpoint big enough to catch them mid-copy.
pytestmark = pytest.mark.slow

INDEX = "model.safetensors.index.json"
STAGE_MANIFEST = "reshard-stage.json"
RUN_MANIFEST = "reshard.json"
RUN_MARKER = ".reshard-run.json"
PP = 4

# Big enough that copying takes a good fraction of a second even on a fast machine, so a run
# can be caught between its first finished file and its end (~270 MB, 17 source shards).
BIG = dict(layers=8, experts=64, hidden=512, moe_intermediate=128, vision=False, shard_bytes=16_000_000)


# --------------------------------------------------------------------------- helpers


def command(model: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "qwen35_reshard", "--pp", str(PP), str(model), str(out),
        "--workers", "1", "--json", *extra,
    ]  # fmt: skip


def start(model: Path, out: Path, logs: Path, preexec_fn=None) -> tuple[subprocess.Popen, Path, Path]:
    """Start a real run; stdout and stderr go to files so that a full pipe never blocks it."""
    logs.mkdir(parents=True, exist_ok=True)
    stdout, stderr = logs / "stdout", logs / "stderr"
    with open(stdout, "w") as o, open(stderr, "w") as e:
        proc = subprocess.Popen(command(model, out), stdout=o, stderr=e, preexec_fn=preexec_fn)
    return proc, stdout, stderr


def plan_cli(model: Path, out: Path, pp: int = PP) -> str:
    """``qwen35-reshard plan`` against OUT: its stdout (the table, then what a real run would do)."""
    p = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "plan", "--pp", str(pp), str(model), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    return p.stdout


def run(model: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(command(model, out, *extra), capture_output=True, text=True, timeout=300)


def wait_until(proc: subprocess.Popen, ready, timeout: float = 120.0) -> None:
    """Poll (every millisecond) until ``ready()`` while ``proc`` still runs."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, (
            "the run ended before the moment to stop it came; the checkpoint is too small for "
            "this machine: raise BIG's sizes"
        )
        assert time.monotonic() < deadline, "timed out waiting for the run"
        time.sleep(0.001)


def kill_when(model: Path, out: Path, logs: Path, ready) -> None:
    """Start a real run, SIGKILL it once ``ready()`` holds, and check the kill is what ended it."""
    proc, _, stderr = start(model, out, logs)
    wait_until(proc, ready)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL, stderr.read_text()


def partials(out: Path) -> list[Path]:
    return sorted(p for p in out.rglob("*.partial"))


def copying(out: Path) -> bool:
    """A stage data file is being written."""
    return any(out.glob("pp*/.model-*.safetensors.*.partial"))


def journaled(out: Path) -> bool:
    """At least one data file finished (renamed and journaled) while others are still being written."""
    for journal in out.glob("pp*/.reshard-journal.jsonl"):
        try:
            if journal.read_text().endswith("\n") and copying(out):
                return True
        except FileNotFoundError:
            pass
    return False


def assert_nothing_complete(out: Path) -> None:
    """No stage index, no run manifest; loader and verify refuse every stage; verify fails."""
    assert not (out / RUN_MANIFEST).exists()
    assert list(out.glob(f"pp*/{INDEX}")) == [], "a stage index exists: a server would load it"
    for r in range(PP):
        with pytest.raises(loader.StageError):
            loader.open_stage(out, pp_rank=r)
    report = verify(out)
    assert not report.ok
    assert not any(s.complete for s in report.stages)
    # A kill before the run made a stage's directory leaves that stage missing from OUT too.
    kinds = {f.kind for f in report.findings}
    assert "incomplete" in kinds and kinds <= {"incomplete", "missing"}, report.findings
    absent = sorted(r for r in range(PP) if not (out / f"pp{r}").is_dir())
    assert report.missing_stages == absent


def assert_only_complete_stages_look_complete(out: Path) -> None:
    """Every stage that has an index is a finished stage that verifies; no run manifest."""
    assert not (out / RUN_MANIFEST).exists()
    assert partials(out) == []
    for stage in sorted(out.glob("pp*")):
        if (stage / INDEX).exists():
            assert (stage / STAGE_MANIFEST).exists()
            assert verify(stage).ok, verify(stage).findings
        else:
            with pytest.raises(loader.StageError):
                loader.open_stage(stage)
    assert not verify(out).ok


@pytest.fixture(scope="module")
def big(tiny, tmp_path_factory):
    return Path(tiny.build_checkpoint(tmp_path_factory.mktemp("big") / "model", **BIG))


@pytest.fixture(scope="module")
def big_clean(big, tmp_path_factory):
    """The same command run once without interruption: the bytes every resumed run must match."""
    out = tmp_path_factory.mktemp("clean") / "out"
    p = run(big, out)
    assert p.returncode == 0, p.stderr
    return digests(out)


@pytest.fixture(scope="module")
def small(tiny, tmp_path_factory):
    return Path(tiny.build_checkpoint(tmp_path_factory.mktemp("small") / "model"))


@pytest.fixture(scope="module")
def small_clean(small, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean") / "out"
    p = run(small, out)
    assert p.returncode == 0, p.stderr
    return out


# --------------------------------------------------------------------------- SIGKILL


@pytest.mark.parametrize("moment", ["marker", "copying", "journaled"])
def test_sigkill_mid_run_then_resume(big, big_clean, tmp_path, moment):
    out = tmp_path / "out"
    ready = {
        "marker": lambda: (out / RUN_MARKER).exists(),
        "copying": lambda: copying(out),
        "journaled": lambda: journaled(out),
    }[moment]
    kill_when(big, out, tmp_path / "logs", ready)

    assert (out / RUN_MARKER).exists()
    assert_nothing_complete(out)
    # The preview says what the real run then does: resume, keeping the killed run's finished files.
    before = digests(out)
    preview = [line for line in plan_cli(big, out).splitlines() if line.startswith(str(out))]
    assert len(preview) == 1 and "a real run resumes it" in preview[0], preview
    found = re.search(r"keeping (\d+) finished data files? of ", preview[0])
    assert digests(out) == before, "plan changed OUT"

    again = run(big, out)
    assert again.returncode == 0, again.stderr
    result = json.loads(again.stdout)["result"]
    assert result["built"] == list(range(PP))
    assert result["files_kept"] == (int(found.group(1)) if found else 0), preview[0]
    if moment == "journaled":
        assert result["files_kept"] >= 1, "finished files of the killed run were not kept"
    assert digests(out) == big_clean
    assert verify(out).ok

    done = run(big, out)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "nothing_to_do"
    assert "nothing to do" in done.stderr
    assert digests(out) == big_clean
    assert f"{out} already holds this split: a real run has nothing to do" in plan_cli(big, out).splitlines()


def test_sigkill_at_many_moments_then_resume(small, small_clean, tmp_path):
    """Kill the same command again and again, each time a little later (so that some kills land
    while files are created, copied, renamed, or while a stage's manifest and index are written);
    after every kill only finished stages look finished, and the last run completes the split.

    A kill after a stage's index, before the run gives up its claim (or, recorded, OUT's lock),
    leaves the killed run's claim (lock) beside a finished stage (split): a leftover of a gone
    run, which verify does not count (made on purpose in test_concurrent.py's
    test_what_a_run_killed_after_finishing_holds_is_removed_by_the_same_command)."""
    out = tmp_path / "out"
    started = time.monotonic()
    assert run(small, tmp_path / "timing").returncode == 0
    duration = time.monotonic() - started
    finished = False
    steps = 20
    for k in range(1, steps + 1):
        proc, _, stderr = start(small, out, tmp_path / f"logs{k}")
        time.sleep(duration * (0.45 + 0.6 * k / steps))  # the first ~40% is interpreter start-up
        proc.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=60)
        if code == 0:
            finished = True
            break
        assert code == -signal.SIGKILL, stderr.read_text()
        if (out / RUN_MANIFEST).exists() and not (out / RUN_MARKER).exists():
            assert verify(out).ok  # killed after its last write, on its way out
            break
        for stage in sorted(out.glob("pp*")):
            if (stage / INDEX).exists():
                assert verify(stage).ok, verify(stage).findings
            else:
                with pytest.raises(loader.StageError):
                    loader.open_stage(stage)
    if not finished:
        assert run(small, out).returncode == 0
    assert digests(out) == digests(small_clean)
    assert verify(out, small).ok


def test_resumed_split_verifies_against_the_source(big, tmp_path):
    out = tmp_path / "out"
    kill_when(big, out, tmp_path / "logs", lambda: journaled(out))
    assert run(big, out).returncode == 0
    report = verify(out, big)
    assert report.ok, report.findings


@pytest.mark.parametrize(
    "moment",
    ["marker_being_written", "manifest_written_index_not", "run_manifest_written_marker_not_removed"],
)
def test_killed_between_two_writes(small, small_clean, tmp_path, moment):
    """The exact on-disk state of a run killed between two of its writes, then the same command.

    (The random-moment test above reaches these only by luck; here each is made on purpose.)
    """
    out = Path(shutil.copytree(small_clean, tmp_path / "out"))
    run_record = json.loads((out / RUN_MANIFEST).read_bytes())
    (out / RUN_MARKER).write_text(json.dumps({"identity": run_record["identity"]}))
    if moment == "marker_being_written":  # the very first write of the very first run
        shutil.rmtree(out)
        out.mkdir()
        (out / f".{RUN_MARKER}.partial").write_text('{"identi')
        assert {(f.kind, f.file) for f in verify(out).findings} == {
            ("incomplete", f".{RUN_MARKER}.partial"),
            ("incomplete", RUN_MANIFEST),
        }
    elif moment == "manifest_written_index_not":
        (out / RUN_MANIFEST).unlink()
        (out / "pp2" / INDEX).unlink()
        with pytest.raises(loader.StageError):
            loader.open_stage(out, pp_rank=2)
        assert {(f.kind, f.stage) for f in verify(out).findings} == {
            ("incomplete", None),
            ("incomplete", "pp2"),
        }
    else:
        assert {(f.kind, f.file) for f in verify(out).findings} == {("incomplete", RUN_MARKER)}
    again = run(small, out)
    assert again.returncode == 0, again.stderr
    assert digests(out) == digests(small_clean)
    assert verify(out, small).ok


# --------------------------------------------------------------------------- Ctrl-C and SIGTERM


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(
    "sig, preexec_fn",
    [(signal.SIGINT, None), (signal.SIGINT, _ignore_sigint), (signal.SIGTERM, None)],
    ids=["SIGINT", "SIGINT-initially-ignored", "SIGTERM"],
)
def test_interrupt_stops_cleanly_and_says_how_to_resume(big, big_clean, tmp_path, sig, preexec_fn):
    """Also when the run starts with SIGINT ignored (a background job, some CI runners): the
    command handles SIGINT itself."""
    out = tmp_path / "out"
    proc, stdout, stderr = start(big, out, tmp_path / "logs", preexec_fn=preexec_fn)
    wait_until(proc, lambda: copying(out))
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 130, stderr.read_text()
    err = stderr.read_text()
    assert "Traceback" not in err
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith("interrupted:") and "run the same command again to resume" in last
    assert json.loads(stdout.read_text())["status"] == "error"
    assert partials(out) == [], "temporary files were left behind"
    assert_nothing_complete(out)

    again = run(big, out)
    assert again.returncode == 0, again.stderr
    assert digests(out) == big_clean


# --------------------------------------------------------------------------- other commands on OUT


def test_a_different_command_is_refused_unless_overwrite(small, tmp_path):
    out = tmp_path / "out"
    assert run(small, out).returncode == 0
    before = digests(out)

    other = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "--pp", "2", str(small), str(out)],
        capture_output=True,
        text=True,
    )
    assert other.returncode == 2
    line = one_error_line(other)
    assert str(out) in line and "--overwrite" in line
    assert digests(out) == before
    assert "pp 4 -> 2" in line and "partition [2, 2, 2, 2] -> [4, 4]" in line
    # The preview shows the plan, then fails as the run would: the same line, exit 2.
    preview = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "plan", "--pp", "2", str(small), str(out)],
        capture_output=True,
        text=True,
    )
    assert preview.returncode == 2 and one_error_line(preview) == line
    assert "pp=2" in preview.stdout  # the plan table's title
    assert digests(out) == before

    replaced = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "--pp", "2", "--overwrite", str(small), str(out)],
        capture_output=True,
        text=True,
    )
    assert replaced.returncode == 0, replaced.stderr
    side = sorted(p.name for p in small.iterdir() if p.is_file() and not p.name.endswith(".safetensors")
                  and p.name != "model.safetensors.index.json")
    assert sorted(p.name for p in out.iterdir()) == sorted(["pp0", "pp1", RUN_MANIFEST, *side])
    assert verify(out, small).ok


def test_an_interrupted_run_is_not_resumed_by_another_command(big, tmp_path):
    out = tmp_path / "out"
    kill_when(big, out, tmp_path / "logs", lambda: copying(out))
    other = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "--pp", "2", str(big), str(out)],
        capture_output=True,
        text=True,
    )
    assert other.returncode == 2 and "--overwrite" in one_error_line(other)
    assert_nothing_complete(out)


def test_overwrite_refuses_files_it_did_not_write(small, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    p = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", "--pp", "2", "--overwrite", str(small), str(out)],
        capture_output=True,
        text=True,
    )
    assert p.returncode == 2 and "notes.txt" in one_error_line(p)
    assert (out / "notes.txt").read_text() == "mine"


# --------------------------------------------------------------------------- a full disk


# Runs inside the namespace: mount a tmpfs of the given size, run the steps (commands, or
# ["remount", size]), copy OUT after each command to a snapshot outside the tmpfs.
_DRIVER = """
import json, os, shutil, subprocess, sys
cfg = json.loads(sys.argv[1])
subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={cfg['size']}", "tmpfs", cfg["mnt"]], check=True)
results = []
for step in cfg["steps"]:
    if step[0] == "remount":
        subprocess.run(["mount", "-o", f"remount,size={step[1]}", cfg["mnt"]], check=True)
        continue
    p = subprocess.run(step, capture_output=True, text=True)
    snap = os.path.join(cfg["snapshots"], str(len(results)))
    if os.path.exists(cfg["out"]):
        shutil.copytree(cfg["out"], snap, symlinks=True)
    results.append({"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr, "snapshot": snap})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def namespace(tmp_path_factory):
    prefix = mount_namespace(tmp_path_factory.mktemp("probe"))
    if prefix is None:
        pytest.skip(
            "cannot mount a small tmpfs here (needs root or unprivileged user namespaces): the "
            "full-disk paths are NOT tested on this machine; test_file_size_limit still runs"
        )
    return prefix


def on_small_filesystem(namespace, tmp_path: Path, size: int, steps: list) -> list[dict]:
    mnt = tmp_path / "fs"
    mnt.mkdir()
    snapshots = tmp_path / "snapshots"
    snapshots.mkdir()
    cfg = {
        "mnt": str(mnt),
        "size": size,
        "out": str(mnt / "out"),
        "snapshots": str(snapshots),
        "steps": steps,
    }
    p = subprocess.run([*namespace, sys.executable, "-c", _DRIVER, json.dumps(cfg)], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def stage_sizes(clean: Path) -> tuple[int, int]:
    """(data file bytes, bytes of config.json and the other side files) over all stages."""
    data = sum(p.stat().st_size for p in clean.glob("pp*/*.safetensors"))
    side = sum(
        p.stat().st_size
        for p in clean.glob("pp*/*")
        if not p.name.endswith(".safetensors") and p.name not in (INDEX, STAGE_MANIFEST)
    )
    return data, side


@pytest.mark.root  # a tmpfs mounted in a private mount namespace
def test_clearly_short_free_space_is_refused_up_front(namespace, small, small_clean, tmp_path):
    data, side = stage_sizes(small_clean)
    out = tmp_path / "fs" / "out"
    [first] = on_small_filesystem(namespace, tmp_path, 256 * 1024, [command(small, out)])
    assert first["rc"] == 2, first["stderr"]
    line = one_error_line(subprocess.CompletedProcess([], first["rc"], first["stdout"], first["stderr"]))
    assert f"OUT {out} has" in line and "free" in line
    assert f"{(data + side) / 1e6:.2f} MB" in line, f"the space needed ({data + side} bytes) is not named"
    # A run that could not start leaves OUT as it was (issue 10): here, not there at all.
    assert not Path(first["snapshot"]).exists(), "refused up front, yet OUT was created"


@pytest.mark.root  # a tmpfs mounted in a private mount namespace
def test_disk_full_mid_run_then_resume(namespace, small, small_clean, tmp_path):
    """Enough bytes by the plan's totals, too few once every file takes whole pages: the run
    starts, fails on ENOSPC with one line, and finishes after the filesystem grows."""
    data, side = stage_sizes(small_clean)
    page = 4096
    # + the pages of the run marker, OUT's lock and the stages' claims
    size = -(-(data + side + (3 + PP) * page) // page) * page
    out = tmp_path / "fs" / "out"
    first, second, third = on_small_filesystem(
        namespace,
        tmp_path,
        size,
        [command(small, out), ["remount", str(64 << 20)], command(small, out), command(small, out)],
    )
    assert first["rc"] == 2, first["stderr"]
    line = one_error_line(subprocess.CompletedProcess([], first["rc"], first["stdout"], first["stderr"]))
    assert f"OUT {out}" in line and "no space left on device" in line
    assert f"{(data + side) / 1e6:.2f} MB" in line and "run the same command again to resume" in line
    assert_only_complete_stages_look_complete(Path(first["snapshot"]))

    assert second["rc"] == 0, second["stderr"]
    assert json.loads(second["stdout"])["status"] == "ok"
    assert digests(Path(second["snapshot"])) == digests(small_clean)
    assert json.loads(third["stdout"])["status"] == "nothing_to_do"


# Leaves what a killed run may leave in a finished split: a record torn by the crash, its
# modification time long past the lease (argv[1] the path).
_LEFTOVER = "import os, sys; open(sys.argv[1], 'w').write('{'); os.utime(sys.argv[1], (0, 0))"


@pytest.mark.root  # a tmpfs mounted in a private mount namespace
@pytest.mark.parametrize("left", [None, ".reshard-lock", "pp1/.reshard-claim", "pp2/.reshard-journal.jsonl"])
def test_a_finished_split_on_a_read_only_filesystem_has_nothing_to_do(namespace, small, tmp_path, left):
    """The same command again on a finished split that is now read-only (a serving node's
    volume): nothing to do, as ``plan`` says, not a write error or a traceback; also when a
    killed run left its lock, a claim or a journal there (which a writable OUT has removed)."""
    out = tmp_path / "fs" / "out"
    leave = [[sys.executable, "-c", _LEFTOVER, str(out / left)]] if left else []
    steps = [command(small, out), *leave, ["remount", f"{64 << 20},ro"], command(small, out)]
    first, *_, again = on_small_filesystem(namespace, tmp_path, 64 << 20, steps)
    assert first["rc"] == 0, first["stderr"]
    assert again["rc"] == 0, again["stderr"]
    assert json.loads(again["stdout"])["status"] == "nothing_to_do"


# --------------------------------------------------------------------------- a file-size limit


_LIMITED = (
    "import os, resource, signal, sys\n"
    "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"  # writes past the limit fail with EFBIG
    "limit = int(sys.argv[1])\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))\n"
    "os.execv(sys.executable, [sys.executable, '-m', 'qwen35_reshard', *sys.argv[2:]])\n"
)


def test_file_size_limit_fails_cleanly_then_resumes(small, small_clean, tmp_path):
    """RLIMIT_FSIZE (a real kernel limit, no mount needed): a write that fails mid-run."""
    out = tmp_path / "out"
    limit = 300_000  # the stage files of the small checkpoint are 250-460 KB
    p = subprocess.run(
        [sys.executable, "-c", _LIMITED, str(limit), *command(small, out)[3:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    line = one_error_line(p)
    assert str(out) in line and "File too large" in line
    assert partials(out) == []
    assert_only_complete_stages_look_complete(out)

    again = run(small, out)
    assert again.returncode == 0, again.stderr
    assert digests(out) == digests(small_clean)
    assert verify(out, small).ok


# --------------------------------------------------------------------------- a kill at an exact step


# Runs the CLI and SIGKILLs it just before its first audited operation ``event`` on a path
# containing ``where`` (audit hooks run before the operation): a real run stopped at an exact step.
_KILLED_AT = (
    "import os, runpy, signal, sys\n"
    "event, where = sys.argv[1], sys.argv[2]\n"
    "def hook(name, args):\n"
    "    if name == event and where in str(args[0]):\n"
    "        os.kill(os.getpid(), signal.SIGKILL)\n"
    "sys.addaudithook(hook)\n"
    "sys.argv = ['qwen35_reshard', *sys.argv[3:]]\n"
    "runpy.run_module('qwen35_reshard', run_name='__main__')\n"
)


def kill_at(event: str, where: str, args: list[str]) -> None:
    p = subprocess.run(
        [sys.executable, "-c", _KILLED_AT, event, where, *args], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == -signal.SIGKILL, p.stderr


def test_killed_while_probing_for_sharing_then_resume(small, small_clean, tmp_path):
    """A run killed while it probes OUT for block sharing leaves the probe file: it is the tool's
    own, so the same command must resume (and remove it), not call OUT foreign."""
    out = tmp_path / "out"
    kill_at("os.remove", ".reflink-probe.", command(small, out)[3:])  # the probe file's removal
    assert any(p.name.startswith(".reflink-probe.") for p in out.iterdir())
    again = run(small, out)
    assert again.returncode == 0, again.stderr
    assert digests(out) == digests(small_clean)


def test_overwrite_killed_while_deleting_the_old_split_then_again(small, small_clean, tmp_path):
    """--overwrite killed while it deletes the split it replaces: what is left is that split's,
    half deleted; it must still be recognised as the tool's, so --overwrite again finishes."""
    out = tmp_path / "out"
    assert subprocess.run([*command(small, out)[:3], "--pp", "2", str(small), str(out)]).returncode == 0
    kill_at("shutil.rmtree", str(out), [*command(small, out)[3:], "--overwrite"])
    assert not list(out.glob(f"pp*/{INDEX}")) and not (out / RUN_MANIFEST).exists()
    plain = run(small, out)
    assert plain.returncode == 2
    line = one_error_line(plain)
    assert "other settings" in line and "--overwrite" in line, line
    again = run(small, out, "--overwrite")
    assert again.returncode == 0, again.stderr
    assert digests(out) == digests(small_clean)


def test_a_journal_torn_into_any_bytes_is_resumed(small, small_clean, tmp_path):
    """A journal's last line torn by a crash may hold any bytes, not even UTF-8: the file it
    named is redone, the rest kept."""
    out = tmp_path / "out"
    # Killed as the first stage's manifest is written: its data files finished and journaled
    # (later stages' may still be copying).
    kill_at("open", "/.reshard-stage.json.", command(small, out)[3:])
    journals = sorted(out.glob("pp*/.reshard-journal.jsonl"))
    assert journals
    with open(journals[0], "ab") as j:
        j.write(b'{"file": "model-0000\xff\xfe')
    assert run(small, out).returncode == 0
    assert digests(out) == digests(small_clean)


def test_a_source_changed_since_the_interrupted_run_is_not_resumed(small, tmp_path):
    """The source updated in place between a killed run and the same command again (same sizes,
    index and config: other weights): the files the killed run finished hold the old bytes, so
    they are not kept, and a resume that would mix the two is refused until --overwrite."""
    model = Path(shutil.copytree(small, tmp_path / "model"))
    out = tmp_path / "out"
    # Killed as the first stage's manifest is written: its data files finished and journaled.
    kill_at("open", "/.reshard-stage.json.", command(model, out)[3:])
    assert list(out.glob("pp*/.reshard-journal.jsonl"))
    for shard in sorted(model.glob("*.safetensors")):
        raw = bytearray(shard.read_bytes())
        start = 8 + int.from_bytes(raw[:8], "little")
        raw[start:] = bytes(b ^ 0x5A for b in raw[start:])
        shard.write_bytes(raw)
    again = run(model, out)
    assert again.returncode == 2, again.stderr
    line = one_error_line(again)
    assert "model-00001-of-00004.safetensors" in line and "--overwrite" in line, line
    assert run(model, out, "--overwrite").returncode == 0
    clean = tmp_path / "clean"
    assert run(model, clean).returncode == 0
    assert digests(out) == digests(clean)
    assert verify(out, model).ok
