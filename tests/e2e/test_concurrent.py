"""Runs sharing one OUT, with real processes: each race made deterministic by a run that stops
itself (SIGSTOP, from an audit hook) at a chosen write, another run going on meanwhile, and the
first continued (SIGCONT); then a few rounds of many runs started together.

Every scenario ends in the bytes one sequential run writes, and ``verify --source`` passing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qwen35_reshard.verify import verify

from support.helpers import digests, one_error_line

# Several real runs at once, stopped and continued at chosen writes.
pytestmark = pytest.mark.slow

PP = 4
CLAIM = ".reshard-claim"

# Runs the CLI with an audit hook that stops the process (SIGSTOP) the first time it raises
# the audit event argv[1] ("open", "os.mkdir") on a path containing argv[2]; argv[3:] are the
# CLI's arguments. argv[2] may end in "$" (the path ends so) and then "#N" (the Nth such event).
_STOP_AT = (
    "import os, runpy, signal, sys\n"
    "event, where = sys.argv[1:3]\n"
    "where, _, nth = where.partition('#')\n"
    "end = where.endswith('$')\n"
    "where = where.removesuffix('$')\n"
    "hits = [int(nth or 1)]\n"
    "def hook(name, args):\n"
    "    path = str(args[0]) if args else ''\n"
    "    if name == event and hits[0] and (path.endswith(where) if end else where in path):\n"
    "        hits[0] -= 1\n"
    "        if not hits[0]:\n"
    "            os.kill(os.getpid(), signal.SIGSTOP)\n"
    "sys.addaudithook(hook)\n"
    "sys.argv = ['qwen35_reshard', *sys.argv[3:]]\n"
    "runpy.run_module('qwen35_reshard', run_name='__main__')\n"
)


def split_args(model: Path, out: Path, *extra: str, pp: int = PP) -> list[str]:
    return ["--pp", str(pp), str(model), str(out), "--workers", "1", "--json", *extra]


class Run:
    """A real run in the background, its stderr in a file (a full pipe never blocks it)."""

    def __init__(self, args: list[str], logs: Path, stop_at: str | None = None, event: str = "open") -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.stdout, self.stderr = logs / "stdout", logs / "stderr"
        prefix = [sys.executable, "-m", "qwen35_reshard"]
        if stop_at is not None:
            prefix = [sys.executable, "-c", _STOP_AT, event, stop_at]
        with open(self.stdout, "w") as o, open(self.stderr, "w") as e:
            self.proc = subprocess.Popen([*prefix, *args], stdout=o, stderr=e)

    def state(self) -> str:
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]

    def wait_stopped(self) -> None:
        """Until the run has stopped itself at its point."""
        deadline = time.monotonic() + 120
        while self.state() != "T":
            assert self.proc.poll() is None, f"ended before its stop point: {self.stderr.read_text()}"
            assert time.monotonic() < deadline
            time.sleep(0.005)

    def wait_ended_or_waiting(self) -> None:
        """Until the run has ended, or says it waits for another run."""
        deadline = time.monotonic() + 120
        while self.proc.poll() is None and "waiting for it" not in self.stderr.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    def finish(self) -> int:
        return self.proc.wait(timeout=120)

    def resume(self) -> int:
        os.kill(self.proc.pid, signal.SIGCONT)
        return self.finish()


def cli(*args: object) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", *map(str, args)], capture_output=True, text=True, timeout=300
    )


def recorded_complete(out: Path) -> list[int]:
    return [s["stage"] for s in json.loads((out / "reshard.json").read_text())["stages"] if s["complete"]]


def flip_last_byte(path: Path) -> None:
    """Change a file's bytes in place: same size, same header, other data."""
    with open(path, "r+b") as f:
        last = os.pread(f.fileno(), 1, os.fstat(f.fileno()).st_size - 1)
        os.pwrite(f.fileno(), bytes([last[0] ^ 0x01]), os.fstat(f.fileno()).st_size - 1)


def assert_sequential(out: Path, model: Path, clean: Path) -> None:
    assert digests(out) == digests(clean)
    report = verify(out, model)
    assert report.ok, report.findings


def assert_the_same_command_finishes(out: Path, model: Path, clean: Path) -> None:
    """verify says of everything it finds to run the same command again; doing so exits 0 and
    leaves OUT as one sequential run writes it."""
    report = verify(out)
    assert report.findings and all(
        "run the same qwen35-reshard command again" in f.message for f in report.findings
    )
    again = cli(*split_args(model, out))
    assert again.returncode == 0, again.stderr
    assert_sequential(out, model, clean)


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory):
    return Path(tiny.build_checkpoint(tmp_path_factory.mktemp("model") / "model"))


@pytest.fixture(scope="module")
def clean(model, tmp_path_factory):
    """One sequential run: the bytes every concurrent scenario must end in."""
    out = tmp_path_factory.mktemp("clean") / "out"
    assert cli(*split_args(model, out)).returncode == 0
    return out


# --------------------------------------------------------------------------- ranks side by side


@pytest.mark.parametrize("moment", ["copying", "writing-outs-files"])
def test_a_rank_stopped_while_another_rank_runs_loses_nothing(model, clean, tmp_path, moment):
    """Rank 1 stops mid-copy, or as it writes OUT's own config.json; rank 2 runs meanwhile.
    Rank 2 must not take over, truncate or delete rank 1's temporary files (for OUT's own, it
    waits for OUT's lock), and reshard.json, whoever writes it last, records both stages (it
    was written from what rank 1 knew at its start)."""
    out = tmp_path / "out"
    where = "/pp1/.model-" if moment == "copying" else f"{out}/.config.json."
    a = Run(split_args(model, out, "--rank", "1"), tmp_path / "a", stop_at=where)
    a.wait_stopped()
    b = Run(split_args(model, out, "--rank", "2"), tmp_path / "b")
    b.wait_ended_or_waiting()
    assert a.resume() == 0, a.stderr.read_text()
    assert b.finish() == 0, b.stderr.read_text()
    assert recorded_complete(out) == [1, 2]
    assert verify(out).missing_stages == [0, 3]
    assert verify(out, ranks=[1, 2]).ok
    assert cli(*split_args(model, out, "--rank", "0", "--rank", "3")).returncode == 0
    assert_sequential(out, model, clean)


def test_two_runs_creating_out_at_once(model, clean, tmp_path):
    """Two runs find OUT missing and create it at the same moment: the second to mkdir finds
    it there, and goes on (it used to fail with "File exists")."""
    out = tmp_path / "out"
    a = Run(split_args(model, out, "--rank", "1"), tmp_path / "a", stop_at=str(out), event="os.mkdir")
    a.wait_stopped()
    b = Run(split_args(model, out, "--rank", "2"), tmp_path / "b")
    assert b.finish() == 0, b.stderr.read_text()
    assert a.resume() == 0, a.stderr.read_text()
    assert recorded_complete(out) == [1, 2]


def test_two_whole_runs_write_each_stage_once(model, clean, tmp_path):
    """The same command twice at once: the second waits for the stages the first is building
    (it used to write the same temporary files and delete the first one's), then finds them
    complete."""
    out = tmp_path / "out"
    # Stopped with the data files of pp0-pp2 open under their temporary names.
    a = Run(split_args(model, out), tmp_path / "a", stop_at="/pp3/.model-")
    a.wait_stopped()
    b = Run(split_args(model, out), tmp_path / "b")
    b.wait_ended_or_waiting()
    assert a.resume() == 0, a.stderr.read_text()
    assert b.finish() == 0, b.stderr.read_text()
    assert_sequential(out, model, clean)
    assert "waiting for it" in b.stderr.read_text()
    assert json.loads(b.stdout.read_text())["result"]["built"] == []
    assert json.loads(a.stdout.read_text())["result"]["built"] == list(range(PP))


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
def test_other_settings_are_refused_while_a_run_writes(model, clean, tmp_path, overwrite):
    """A run with other settings (pp 2) against an OUT another run is writing: one error line
    naming that run's host and pid, exit 2, even with --overwrite; the other run unharmed."""
    out = tmp_path / "out"
    a = Run(split_args(model, out), tmp_path / "a", stop_at="/pp1/.model-")
    a.wait_stopped()
    other = cli(*split_args(model, out, *(["--overwrite"] if overwrite else []), pp=2))
    assert other.returncode == 2, other.stderr
    line = one_error_line(other)
    assert f"host {socket.gethostname()}, pid {a.proc.pid}" in line and "other settings" in line, line
    assert a.resume() == 0, a.stderr.read_text()
    assert_sequential(out, model, clean)


def test_resume_rewrites_a_journaled_file_changed_since(model, clean, tmp_path):
    """A file the killed run finished and journaled, then written to in place (same size and
    header, other bytes: what two runs sharing a temporary name left): the resume must not
    keep it on its size and header, or the split it reports done has a tensor unlike its sha256."""
    out = tmp_path / "out"
    a = Run(split_args(model, out), tmp_path / "a", stop_at="/pp1/.reshard-stage.json.")
    a.wait_stopped()  # every data file of pp1 finished and journaled
    a.proc.kill()
    a.finish()
    flip_last_byte(sorted((out / "pp1").glob("*.safetensors"))[0])
    again = cli(*split_args(model, out))
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["result"]["files_kept"] >= 1  # the others are still kept
    assert_sequential(out, model, clean)


def test_repair_refuses_while_a_split_writes(model, clean, tmp_path):
    """``verify --repair`` while a split builds a stage of the same OUT: one error line naming
    the split, exit 2, the split unharmed; the repair run again afterwards mends OUT."""
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    shutil.rmtree(out / "pp2")
    flip_last_byte(sorted((out / "pp0").glob("*.safetensors"))[0])
    a = Run(split_args(model, out, "--rank", "2"), tmp_path / "a", stop_at="/pp2/.model-")
    a.wait_stopped()
    repair = cli("verify", out, "--source", model, "--repair")
    assert repair.returncode == 2, repair.stdout + repair.stderr
    line = one_error_line(repair)
    assert f"pid {a.proc.pid}" in line and "pp2" in line, line
    assert a.resume() == 0, a.stderr.read_text()
    again = cli("verify", out, "--source", model, "--repair")
    assert again.returncode == 0, again.stdout + again.stderr
    assert_sequential(out, model, clean)


def test_a_split_waits_for_a_repair(model, clean, tmp_path):
    """The other order: a repair stopped while it rewrites a file; a split of the same OUT
    waits for it, then finds its stage complete."""
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    flip_last_byte(sorted((out / "pp0").glob("*.safetensors"))[0])
    repair = Run(
        ["verify", str(out), "--source", str(model), "--repair"], tmp_path / "r", stop_at="/pp0/.model-"
    )
    repair.wait_stopped()
    b = Run(split_args(model, out, "--rank", "0"), tmp_path / "b")
    b.wait_ended_or_waiting()
    assert repair.resume() == 0, repair.stderr.read_text()
    assert b.finish() == 0, b.stderr.read_text()
    assert_sequential(out, model, clean)


def test_a_rank_killed_while_others_run_then_run_again(model, clean, tmp_path):
    """SIGKILL of one rank mid-copy leaves the others unaffected; verify explains what it left,
    each finding saying to run again, and running that rank again completes OUT."""
    out = tmp_path / "out"
    killed = Run(split_args(model, out, "--rank", "1"), tmp_path / "k", stop_at="/pp1/.model-")
    killed.wait_stopped()
    others = [Run(split_args(model, out, "--rank", str(r)), tmp_path / f"r{r}") for r in (0, 2, 3)]
    killed.proc.kill()
    assert killed.finish() == -signal.SIGKILL
    for r in others:
        assert r.finish() == 0, r.stderr.read_text()
    report = verify(out)
    assert not report.ok
    assert all("run the same qwen35-reshard command again" in f.message for f in report.findings), (
        report.findings
    )
    assert cli(*split_args(model, out, "--rank", "1")).returncode == 0
    assert_sequential(out, model, clean)


def test_a_stage_claimed_by_a_killed_run_of_this_host_is_taken_over_at_once(model, clean, tmp_path):
    """A run waiting for a stage another run of this host claimed takes it over as soon as that
    run is killed (its process is known to be gone), not after half a lease (issue 37: ~28 s)."""
    from qwen35_reshard.format.holder import LEASE_SECONDS

    out = tmp_path / "out"
    holder = Run(split_args(model, out, "--rank", "1"), tmp_path / "h", stop_at="/pp1/.model-")
    holder.wait_stopped()
    waiter = Run(split_args(model, out, "--rank", "1"), tmp_path / "w")
    waiter.wait_ended_or_waiting()
    assert waiter.proc.poll() is None, waiter.stderr.read_text()
    holder.proc.kill()
    killed = time.monotonic()
    assert holder.finish() == -signal.SIGKILL
    assert waiter.finish() == 0, waiter.stderr.read_text()
    took = time.monotonic() - killed
    print(f"stage 1 taken over and built {took:.1f} s after its holder was killed (lease {LEASE_SECONDS} s)")
    assert took < LEASE_SECONDS / 6, took
    assert digests(out / "pp1") == digests(clean / "pp1")


def test_a_run_killed_as_it_breaks_a_gone_runs_lock(model, clean, tmp_path):
    """A run killed holding OUT's lock; the next run killed as it breaks that lock, between
    moving it aside and removing it. What is left (``.reshard-lock.gone.HOST.PID.NONCE.partial``)
    is the tool's own: verify says to run again, and the same command completes OUT and removes
    it (it used to find OUT holding a file qwen35-reshard did not write, and never removed it)."""
    out = tmp_path / "out"
    a = Run(split_args(model, out), tmp_path / "a", stop_at="/.reshard-run.json.")  # under the lock
    a.wait_stopped()
    a.proc.kill()
    a.finish()
    b = Run(split_args(model, out), tmp_path / "b", stop_at="/.reshard-lock.gone.")
    b.wait_stopped()  # A's lock moved aside, about to be read back and removed
    b.proc.kill()
    b.finish()
    assert not (out / ".reshard-lock").exists()
    assert len(list(out.glob(".reshard-lock.gone.*.partial"))) == 1
    assert_the_same_command_finishes(out, model, clean)


@pytest.mark.parametrize(
    "where",
    ["/pp0/.reshard-claim$", "/.reshard-lock$#2"],
    ids=["before-giving-up-its-claims", "before-giving-up-the-lock"],
)
def test_what_a_run_killed_after_finishing_holds_is_removed_by_the_same_command(
    model, clean, tmp_path, where
):
    """A run stopped with every stage finished, as it gives up its claims (before recording the
    run), or OUT's lock (after). While it lives, verify fails on what it holds (a live holder
    may yet replace what is there). Once it is killed, what it held is a gone run's leftover:
    every stage with an index verifies OK (the CI flake of test_sigkill_at_many_moments: a kill
    in this window left a finished stage failing), OUT too once the run is recorded; the same
    command again removes the claims and the lock (it used to leave them)."""
    out = tmp_path / "out"
    a = Run(split_args(model, out), tmp_path / "a", stop_at=where)
    a.wait_stopped()
    held = [*out.glob("pp*/.reshard-claim"), *out.glob(".reshard-lock")]
    assert held
    for path in held:
        report = verify(path.parent)
        assert ("incomplete", path.name) in {(f.kind, f.file) for f in report.findings}, path
    a.proc.kill()
    a.finish()
    assert all(path.exists() for path in held)
    for stage in sorted(out.glob("pp*")):
        report = verify(stage)
        assert report.ok, report.findings
    recorded = not (out / ".reshard-run.json").exists()
    assert recorded == (where == "/.reshard-lock$#2")
    if recorded:
        assert verify(out).ok, verify(out).findings
        again = cli(*split_args(model, out))
        assert again.returncode == 0, again.stderr
        assert_sequential(out, model, clean)  # the lock is gone: clean has none
    else:
        assert {f.file for f in verify(out).findings} == {".reshard-run.json"}
        assert_the_same_command_finishes(out, model, clean)


def test_a_journal_left_in_a_finished_stage_is_removed_by_the_same_command(model, clean, tmp_path):
    """A repair killed as it rewrote a file of a finished stage leaves the stage's journal:
    verify says to run the same command again, and that removes it (it used to find the split
    complete and change nothing, verify failing for good)."""
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    (out / "pp2" / ".reshard-journal.jsonl").write_text('{"file": "x", "digests": {}}\n')
    assert_the_same_command_finishes(out, model, clean)


# Holds OUT's lock (argv[1]) as a live run does, heartbeat included, until killed.
_HOLD_LOCK = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from qwen35_reshard.write import claims\n"
    "assert claims.try_take(Path(sys.argv[1]) / '.reshard-lock') is None\n"
    "print('held', flush=True)\n"
    "time.sleep(600)\n"
)


def test_a_finished_split_does_not_wait_for_a_live_lock_holder_to_clear_leftovers(model, clean, tmp_path):
    """A finished split with a killed run's claim in it, while another live run holds OUT's
    lock (a long repair, say): the same command has nothing to do and says so at once; it
    does not wait for the lock only to clear the leftover (which a later run does)."""
    out = Path(shutil.copytree(clean, tmp_path / "out"))
    _foreign_claim(out / "pp1", age=1e6)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        again = subprocess.run(
            [sys.executable, "-m", "qwen35_reshard", *split_args(model, out)], capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["status"] == "nothing_to_do"
        assert "waiting for it" not in again.stderr
    finally:
        holder.kill()
        holder.wait()
    assert cli(*split_args(model, out)).returncode == 0  # the lock free again: the claim goes
    assert_sequential(out, model, clean)


def test_a_rank_finishing_beside_a_killed_one_keeps_the_run_marker(model, clean, tmp_path):
    """Rank 1 killed with its data files journaled; rank 0 finishes meanwhile; a source shard is
    then rewritten in place (same layout). Rank 1 run again must see that the source changed
    since the interrupted run began (the marker's stamps), not keep its journaled files: rank 0
    used to remove the marker, and rank 1 then kept files of the old bytes, exit 0."""
    src = Path(shutil.copytree(model, tmp_path / "model"))
    out = tmp_path / "out"
    a = Run(split_args(src, out, "--rank", "1"), tmp_path / "a", stop_at="/pp1/.reshard-stage.json.")
    a.wait_stopped()  # every data file of pp1 finished and journaled
    a.proc.kill()
    a.finish()
    assert cli(*split_args(src, out, "--rank", "0")).returncode == 0
    assert (out / ".reshard-run.json").exists()
    from qwen35_reshard import make_plan, read_checkpoint

    shard = make_plan(read_checkpoint(src), pp=PP).stages[1].source_files[0]
    flip_last_byte(src / shard)
    again = cli(*split_args(src, out, "--rank", "1"))
    assert again.returncode == 2, again.stderr
    line = one_error_line(again)
    assert "of other bytes" in line and "differs" in line and "--overwrite" in line, line


def test_a_run_that_cannot_start_gives_up_its_claims(model, clean, tmp_path):
    """A run that fails after claiming its stages (here: a file in the way of a stage it
    resumes) gives its claims up: the same call again in the same process fails the same
    way, rather than waiting for ever for the stage it claimed itself."""
    from qwen35_reshard import ReshardError, WriteOptions, reshard

    out = Path(shutil.copytree(clean, tmp_path / "out"))
    (out / "pp0" / "model.safetensors.index.json").unlink()
    data = sorted((out / "pp0").glob("*.safetensors"))[0]
    data.unlink()
    data.mkdir()
    for _ in range(2):
        with pytest.raises(ReshardError, match=data.name):
            reshard(model, out, pp=PP, write=WriteOptions(workers=1))
        assert not (out / "pp0" / CLAIM).exists()


def test_a_lock_moved_aside_is_removed_only_once_its_record_is_a_gone_runs(tmp_path):
    """A run breaking a gone run's lock moves it aside first and puts it back if it was a live
    run's that took it meanwhile (see claims.try_take): the holder of OUT's lock clearing
    temporaries must not remove that one, or the live run loses its lock."""
    from qwen35_reshard.write import claims
    from qwen35_reshard.write.outdir import clear_temporaries

    me = claims.me()
    dead = claims.Owner(me.host, me.machine, 2**22 + 1, "1", f"{me.host}.{2**22 + 1}.0badcafe")
    live_aside = tmp_path / ".reshard-lock.gone.node-b.17.0000beef.partial"
    dead_aside = tmp_path / ".reshard-lock.gone.node-c.18.0000cafe.partial"
    live_aside.write_bytes(me.to_bytes())
    dead_aside.write_bytes(dead.to_bytes())
    clear_temporaries(tmp_path, [], time.time_ns())
    assert live_aside.exists() and not dead_aside.exists()


@pytest.mark.parametrize(
    "name",
    [
        ".reshard-run.json",
        ".reshard-journal.jsonl",
        ".reshard-lock",
        ".reshard-claim",
        ".reshard-lock.gone",
        ".reshard-claim.gone",
        "reshard.json",
        "config.json",
        "model-00001-of-00002.safetensors",
    ],
)
def test_every_temporary_name_stands_for_its_file(name):
    """``partial_base`` undoes ``partial_name`` for every file the tool writes under a
    temporary name, with a process's token or without (as an earlier release wrote them)."""
    from qwen35_reshard.format.names import partial_base, partial_name, process_token

    assert partial_base(partial_name(name, process_token())) == name
    assert partial_base(partial_name(name)) == name
    assert partial_base(name) is None


def _foreign_claim(stage_dir: Path, age: float) -> Path:
    """A claim recorded by a run on another host, last refreshed ``age`` seconds ago."""
    from qwen35_reshard.write import claims

    stage_dir.mkdir(parents=True, exist_ok=True)
    path = stage_dir / CLAIM
    owner = claims.Owner("other-node", "other-node/boot/pid:[1]", 4242, "1", "other-node.4242.0badcafe")
    path.write_bytes(owner.to_bytes())
    past = time.time() - age
    os.utime(path, (past, past))
    return path


@pytest.mark.parametrize("refreshed", [True, False], ids=["live", "lease-ran-out"])
def test_a_claim_from_another_host_is_judged_by_its_lease(model, clean, tmp_path, refreshed):
    """Another host's run cannot be asked whether it lives: its claim is waited for while it is
    refreshed (until it is released), and taken over once it has not been for the lease."""
    from qwen35_reshard.write.claims import LEASE_SECONDS

    out = Path(shutil.copytree(clean, tmp_path / "out"))
    shutil.rmtree(out / "pp1")
    claim = _foreign_claim(out / "pp1", age=0 if refreshed else 2 * LEASE_SECONDS)
    b = Run(split_args(model, out, "--rank", "1"), tmp_path / "b")
    if refreshed:
        b.wait_ended_or_waiting()
        assert b.proc.poll() is None
        said = b.stderr.read_text()
        assert "pp1 is being built by another qwen35-reshard run (host other-node, pid 4242)" in said
        claim.unlink()  # that run finished (here: without building anything)
    assert b.finish() == 0, b.stderr.read_text()
    assert ("waiting for it" in b.stderr.read_text()) == refreshed
    assert_sequential(out, model, clean)


# --------------------------------------------------------------------------- stress


@pytest.mark.parametrize("procs, mode", [(4, "ranks"), (8, "ranks"), (2, "whole")])
def test_many_runs_started_together(model, clean, tmp_path, procs, mode):
    """``procs`` runs started together into one OUT (8 ranks: two runs per stage, as the nodes of
    one tensor-parallel group), two rounds: all exit 0, OUT as one sequential run writes it."""
    for r in range(2):
        out = tmp_path / f"out{r}"
        runs = [
            Run(
                split_args(model, out, *(["--rank", str(i % PP)] if mode == "ranks" else [])),
                tmp_path / f"{r}-{i}",
            )
            for i in range(procs)
        ]
        for run in runs:
            assert run.finish() == 0, run.stderr.read_text()
        assert_sequential(out, model, clean)
