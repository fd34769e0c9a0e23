"""No traceback without --debug, wherever the command is stopped or its output goes (issue 23).

Real processes throughout: Ctrl-C delivered at chosen imports of the start-up (an audit hook in
a ``sitecustomize`` the test puts first on ``PYTHONPATH`` sends the process SIGINT when the
chosen module starts loading, so the point is the same on every run), stdout on a full device
(``/dev/full``) or a pipe whose reader is gone, launch lines read back by bash, and the names
of the files a run renames into place.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from support.helpers import ROOT

# Real processes interrupted at chosen moments of their start-up and output.
pytestmark = pytest.mark.slow

# The console script pip generates for ``qwen35-reshard = "qwen35_reshard.cli:main"``.
CONSOLE_SCRIPT = "import sys; from qwen35_reshard.cli import main; sys.exit(main())"
ENTRIES = {"python -m": ["-m", "qwen35_reshard"], "console script": ["-c", CONSOLE_SCRIPT]}

# Loaded first by the interpreter (site), before any of the tool's code: counts the modules the
# process loads from the first one that is neither one of the entry's own tiny modules nor the
# standard library (typer, or the CLI's implementation: what the entry's handler must cover),
# and at the one numbered T_INTERRUPT_AT sends itself SIGINT (handled at the next bytecode,
# inside that import). With T_COUNT_TO set, keeps the count there instead (written as it goes:
# the command ends with os._exit, no atexit).
HOOK = """
import os, signal, sys
_at, _count_to, _fired = (os.environ.get(k) for k in ("T_INTERRUPT_AT", "T_COUNT_TO", "T_FIRED"))
_TINY = {"qwen35_reshard", "qwen35_reshard.__main__", "qwen35_reshard.cli", "qwen35_reshard._version",
         "qwen35_reshard.errors"}
_seen = []
def _hook(event, args):
    if event != "import":
        return
    name = args[0]
    if not _seen and (name in _TINY or name.split(".")[0] in sys.stdlib_module_names):
        return
    _seen.append(name)
    if _count_to is not None:
        with open(_count_to, "w") as f:
            f.write(str(len(_seen)))
    if _at is not None and len(_seen) == int(_at):
        with open(_fired, "w") as f:
            f.write(name)
        os.kill(os.getpid(), signal.SIGINT)
if _at is not None or _count_to is not None:
    sys.addaudithook(_hook)
"""


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory):
    return Path(tiny.build_checkpoint(tmp_path_factory.mktemp("robust") / "model"))


@pytest.fixture(scope="module")
def hook_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hook")
    (d / "sitecustomize.py").write_text(HOOK)
    return d


def tool(entry, *args, env=None, **kwargs) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, *ENTRIES[entry], *map(str, args)]
    if "stdout" not in kwargs:
        kwargs["capture_output"] = True
    return subprocess.run(cmd, text=True, timeout=120, env=full_env, **kwargs)


# --------------------------------------------------------------------------- Ctrl-C at start-up


def _start_up_imports(entry, hook_dir, model, tmp_path) -> int:
    count = tmp_path / f"count-{entry.split()[0]}"
    env = {"PYTHONPATH": f"{hook_dir}{os.pathsep}{ROOT}", "T_COUNT_TO": str(count)}
    p = tool(entry, "plan", "--pp", 2, model, env=env)
    assert p.returncode == 0, p.stderr
    return int(count.read_text())


@pytest.mark.parametrize("entry", ENTRIES)
def test_ctrl_c_at_any_import_of_the_start_up_is_one_line(entry, hook_dir, model, tmp_path):
    """SIGINT while the command's modules load (typer, rich, the library: the first ~0.25 s)
    says ``interrupted: nothing was written``, exit 130, as later; before, a raw
    KeyboardInterrupt traceback. Points spread over every module the process loads from the
    first that is not the entry's own: what comes before is the interpreter's start and the
    tiny ``qwen35_reshard``, ``qwen35_reshard.cli`` (standard library, ``_version`` and
    ``errors`` only), whose handler is installed as the first line of ``cli.main``."""
    total = _start_up_imports(entry, hook_dir, model, tmp_path)
    assert total > 20  # the hook sees the start-up (typer, rich, the library)
    points = sorted({1, 2, *(max(1, total * k // 4) for k in range(1, 4)), total})
    fired = tmp_path / "fired"
    for at in points:
        fired.unlink(missing_ok=True)
        env = {
            "PYTHONPATH": f"{hook_dir}{os.pathsep}{ROOT}",
            "T_INTERRUPT_AT": str(at),
            "T_FIRED": str(fired),
        }
        p = tool(entry, "plan", "--pp", 2, model, env=env)
        where = f"SIGINT at import {at} of {total} ({fired.read_text() if fired.exists() else 'never sent'})"
        assert fired.exists(), where
        assert p.returncode == 130, (where, p.stderr)
        assert p.stderr == "interrupted: nothing was written\n", (where, p.stderr)
        assert p.stdout == "", where


# --------------------------------------------------------------------------- where stdout goes


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full on this system")
@pytest.mark.parametrize("command", ["plan", "split", "verify", "plan --json"])
def test_results_to_a_full_device_are_one_error_line(command, model, tmp_path):
    """``> /dev/full``: one ``error:`` line naming stdout and the cause, exit 2; before, an
    OSError traceback from rich."""
    out = tmp_path / "out"
    if command == "verify":
        assert tool("python -m", "--pp", 2, model, out).returncode == 0
        args = ["verify", out]
    else:
        words = command.split()
        args = [*words, "--pp", 2, model] + ([out] if words[0] == "split" else [])
    with open("/dev/full", "w") as full:
        p = tool("python -m", *args, stdout=full, stderr=subprocess.PIPE)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    assert "stdout" in lines[-1] and "No space left on device" in lines[-1], lines[-1]


@pytest.mark.parametrize("command", ["plan", "verify", "plan --json", "--version"])
def test_a_reader_that_went_away_ends_it_quietly_as_git_log(command, model, tmp_path):
    """``| head -1`` with the reader gone before the results are written: the process ends
    as ``git log | head`` does, by SIGPIPE (status 141 in the shell), with nothing on stderr;
    before, exit 1. The reader's end is closed before the command starts, so every write
    fails: no race with how much of the output a pipe buffer takes."""
    if command == "verify":
        out = tmp_path / "out"
        assert tool("python -m", "--pp", 2, model, out).returncode == 0
        args = ["verify", out]
    elif command == "--version":
        args = ["--version"]
    else:
        args = [*command.split(), "--pp", 2, model]
    r, w = os.pipe()
    os.close(r)
    try:
        p = tool("python -m", *args, stdout=w, stderr=subprocess.PIPE)
    finally:
        os.close(w)
    assert p.returncode == -signal.SIGPIPE, (p.returncode, p.stderr)
    if "--json" in command:  # the human output goes to stderr beside --json, and nothing else
        assert "Traceback" not in p.stderr and "error" not in p.stderr, p.stderr
    else:
        assert p.stderr == ""


# --------------------------------------------------------------------------- what it prints


@pytest.mark.parametrize("runtime", ["sglang", "vllm"])
def test_launch_lines_quote_the_paths(runtime, model, tmp_path):
    """Every printed launch line, run through bash with ``R=1``, names OUT or the stage
    directory as one word, whatever OUT holds (a space, a non-ASCII letter, a ``$``); before, the path was
    printed bare and the shell split and expanded it."""
    out = tmp_path / "out dir ü" / "x$y 'q'"
    out.parent.mkdir()
    p = tool("python -m", "--pp", 2, "--runtime", runtime, model, out)
    assert p.returncode == 0, p.stderr
    launch = [
        line.strip() for line in p.stdout.splitlines() if "--model-path" in line or "vllm serve" in line
    ]
    assert launch, p.stdout
    for line in launch:
        words = subprocess.run(
            ["bash", "-c", f"R=1; printf '%s\\0' {line}"], capture_output=True, text=True, check=True
        ).stdout.split("\0")
        # SGLang's node R: its stage directory; else OUT itself (the plugin, the load format).
        stage = "--model-path" in line and "--node-rank" in line
        assert str(out / "pp1" if stage else out) in words, (line, words)


def test_files_renamed_into_place_have_one_leading_dot(model, tmp_path, hook_dir):
    """The temporary of every file a split renames into place is ``.NAME.TOKEN.partial``: the run
    marker's was ``..reshard-run.json.partial``. Seen through the ``os.rename`` audit event of
    a real run."""
    renames = tmp_path / "renames.jsonl"
    (tmp_path / "hook2").mkdir()
    (tmp_path / "hook2" / "sitecustomize.py").write_text(
        "import json, os, sys\n"
        "def _hook(event, args):\n"
        "    if event == 'os.rename':\n"
        f"        with open({str(renames)!r}, 'a') as f:\n"
        "            f.write(json.dumps([os.fspath(args[0]), os.fspath(args[1])]) + '\\n')\n"
        "sys.addaudithook(_hook)\n"
    )
    out = tmp_path / "out"
    p = tool(
        "python -m", "--pp", 2, model, out, env={"PYTHONPATH": f"{tmp_path / 'hook2'}{os.pathsep}{ROOT}"}
    )
    assert p.returncode == 0, p.stderr
    moves = [json.loads(line) for line in renames.read_text().splitlines()]
    pairs = [(Path(a).name, Path(b).name) for a, b in moves if str(out) in b]
    # .NAME.HOST.PID.NONCE.partial: the writing process's own (see write/claims.py)
    marker = ".reshard-run.json"
    assert any(final == marker and tmp.startswith(f"{marker}.") for tmp, final in pairs), pairs
    for tmp, final in pairs:
        assert tmp.startswith(f".{final.lstrip('.')}.") and tmp.endswith(".partial"), (tmp, final)


def test_the_marker_temporary_an_earlier_version_left_is_still_the_tools_own(model, tmp_path):
    """A run of an earlier version killed before renaming its marker left
    ``..reshard-run.json.partial``: OUT is not foreign for it, and the split removes it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "..reshard-run.json.partial").write_text("{")
    p = tool("python -m", "--pp", 2, model, out)
    assert p.returncode == 0, p.stderr
    assert not (out / "..reshard-run.json.partial").exists()
