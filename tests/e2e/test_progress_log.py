"""Progress where stderr is a log (a CI job's pipe), read line by line as a real run writes it,
the run held at a chosen point: lines arrive as things happen, whole, never padded; in a
terminal (a pseudo-terminal here) the rich bar as before."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time

from qwen35_reshard import reshard
from qwen35_reshard.cli.progress import LOG_INTERVAL_ENV
from qwen35_reshard.format.names import INDEX_NAME, RUN_MANIFEST, RUN_MARKER

# Runs the CLI (argv[3:]) holding the copy of any of the source shards argv[1] (comma-separated;
# their open by a copying worker, not the planner's header read in the main thread) until the
# file argv[2] exists.
_HOLD_SHARD = (
    "import os, runpy, sys, threading, time\n"
    "shards, gate = tuple(sys.argv[1].split(',')), sys.argv[2]\n"
    "def hook(name, args):\n"
    "    if name == 'open' and args and str(args[0]).endswith(shards)\\\n"
    "            and threading.current_thread() is not threading.main_thread():\n"
    "        while not os.path.exists(gate):\n"
    "            time.sleep(0.01)\n"
    "sys.addaudithook(hook)\n"
    "sys.argv = ['qwen35_reshard', *sys.argv[3:]]\n"
    "runpy.run_module('qwen35_reshard', run_name='__main__')\n"
)

PROGRESS = re.compile(
    r"progress: [\d.]+ (?:B|KB|MB|GB) of [\d.]+ (?:B|KB|MB|GB) \(\d+%\), [\d.]+ (?:B|KB|MB|GB)/s, "
    r"(?:\d+:\d\d:\d\d left|time left unknown), \d+:\d\d:\d\d elapsed"
)


def _lines(stream) -> queue.Queue:
    """Each line of ``stream`` as it arrives, with the time it arrived; None at the end."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for raw in stream:
            lines.put((time.monotonic(), raw.decode()))
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def test_piped_progress_arrives_as_the_copy_goes(make_checkpoint, tmp_path):
    """The copy held at the first shard pp0 does not need: pp0's data is copied by then (the
    shards it needs go first, the vision tower's too, which every stage holds), and said; and
    pp0 is complete and said done, while OUT does not look complete."""
    model = make_checkpoint()
    plan = reshard(model, None, pp=4, dry_run=True).plan
    first = set(plan.stages[0].source_files)
    held = sorted(set(plan.checkpoint.files) - first)
    early = [s.dirname for s in plan.stages if set(s.source_files) <= first]
    late = [s.dirname for s in plan.stages if not set(s.source_files) <= first]
    assert held and early and late, "the checkpoint must have stages before and after the held shards"
    gate = tmp_path / "gate"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD_SHARD, ",".join(held), str(gate), "--pp", "4", "--workers", "1",
         str(model), str(tmp_path / "out")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, LOG_INTERVAL_ENV: "0.05"},
    )  # fmt: skip
    lines = _lines(proc.stderr)
    try:
        held_lines, rest = _read_held_then_released(proc, lines, gate, early, late, tmp_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = held_lines + rest
    for d in late:
        assert any(x.startswith(f"copied {d}: ") for x in rest)
    done = [x.split(":")[0].removeprefix("done ") for x in log if x.startswith("done ")]
    assert sorted(done) == [s.dirname for s in plan.stages] and done[: len(early)] == early, done
    last_progress = [x for x in rest if x.startswith("progress: ")][-1]
    assert "(100%)" in last_progress
    for x in log:  # whole lines: no padding, no control sequences, each one thing
        assert x.endswith("\n") and x.rstrip("\n") == x.rstrip(), repr(x)
        assert "\x1b" not in x and "\r" not in x, repr(x)
        assert x.startswith(("copying ", "copied ", "progress: ", "done ")), repr(x)


def _read_held_then_released(proc, lines, gate, early, late, tmp_path):
    """The lines said while the copy is held, then (the gate opened) the rest."""
    held_lines: list[str] = []
    deadline = time.monotonic() + 60
    try:
        # While the copy is held: each early stage's data copied and the stage done, and
        # progress lines at the interval, all already out; no late stage copied or done.
        while sum(bool(PROGRESS.fullmatch(x.rstrip("\n"))) for x in held_lines) < 3 or not all(
            any(x.startswith(f"done {d}:") for x in held_lines) for d in early
        ):
            assert time.monotonic() < deadline, "".join(held_lines[-20:])
            item = lines.get(timeout=60)
            assert item is not None, "".join(held_lines)
            held_lines.append(item[1])
        assert proc.poll() is None
        for d in early:
            assert any(x.startswith(f"copied {d}: ") for x in held_lines)
        late_said = (*(f"copied {d}:" for d in late), *(f"done {d}:" for d in late))
        assert not any(x.startswith(late_said) for x in held_lines)
        out = tmp_path / "out"
        for d in early:  # complete on disk, its index (written last) in place
            assert (out / d / INDEX_NAME).exists()
        for d in late:
            assert not (out / d / INDEX_NAME).exists()
        # OUT does not look complete: the run marker there, no run manifest
        assert (out / RUN_MARKER).exists() and not (out / RUN_MANIFEST).exists()
        for x in held_lines:
            if x.startswith("progress: "):
                assert "(100%)" not in x, x
    finally:
        gate.touch()
    rest = []
    while (item := lines.get(timeout=60)) is not None:
        rest.append(item[1])
    assert proc.wait(timeout=60) == 0, "".join(held_lines + rest)
    return held_lines, rest


def test_terminal_keeps_the_bar(make_checkpoint, tmp_path):
    """stderr a terminal: the rich bar (its drawn characters), and the done lines."""
    model = make_checkpoint()
    leader, follower = os.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qwen35_reshard", "--pp", "2", str(model), str(tmp_path / "out")],
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env={**os.environ, "COLUMNS": "100", "TERM": "xterm"},
    )
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the last writer closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    text = seen.decode()
    assert "source bytes" in text and "━" in text and "done" in text and "pp1" in text
    assert "progress: " not in text and "copied pp" not in text


def test_results_in_a_file_are_neither_padded_nor_wrapped(make_checkpoint, tmp_path):
    """stdout and stderr piped (the plan table, the summary, the launch line; with --json the
    human output on stderr): no line ends in padding, and each launch command is one line."""
    model = make_checkpoint()
    for extra, human in (((), "stdout"), (("--json",), "stderr")):
        out = tmp_path / f"out{len(extra)}"
        p = subprocess.run(
            [sys.executable, "-m", "qwen35_reshard", "--pp", "4", *extra, str(model), str(out)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
        for text in (p.stdout, p.stderr):
            assert all(line == line.rstrip() for line in text.splitlines()), text
        launch = [x for x in getattr(p, human).splitlines() if "sglang.launch_server" in x]
        # One machine, then one stage per node: each whole on its line.
        assert len(launch) == 2 and launch[0].endswith(f"--model-path {out} --pp-size 4"), launch
        assert launch[1].endswith("--dist-init-addr HEAD_IP:PORT"), launch
        assert "pp0 " in getattr(p, human) and "wrote pp0, pp1, pp2, pp3" in getattr(p, human)
