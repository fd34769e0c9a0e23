"""``qwen35-reshard cache ls|verify|rm`` on a stage cache built by the real unsplit path
(tests/e2e/test_serve.py's driver: each start its own process, with the tests' Hub server),
issue 37: what each entry is, its bytes checked, and removal by model, age and revision,
never of a stage a running server holds.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
from e2e.test_serve import PARTITION, REPO, flip_a_byte, serve

from qwen35_reshard.cli.app import main
from qwen35_reshard.servers.stagecache import cache_entries

from support.hub_server import HubServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def once(tmp_path_factory, make_checkpoint):
    """A stage cache holding stages 0 and 1 of REPO at commit A, stage 0 at commit B (``main``
    moved), and stage 3 of a local directory copied: each built by its own start."""
    model = make_checkpoint(shard_bytes=150_000)
    home = tmp_path_factory.mktemp("cache")
    with HubServer() as hub:
        first = hub.add_repo(REPO, model)
        for rank in (0, 1):
            assert serve(home, {"model": REPO, "rank": rank}, hub=hub)["how"] == "fetched"
        second = hub.add_repo(REPO, model, commit="b" * 40)
        assert serve(home, {"model": REPO, "rank": 0}, hub=hub)["how"] == "fetched"
        assert serve(home, {"model": str(model), "rank": 3, "copy": True})["how"] == "built"
        yield home / "stages", first, second, hub


@pytest.fixture
def built(once, tmp_path):
    """``once``'s stage cache copied for one test (times kept), at ``tmp_path/stages`` where
    its starts (``serve(tmp_path, ...)``) look; ``main`` at commit B."""
    cache, first, second, hub = once
    shutil.copytree(cache, tmp_path / "stages", symlinks=True)
    hub.move(REPO, second)
    return tmp_path / "stages", first, second, hub


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["cache", *args])
    out, err = capsys.readouterr()
    return code, out, err


def du(path: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in path.iterdir())


def test_ls_lists_every_stage_with_what_it_is(built, capsys):
    cache, first, second, _ = built
    code, out, _ = cli(capsys, "ls", "--cache-dir", str(cache), "--json")
    assert code == 0
    entries = json.loads(out)["entries"]
    got = sorted((e["model"], e["revision"], e["runtime"], e["partition"], e["stage"]) for e in entries)
    local = next(e["model"] for e in entries if e["model"].startswith("local/"))
    assert got == sorted([
        (REPO, first, "sglang", PARTITION, 0), (REPO, first, "sglang", PARTITION, 1),
        (REPO, second, "sglang", PARTITION, 0), (local, local.split("/")[1], "sglang", PARTITION, 3),
    ])  # fmt: skip
    for e in entries:
        assert e["complete"] is True and e["held_by"] == [] and e["size"] == du(Path(e["path"])) > 0
        assert time.time() - 300 < e["last_used"] <= time.time()

    code, table, _ = cli(capsys, "ls", "--cache-dir", str(cache))
    assert code == 0 and table.splitlines()[0].split() == [
        "MODEL", "REVISION", "RUNTIME", "PARTITION", "STAGE", "SIZE", "LAST", "USED", "COMPLETE", "HELD",
        "BY",
    ]  # fmt: skip
    assert re.search(rf"{REPO} +{first[:12]} +sglang +2,2,2,2 +pp1 .* yes +-", table), table
    assert table.splitlines()[-1].startswith("4 entries, ")


def test_verify_names_a_damaged_tensor(built, capsys):
    cache, first, second, _ = built
    stage = cache / f"models--{REPO.replace('/', '--')}" / first / "sglang-pp4-2-2-2-2" / "pp1"
    victim = flip_a_byte(next(stage.glob("*.safetensors")))
    code, out, _ = cli(capsys, "verify", "--cache-dir", str(cache), "--model", REPO)
    assert code == 1
    assert f"the bytes of tensor {victim!r} do not match its xxh128" in out
    assert "3 entries checked, 1 with problems" in out  # the local one was not asked for
    code, out, err = cli(capsys, "verify", "--cache-dir", str(cache), "--model", "Qwen/Other")
    assert code == 2 and err.startswith("error: --model: the stage cache holds no entry of Qwen/Other")


def test_verify_of_a_damaged_entry_says_what_mends_it_and_that_does(built, capsys, tmp_path):
    """Issue 44: not "1 problems" and "run the same qwen35-reshard command again (or copy the
    stage again)", which no stage of the cache was made with: remove it (cache rm, or the
    directory), and the next start of a server builds it anew; done, the entry is intact."""
    cache, first, _, hub = built
    stage = cache / f"models--{REPO.replace('/', '--')}" / first / "sglang-pp4-2-2-2-2" / "pp1"
    data = json.loads((stage / "reshard-stage.json").read_text())["files"]
    flip_a_byte(stage / next(f for f, info in data.items() if info["layout"] == "gathered"))  # one finding
    code, out, _ = cli(capsys, "verify", "--cache-dir", str(cache), "--model", REPO)
    assert code == 1 and "run the same" not in out and "1 problems" not in out, out
    entry = next(line for line in out.splitlines() if line.endswith("pp1: 1 problem"))
    assert entry.startswith(f"{REPO}@{first[:12]} sglang-pp4-2-2-2-2 pp1"), out
    assert f"  remove it (qwen35-reshard cache rm --model {REPO} removes every entry of {REPO}; or delete " \
        f"{stage}): the next start of a server on it builds it anew" in out.splitlines(), out
    local = next(e.model for e in cache_entries(cache) if e.model.startswith("local/"))
    code, out, _ = cli(capsys, "verify", "--cache-dir", str(cache), "--model", local)
    assert code == 0 and out.splitlines()[-1] == "1 entry checked, 0 with problems"

    shutil.rmtree(stage)  # as the line says; then a start
    assert serve(tmp_path, {"model": REPO, "rank": 1, "revision": first}, hub=hub)["how"] == "fetched"
    code, out, _ = cli(capsys, "verify", "--cache-dir", str(cache), "--model", REPO)
    assert code == 0 and out.splitlines()[-1] == "3 entries checked, 0 with problems", out


def test_rm_by_revision_age_and_model_never_what_a_server_holds(built, capsys, tmp_path):
    cache, first, second, hub = built
    names = lambda: sorted((e.revision, e.stage) for e in cache_entries(cache))  # noqa: E731
    code, out, err = cli(capsys, "rm", "--cache-dir", str(cache))
    assert code == 2 and "say which entries to remove: --model, --older-than, --keep-newest or --all" in err

    # All but the newest revision of each model: commit A's stages go, B's and the local one stay.
    code, out, _ = cli(capsys, "rm", "--cache-dir", str(cache), "--keep-newest", "--dry-run")
    assert code == 0 and out.count("would remove: ") == 2 and len(names()) == 4
    code, out, _ = cli(capsys, "rm", "--cache-dir", str(cache), "--keep-newest", "--json")
    assert code == 0 and {e["revision"] for e in json.loads(out)["removed"]} == {first}
    assert not (cache / f"models--{REPO.replace('/', '--')}" / first).exists()  # nothing left of it

    # By age: the local stage, last used two days ago, goes; B's (used just now) stays.
    local = next(e for e in cache_entries(cache) if e.model.startswith("local/"))
    old = time.time() - 2 * 86400
    for p in local.path.iterdir():
        os.utime(p, (old, old))
    code, out, _ = cli(capsys, "rm", "--cache-dir", str(cache), "--older-than", "1d")
    assert code == 0 and names() == [(second, 0)]

    # A server holds B's stage: removing the model's entries refuses it, naming the server...
    holder = serve(tmp_path, {"model": REPO, "rank": 0, "hold": 300}, hub=hub, background=True)
    try:
        line = holder.stdout.readline()
        assert line.startswith("RESULT ") and json.loads(line[7:])["how"] == "cached", line
        code, out, _ = cli(capsys, "rm", "--cache-dir", str(cache), "--model", REPO)
        assert code == 1 and f"pid {holder.pid}" in out and out.startswith("refused: "), out
        assert names() == [(second, 0)]
        code, out, _ = cli(capsys, "ls", "--cache-dir", str(cache))
        assert f"pid {holder.pid}" in out
    finally:
        holder.send_signal(signal.SIGKILL)  # killed: no chance to withdraw its record
        holder.wait(timeout=30)
    # ... and once that server is gone, removes it.
    code, out, _ = cli(capsys, "rm", "--cache-dir", str(cache), "--all")
    assert code == 0 and names() == [] and out.startswith("removed: ")


def test_rm_never_deletes_a_stage_a_starting_server_has_opened(built, capsys, tmp_path):
    """The race: a server stopped (SIGSTOP) right after it opened its cached stage, ``cache rm``
    run then, the server continued (SIGCONT). Before, the server recorded its use only after
    opening, so rm deleted the stage under it and its load could not open the files; now the
    record comes first and rm looks again under the stage's claim just before deleting."""
    cache, _, second, hub = built
    server = serve(tmp_path, {"model": REPO, "rank": 0, "stop_after_open": True}, hub=hub, background=True)
    try:
        deadline = time.monotonic() + 120
        while Path(f"/proc/{server.pid}/stat").read_text().split(") ")[1][0] != "T":
            assert server.poll() is None and time.monotonic() < deadline, server.communicate()
            time.sleep(0.05)
        code, out, _ = cli(capsys, "rm", "--cache-dir", str(cache), "--model", REPO)
        refused = [ln for ln in out.splitlines() if ln.startswith("refused: ")]
        assert code == 1 and len(refused) == 1 and f"pid {server.pid}" in refused[0], out
        assert [(e.revision, e.stage) for e in cache_entries(cache) if e.model == REPO] == [(second, 0)]
    finally:
        server.send_signal(signal.SIGCONT)
    stdout, stderr = server.communicate(timeout=120)
    said = [ln for ln in stdout.splitlines() if ln.startswith(("RESULT ", "STAGEERROR "))]
    line = said[0] if said else stdout + stderr
    assert line.startswith("RESULT ") and json.loads(line[7:])["how"] == "cached", line


def test_a_server_start_refreshes_last_used(built, tmp_path):
    cache, first, second, hub = built
    entry = next(e for e in cache_entries(cache) if e.revision == second)
    past = time.time() - 86400
    for p in entry.path.iterdir():
        os.utime(p, (past, past))
    assert next(e for e in cache_entries(cache) if e.revision == second).last_used < past + 1
    assert serve(tmp_path, {"model": REPO, "rank": 0}, hub=hub)["how"] == "cached"
    assert next(e for e in cache_entries(cache) if e.revision == second).last_used > time.time() - 300


def test_object_storage_entries_are_listed_by_uri(built, capsys):
    """The stage cache keeps stages of ``s3://`` sources under s3/<bucket>/<prefix>/<listing>/
    (servers/unsplit.py): listed by their URI, removable by it."""
    cache, first, second, _ = built
    hub_run = next(e for e in cache_entries(cache) if e.revision == second).path.parent
    listing = "e" * 64
    for where in (("bucket", "models", "qwen"), ("other", "_")):
        shutil.copytree(hub_run, cache.joinpath("s3", *where, listing, hub_run.name), symlinks=True)
    entries = [e for e in cache_entries(cache) if e.model.startswith("s3")]
    got = {(e.model, e.revision, e.stage, e.complete) for e in entries}
    assert got == {("s3://bucket/models/qwen", listing, 0, True), ("s3://other", listing, 0, True)}
    code, out, _ = cli(capsys, "rm", "--cache-dir", str(cache), "--model", "s3://other")
    assert code == 0 and out.count("removed: s3://other@") == 1
    assert {e.model for e in cache_entries(cache) if e.model.startswith("s3")} == {"s3://bucket/models/qwen"}
