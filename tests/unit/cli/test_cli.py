"""The command line as people and scripts meet it: commands and the old form, help, "did you
mean", what goes to stdout and what to stderr, quiet output, 80-column tables, plurals, and
what an interrupted plan says. Real processes where the stream split matters."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console

from qwen35_reshard.cli import main
from qwen35_reshard.cli.report import balance_table, plan_table
from qwen35_reshard.plan.balance import choose
from qwen35_reshard.plan.planner import make_plan
from qwen35_reshard.units import plural

from support.helpers import ROOT, tree

SIZE = re.compile(r"^[0-9]+(\.[0-9][0-9])? (B|KB|MB|GB|TB)$")


def cli(*args, env=None) -> subprocess.CompletedProcess:
    """``python -m qwen35_reshard`` in a subprocess (stdout not a terminal, as in ``> file``)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    cmd = [sys.executable, "-m", "qwen35_reshard", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)


def run_main(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def model(tiny, tmp_path_factory):
    return Path(tiny.build_checkpoint(tmp_path_factory.mktemp("cli") / "model"))


# --------------------------------------------------------------------------- commands


@pytest.mark.slow  # real processes
def test_old_form_and_split_form_are_the_same_job(model, tmp_path):
    """``qwen35-reshard --pp N MODEL OUT`` (the form CI scripts use) and ``split``: the same
    files byte for byte, the same output but for the timing, the same exit codes."""
    old, new = cli("--pp", 2, model, tmp_path / "old"), cli("split", "--pp", 2, model, tmp_path / "new")
    assert old.returncode == new.returncode == 0, old.stderr + new.stderr
    assert tree(tmp_path / "old") == tree(tmp_path / "new")

    def untimed(text: str, out: str) -> str:
        text = text.replace(str(tmp_path / out), "OUT")
        return re.sub(r"in [0-9.]+ s: (.*) stage files, [0-9.]+ [KMGT]?B/s", r"in T s: \1 stage files", text)

    assert untimed(old.stdout, "old") == untimed(new.stdout, "new")
    assert "SGLANG_PP_LAYER_PARTITION=4,4" in old.stdout
    # Dry runs and bad input alike.
    dry = [cli(*form, "--pp", 3, "--dry-run", model, tmp_path / "dry") for form in ([], ["split"])]
    assert dry[0].returncode == dry[1].returncode == 0 and dry[0].stdout == dry[1].stdout
    refused = [cli(*form, "--pp", 3, "--dry-run", model, tmp_path / "old") for form in ([], ["split"])]
    assert refused[0].returncode == refused[1].returncode == 2 and refused[0].stderr == refused[1].stderr
    bad = [cli(*form, "--pp", 0, model, tmp_path / "x") for form in ([], ["split"])]
    assert bad[0].returncode == bad[1].returncode == 2 and bad[0].stderr == bad[1].stderr


def test_misspelt_option_and_command_get_a_did_you_mean(capsys, model, tmp_path):
    code, out, err = run_main(capsys, "--pp", 2, "--partiton", "4,4", model, tmp_path / "o")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: No such option: --partiton. Did you mean --partition?")
    for typo, meant in (("splt", "split"), ("verfy", "verify"), ("plna", "plan")):
        code, out, err = run_main(capsys, typo, "--pp", 2, model)
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"error: No such command '{typo}'. Did you mean '{meant}'?"), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", ["split", "plan", "verify", None])
def test_help_lists_options_with_defaults_and_ends_with_examples(capsys, command):
    code, out, err = run_main(capsys, *([command] if command else []), "--help")
    assert code == 0 and err == ""
    head, examples = out.split("Examples:")
    lines = [line.strip() for line in examples.strip().splitlines()]
    assert len(lines) >= 4 and all("qwen35-reshard" in line for line in lines if not line.startswith("--"))
    # Copyable as is: a model is an org/name Hub id (a bare "Qwen3.5-35B-A3B" is neither that
    # nor a directory that exists).
    assert not re.search(r"(?<![/\w.-])Qwen3\.5-", examples), examples
    if command is None:
        assert all(c in head for c in ("split", "plan", "verify", "--install-completion", "--version"))
        return
    assert all(command in line or "--pp 4 Qwen" in line for line in lines if line.startswith("qwen35"))
    options = re.findall(r"^  (?:-\w, )?(--[a-z-]+)", head, re.M)
    assert {"--json", "--debug", "--version", "--help"} <= set(options)
    if command != "verify":
        assert {"--pp", "--max-file-size", "--quiet", "--partition", "--rank"} <= set(options)
        flat = " ".join(head.split())
        assert "[default: sglang]" in flat and "[default: 5GiB]" in flat
    if command == "split":
        assert "[default: 2]" in " ".join(head.split())  # --workers


def test_version_and_completion(capsys):
    from qwen35_reshard import __version__

    for args in (["--version"], ["split", "--version"], ["verify", "--version"]):
        assert run_main(capsys, *args) == (0, f"qwen35-reshard {__version__}\n", "")
    p = cli("--show-completion", env={"SHELL": "/bin/bash"})
    assert p.returncode == 0 and "_QWEN35_RESHARD_COMPLETE" in p.stdout, p.stderr


def test_usage_errors_are_one_line_and_json_errors_carry_the_bare_message(capsys, model):
    code, out, err = run_main(capsys, "--pp", "x", "--json", model, "o")
    assert code == 2 and err.count("\n") == 1 and "--pp" in err and "Usage:" not in err
    assert json.loads(out) == {"status": "error", "error": err.strip().removeprefix("error: ")}
    code, out, err = run_main(capsys, "plan", "--pp", 99, "--json", model)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "--pp" in err
    assert json.loads(out) == {"status": "error", "error": err.strip().removeprefix("error: ")}


# --------------------------------------------------------------------------- stdout and stderr


def test_results_on_stdout_progress_on_stderr(model, tmp_path):
    p = cli("split", "--pp", 2, model, tmp_path / "out")
    assert p.returncode == 0, p.stderr
    assert "stage" in p.stdout and "pp1" in p.stdout  # the table
    assert "wrote pp0, pp1" in p.stdout and "SGLANG_PP_LAYER_PARTITION=4,4" in p.stdout
    assert "SGLANG_PP_LAYER_PARTITION" not in p.stderr and "wrote" not in p.stderr
    assert "source bytes" in p.stderr and "done pp1" in p.stderr  # progress
    # --json: only JSON on stdout, the human output on stderr.
    j = cli("split", "--pp", 2, "--json", model, tmp_path / "out")
    assert json.loads(j.stdout)["status"] == "nothing_to_do"
    assert "nothing to do" in j.stderr and "SGLANG_PP_LAYER_PARTITION=4,4" in j.stderr


@pytest.mark.slow  # real processes
def test_plan_to_a_file_and_quiet_launch_line(model, tmp_path):
    with open(tmp_path / "plan.txt", "w") as f:
        p = subprocess.run(
            [sys.executable, "-m", "qwen35_reshard", "plan", "--pp", "2", str(model)],
            stdout=f,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    assert p.returncode == 0 and p.stderr == ""
    text = (tmp_path / "plan.txt").read_text()
    assert re.search(r"^pp0 ", text, re.M) and re.search(r"^pp1 ", text, re.M)
    assert "dry run: nothing written. Launch with SGLANG_PP_LAYER_PARTITION=4,4\n" in text
    # $(... -q) captures exactly the launch line, for plan and for split (fresh and finished).
    launch = "SGLANG_PP_LAYER_PARTITION=4,4\n"
    for args in (
        ["plan", "-q", "--pp", 2, model],
        ["split", "-q", "--pp", 2, model, tmp_path / "out"],
        ["split", "-q", "--pp", 2, model, tmp_path / "out"],  # nothing to do
        ["-q", "--pp", 2, model, tmp_path / "o2"],
    ):
        q = cli(*args)
        assert (q.returncode, q.stdout, q.stderr) == (0, launch, ""), args


def test_verify_report_on_stdout_and_quiet_prints_only_problems(model, tmp_path):
    out = tmp_path / "out"
    assert cli("--pp", 2, model, out).returncode == 0
    ok = cli("verify", out)
    assert ok.returncode == 0 and ok.stderr == ""
    assert ok.stdout.splitlines()[-1] == f"verify OK: {out}, 2 stages"
    # Each stage's size is the one plan's table gives it (not its tensor bytes alone).
    planned = re.findall(r"^(pp[01]) .* ([0-9.]+ [KM]B) ", cli("plan", "--pp", 2, model).stdout, re.M)
    stage_line = r"/(pp[01]): ok \([0-9]+ tensors in [0-9]+ files?, ([0-9.]+ [KM]B)\)$"
    verified = re.findall(stage_line, ok.stdout, re.M)
    assert len(planned) == 2 and verified == planned, (planned, ok.stdout)
    assert cli("verify", "-q", out).stdout == ""
    data = sorted((out / "pp1").glob("model-*.safetensors"))[0]
    with open(data, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    bad = cli("verify", "-q", out)
    assert bad.returncode == 1 and bad.stderr == ""
    lines = bad.stdout.splitlines()
    assert not any(": ok (" in line for line in lines) and lines[0].startswith(f"{out}/pp1: 1 problem (")
    assert any(data.name in line for line in lines[1:]) and lines[-2].startswith("verify FAILED")
    # Against the source the one damaged byte is still one problem...
    against = cli("verify", out, "--source", model)
    assert against.returncode == 1
    assert f"verify FAILED: {out} against {model}: 1 problem: 1 different" in against.stdout
    # ... and a repair that ends OK prints what it found and mended, never "FAILED".
    repair = cli("verify", out, "--source", model, "--repair")
    assert repair.returncode == 0, repair.stderr
    assert "FAILED" not in repair.stdout and "found 1 problem: 1 different" in repair.stdout
    assert f"repaired: {data}" in repair.stdout and repair.stdout.splitlines()[-1].startswith("verify OK")


# --------------------------------------------------------------------------- what the output reads


@pytest.mark.slow  # the 397B-shaped checkpoint (~189,000 tensors)
def test_plan_and_balanced_tables_read_right_at_80_columns(fixture_397b):
    """pp=16 on the 397B shape, on an 80-column console: no line wider, every size whole on its
    stage's row (never `983.41` / `MB`), role names intact."""
    ckpt, _ = fixture_397b
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    plan = make_plan(ckpt, pp=16, runtime="sglang", ranks=[3])
    console.print(plan_table(plan))
    console.print(balance_table(choose(ckpt, pp=16, runtime="sglang"), "sglang"))
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    assert len([line for line in lines if re.match(r"pp[0-9]+\*? ", line)]) == 32  # both tables
    row = re.compile(
        r"(pp[0-9]+) +([0-9]+-[0-9]+ \([0-9]+\)) +([0-9]+) +([0-9.]+ [KMGT]?B) +([0-9]+) +([0-9]+/82) +"
        r"(.+?) +(yes|no) *"
    )
    rows = [m.groups() for line in lines if (m := row.fullmatch(line))]
    assert [r[0] for r in rows] == [f"pp{r}" for r in range(16)], lines
    assert all(SIZE.match(r[3]) for r in rows) and [r[-1] for r in rows] == ["no"] * 3 + ["yes"] + ["no"] * 12
    # Roles wrapped onto a second line stay whole words.
    roles = {"embed", "visual", "visual.pos_embed", "norm", "lm_head", "mtp"}
    also = " ".join([r[6] for r in rows] + [line.strip() for line in lines if line.startswith(" " * 40)])
    assert set(re.findall(r"[a-z_.]+", also)) == roles


def test_plurals(model, tmp_path):
    assert [plural(n, "file") for n in (0, 1, 2)] == ["0 files", "1 file", "2 files"]
    one = cli("plan", "--pp", 2, "--partition", 8, model)
    assert one.returncode == 2 and "--partition 8 has 1 entry but --pp is 2" in one.stderr, one.stderr
    out = tmp_path / "out"
    p = cli("--pp", 2, "--rank", 1, "--no-mtp", model, out)
    assert p.returncode == 0 and "(s)" not in p.stdout + p.stderr
    v = cli("verify", out / "pp1")
    assert v.stdout.splitlines()[-1] == f"verify OK: {out / 'pp1'}, 1 stage" and "(s)" not in v.stdout


@pytest.mark.slow  # the 397B-shaped checkpoint (~189,000 tensors)
def test_an_interrupted_plan_says_it_wrote_nothing(capsys, fixture_397b, tmp_path):
    """SIGINT while the 397B shape is planned (in this process: the command installs its own
    handler, then puts the previous one back)."""
    ckpt, _ = fixture_397b
    before = signal.getsignal(signal.SIGINT)
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    try:
        args = ("plan", "--pp=16", "--partition=balanced", ckpt.root, tmp_path / "o")
        code, out, err = run_main(capsys, *args)
    finally:
        timer.cancel()
    assert code == 130, err
    assert err == "interrupted: nothing was written\n" and out == ""
    assert not (tmp_path / "o").exists() and signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize(
    ("closed", "args", "code"),
    [(1, ["--version"], 0), (2, ["split", "/nonexistent-model", "/nonexistent-out"], 2), (1, ["plan"], 2)],
)
def test_a_closed_stdout_or_stderr_keeps_the_exit_code(closed, args, code):
    """The command started with stdout or stderr closed (Python sets it to None) ends with the
    code it would have had, without a traceback."""
    p = subprocess.run(
        [sys.executable, "-m", "qwen35_reshard", *args],
        preexec_fn=lambda: os.close(closed),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == code, (p.stdout, p.stderr)
    assert "Traceback" not in p.stdout + p.stderr


@pytest.mark.slow  # real processes
def test_model_may_name_the_file_of_a_single_file_checkpoint(tiny, tmp_path):
    """MODEL naming a checkpoint's one ``model.safetensors`` (as the README allows) is that
    checkpoint's directory: the same split byte for byte, verified against either spelling.
    A shard of an indexed checkpoint, or a lone file of another name, is one line saying what
    to pass. Before: every file was refused as "not a directory"."""
    model = Path(tiny.build_checkpoint(tmp_path / "single", single_file=True))
    file = model / "model.safetensors"
    by_file, by_dir = cli("--pp", 2, file, tmp_path / "a"), cli("--pp", 2, model, tmp_path / "b")
    assert by_file.returncode == by_dir.returncode == 0, by_file.stderr + by_dir.stderr
    assert tree(tmp_path / "a") == tree(tmp_path / "b")
    v = cli("verify", tmp_path / "a", "--source", file)
    assert v.returncode == 0 and v.stdout.splitlines()[-1].startswith("verify OK"), v.stdout + v.stderr

    sharded = Path(tiny.build_checkpoint(tmp_path / "sharded"))
    shard = sorted(sharded.glob("*.safetensors"))[0]
    (tmp_path / "lone").mkdir()
    lone = tmp_path / "lone" / "weights.safetensors"
    lone.write_bytes(file.read_bytes())
    (tmp_path / "lone" / "config.json").write_bytes((model / "config.json").read_bytes())
    for path, says in ((shard, f"one shard of the checkpoint in {sharded}"), (lone, "rename the file")):
        p = cli("plan", "--pp", 2, path)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1 and p.stderr.startswith(f"error: {path}: ") and says in p.stderr


def test_pp_is_one_with_ep_alone_and_needed_without_it(capsys, model):
    """`--ep E --nodes N` alone is one pipeline stage (OUT/node{k}); without --ep, --pp is the split's
    size and has no default: one line naming it."""
    code, out, err = run_main(capsys, "plan", "--ep", 4, "--nodes", 2, model, "--json")
    assert code == 0, err
    assert [s["dir"] for s in json.loads(out)["stages"]] == ["node0", "node1"]
    code, out, err = run_main(capsys, "plan", model)
    assert code == 2 and err.strip() == "error: --pp is needed: the number of pipeline stages, e.g. --pp 4"
