"""The one orchestrator, ``qwen35_reshard.reshard``: everything ``split`` takes, as a library call
that returns what the CLI shows, with errors in the library's own parameter names."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import subprocess
import sys

import pytest

import qwen35_reshard
from qwen35_reshard import ReshardError, ReshardProgress, choose, read_checkpoint, reshard
from qwen35_reshard.cli import main
from qwen35_reshard.plan.capacity import Capacity, capacity_from
from qwen35_reshard.verify import verify
from qwen35_reshard.write.options import WriteOptions

from support.helpers import ROOT
from support.hub_server import HubServer


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint()


def test_balanced_partition_as_a_library_call(model, tmp_path):
    # The call the issue reports failing ("partition='b,a,l,a,n,c,e,d' has 8 entries").
    result = reshard(model, tmp_path / "out", pp=3, partition="balanced")
    expected = choose(read_checkpoint(model), pp=3, runtime="sglang").partition
    assert result.choice is not None and result.choice.partition == expected
    assert result.plan.partition == expected != result.choice.default
    assert result.written.built == [0, 1, 2] and result.complete == [0, 1, 2]
    assert result.launch_env == f"SGLANG_PP_LAYER_PARTITION={','.join(map(str, expected))}"
    assert result.bytes_copied == result.written.bytes_copied > 0
    assert verify(tmp_path / "out", source=model).ok


def test_partition_as_text_or_list(model, tmp_path):
    text = reshard(model, None, pp=3, partition="4,2,2", dry_run=True)
    listed = reshard(model, None, pp=3, partition=[4, 2, 2], dry_run=True)
    assert text.plan.partition == listed.plan.partition == (4, 2, 2)
    assert text.choice is None and text.out_state is None and text.written is None


def test_dry_run_says_what_a_run_would_do_and_writes_nothing(model, tmp_path):
    out = tmp_path / "out"
    first = reshard(model, out, pp=2, dry_run=True)
    assert first.dry_run and first.out_state.action == "new" and not out.exists()
    reshard(model, out, pp=2)
    again = reshard(model, out, pp=2, dry_run=True)
    assert again.out_state.action == "complete" and again.complete == [0, 1]
    with pytest.raises(ReshardError, match=r"overwrite"):  # another split: refused, as a run is
        reshard(model, out, pp=4, dry_run=True)


def test_the_result_is_the_cli_json(model, tmp_path):
    out = tmp_path / "out"
    result = reshard(model, out, pp=2, dry_run=True)
    args = ["plan", "--json", "--pp", "2", str(model), str(out)]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
        assert main(args) == 0
    assert json.loads(stdout.getvalue()) == {"status": "dry_run", **json.loads(json.dumps(result.to_dict()))}


def test_result_is_frozen(model):
    result = reshard(model, None, pp=2, dry_run=True)
    with pytest.raises(AttributeError):
        result.plan = None


class Recorder(ReshardProgress):
    def __init__(self):
        self.events = []

    def warning(self, message):
        self.events.append(("warning", message))

    def planned(self, plan, choice):
        self.events.append(("planned", plan.partition, choice is not None))

    def start(self, total_bytes):
        self.events.append(("start",))

    def stage_done(self, stage):
        self.events.append(("done", stage.rank))


def test_progress_hears_warnings_the_plan_then_the_write(make_checkpoint, tmp_path):
    model = make_checkpoint(fresh=True)
    (model / "stray.safetensors").write_bytes((model / "model-00001-of-00004.safetensors").read_bytes())
    recorder = Recorder()
    result = reshard(model, tmp_path / "out", pp=2, progress=recorder)
    kinds = [e[0] for e in recorder.events]
    assert kinds == ["warning", "planned", "start", "done", "done"], recorder.events
    assert "stray.safetensors is not listed in the checkpoint's index" in recorder.events[0][1]
    assert result.unlisted == ("stray.safetensors",)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"capacity": Capacity(10**9, 0.9, 1, 8)}, "capacity sizes partition='balanced' for serving"),
        ({"write": WriteOptions(workers=0)}, "workers must be at least 1, got 0"),
        ({"dry_run": False}, "out_dir is needed to write the split"),
    ],
)
def test_errors_name_the_library_parameters(model, kwargs, message):
    with pytest.raises(ValueError, match=message) as e:  # ReshardError is a ValueError
        reshard(model, None, **{"pp": 2, "dry_run": True, **kwargs})
    assert isinstance(e.value, ReshardError) and "--" not in str(e.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp": 2}, "tp sizes capacity mode: it needs gpu_memory"),
        ({"gpu_memory": 10**9, "context_length": 8}, "gpu_memory sizes partition='balanced' for serving"),
        ({"gpu_memory": 10**9, "partition": "balanced"}, "gpu_memory needs context_length"),
        (
            {"gpu_memory": 10**9, "partition": "balanced", "context_length": 8, "mem_fraction": 1.5},
            r"mem_fraction must be in \(0, 1\], got 1.5",
        ),
    ],
)
def test_capacity_options_name_their_parameters(kwargs, message):
    """The CLI's separate sizing flags become one Capacity, or the error names the flag at fault."""
    options = dict.fromkeys(("partition", "gpu_memory", "context_length", "tp", "mem_fraction"))
    options.update(kwargs)
    with pytest.raises(ReshardError, match=message):
        capacity_from(options.pop("partition"), **options)


def test_capacity_is_checked_where_it_is_made():
    with pytest.raises(ReshardError, match=r"tp must be at least 1, got 0"):
        Capacity(10**9, 0.9, 0, 8)
    with pytest.raises(ReshardError, match=r"context_length must be at least 1, got 0"):
        Capacity(10**9, 0.9, 1, 0)


def test_repair_takes_a_repo_id_through_its_hub_settings(model, tmp_path):
    # A repo id is a Hub source, read with the settings given (offline here: refused, naming it).
    reshard(model, tmp_path / "out", pp=2)
    with pytest.raises(ReshardError, match=r"Qwen/Tiny.*offline"):
        qwen35_reshard.repair(tmp_path / "out", "Qwen/Tiny", hub=qwen35_reshard.HubSettings(offline=True))


_HUB_RUN = """
import json, sys
from qwen35_reshard import HubSettings, ReshardProgress, reshard

class Downloads(ReshardProgress):
    expected = got = 0
    def expect_downloads(self, n): self.expected += n
    def fetched(self, n): self.got += n

preview = reshard("Qwen/Tiny", sys.argv[1], pp=2, ranks=[1], dry_run=True, hub=HubSettings(revision="v1"))
progress = Downloads()
done = reshard("Qwen/Tiny", sys.argv[1], pp=2, ranks=[1], hub=HubSettings(revision="v1"), progress=progress)
print(json.dumps({"preview": preview.fetch, "state": preview.out_state.action, "built": done.written.built,
                  "fetch": done.fetch, "expected": progress.expected, "fetched": progress.got}))
"""


@pytest.mark.slow  # a Hub server
def test_hub_repo_id_as_a_library_call(make_checkpoint, tmp_path):
    model = make_checkpoint(shard_bytes=150_000)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        PYTHONPATH=str(ROOT),
        HF_HOME=str(tmp_path / "hf-home"),
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_ETAG_TIMEOUT="5",
    )
    with HubServer() as server:
        server.add_repo("Qwen/Tiny", model, tags=("v1",))
        env["HF_ENDPOINT"] = server.url
        proc = subprocess.run(
            [sys.executable, "-c", _HUB_RUN, str(tmp_path / "out")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["state"] == "new" and got["built"] == [1]
    assert got["preview"]["repo_id"] == got["fetch"]["repo_id"] == "Qwen/Tiny"
    assert got["fetch"]["fetched_bytes"] > 0 and got["fetched"] == got["expected"]
    assert got["preview"]["shard_bytes_to_fetch"] >= got["expected"]
    local = tmp_path / "local"
    reshard(model, local, pp=2, ranks=[1])
    for f in sorted((local / "pp1").iterdir()):
        if f.name == "reshard-stage.json":  # records where the source came from: differs
            continue
        assert (tmp_path / "out" / "pp1" / f.name).read_bytes() == f.read_bytes(), f.name


def test_reshard_leaves_the_callers_collector_as_it_found_it(model, tmp_path, capsys):
    """The library pauses the garbage collector while it plans, and restores it as it was: a
    caller that disabled it keeps it disabled, and nothing of the caller's process is frozen
    (reshard() used to enable it and gc.freeze() ~28,000 objects). The command line run
    in-process (argv given) is a library caller too; only its own process plays tricks."""
    frozen = gc.get_freeze_count()
    gc.disable()
    try:
        reshard(model, tmp_path / "out", pp=2)
        assert not gc.isenabled()
        assert main(["plan", "--pp", "2", str(model)]) == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
    reshard(model, None, pp=2, dry_run=True)
    assert gc.isenabled()
    assert gc.get_freeze_count() == frozen
