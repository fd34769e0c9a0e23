"""MODEL as ``s3://bucket/prefix``, against a real S3 server on 127.0.0.1 (moto's, signatures
checked: tests/support/s3_server.py) reached through boto3 as users reach theirs: the standard
AWS variables or a profile of a shared credentials file. The server logs every request, which
is how these tests know what each run fetched.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from qwen35_reshard.source.remote.parts import GAP_BYTES

from support.helpers import ROOT, digests, header_bytes, header_reads, one_error_line
from support.s3_server import S3Server, bucket_key

pytestmark = pytest.mark.slow  # real runs against a real server: seconds a case

PP = 4
SHARD_BYTES = 150_000  # ten shards: some needed whole by one rank, some straddling ranks
BUCKET = "models"


@pytest.fixture(scope="module")
def model(make_checkpoint):
    return make_checkpoint(shard_bytes=SHARD_BYTES)


@pytest.fixture(scope="module")
def s3():
    with S3Server() as server:
        yield server


@pytest.fixture(scope="module")
def uri(s3, model):
    return s3.upload(model, BUCKET, "qwen/tiny")


@pytest.fixture(scope="module")
def local_split(model, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "out"
    run(["--pp", PP, model, out], env={})
    return out


def run(args, *, env, cache=None, check=True, popen=False):
    """The command in a fresh process with only ``env``'s AWS settings (none of this machine's)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    full.update(PYTHONPATH=str(ROOT), QWEN35_RESHARD_RETRY_WAIT="0.01", AWS_EC2_METADATA_DISABLED="true")
    if cache is not None:
        full["QWEN35_RESHARD_S3_CACHE"] = str(cache)
    full.update(env)
    argv = [sys.executable, "-m", "qwen35_reshard", *map(str, args)]
    if popen:
        return subprocess.Popen(argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def data_bytes(stage: Path) -> int:
    """The tensor bytes of a stage directory's data files, or of one data file (each stage
    tensor is one source tensor)."""
    total = 0
    for p in [stage] if stage.is_file() else stage.glob("*.safetensors"):
        with open(p, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        total += sum(b - a for a, b in (v["data_offsets"] for v in header.values()))
    return total


def weights(out: Path) -> dict[str, str]:
    return {k: v for k, v in digests(out).items() if k.endswith((".safetensors", ".json")) and "/" in k
            and not k.endswith(("reshard-stage.json", "reshard.json"))}  # fmt: skip


def replace_object(s3: S3Server, uri: str, name: str, flip_at: int) -> None:
    """Upload ``name`` again with one byte changed (same size, same layout): a new ETag."""
    bucket, prefix = bucket_key(uri)
    client = s3.client()
    key = f"{prefix}/{name}"
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[flip_at] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))


def nothing_complete(out: Path) -> None:
    """A refused run leaves no run record and no stage manifest in OUT."""
    if out.exists():
        assert not (out / "reshard.json").exists()
        assert not list(out.glob("pp*/*manifest*.json")), sorted(map(str, out.rglob("*")))


# --------------------------------------------------------------------------- the commands


def test_plan_reads_only_headers(s3, uri, model, tmp_path):
    """``plan`` from ``s3://bucket/prefix/`` (trailing slash) reads each shard's header by one
    ranged read of its first bytes (and one for the rest of a longer header), each naming the
    object's ETag in If-Match."""
    s3.clear_log()
    proc = run(["plan", "--pp", PP, uri + "/", "--json"], env=s3.env(), cache=tmp_path / "cache")
    plan = json.loads(proc.stdout)
    assert plan["fetch"]["checkpoint_bytes"] == sum(p.stat().st_size for p in model.iterdir())
    gets = s3.gets(".safetensors")
    assert all(g.range and g.if_match for g in gets), gets
    sent = {}
    for g in gets:
        sent[g.key.rsplit("/", 1)[-1]] = sent.get(g.key.rsplit("/", 1)[-1], 0) + g.sent
    assert sent == header_reads(model)


def test_split_and_ranks_fetch_their_stage(s3, uri, model, local_split, tmp_path):
    """A whole split from the URI is the local split's bytes; ``--rank 1`` and ``--rank auto``
    (node 1 of 2: stages 2 and 3) fetch their stages' tensor bytes plus headers and no more
    than a gap per request; ``verify --source URI`` passes."""
    out = tmp_path / "all"
    run(["--pp", PP, uri, out], env=s3.env(), cache=tmp_path / "c0")
    assert weights(out) == weights(local_split)
    headers = sum(header_reads(model).values())
    for ranks, args, extra in (
        ([1], ["--rank", "1"], {}),
        ([2, 3], ["--rank", "auto"], {"LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2"}),
    ):
        s3.clear_log()
        node = tmp_path / f"node{ranks[0]}"
        run(["--pp", PP, *args, uri, node], env={**s3.env(), **extra}, cache=tmp_path / f"c{ranks[0]}")
        stage = sum(data_bytes(local_split / f"pp{r}") for r in ranks)
        gets = s3.gets(".safetensors")
        fetched = s3.sent() - headers
        print(f"ranks {ranks}: fetched {fetched} data bytes for a {stage}-byte stage in {len(gets)} GETs")
        # The gaps read with near-adjacent runs (other stages' tensors, at most GAP_BYTES each)
        # are a few percent of a stage of this layout.
        assert stage <= fetched <= min(1.1 * stage, stage + GAP_BYTES * len(gets))
        assert {f"pp{r}" for r in ranks} == {p.name for p in node.glob("pp*")}
        for r in ranks:
            assert weights(node / f"pp{r}") == weights(local_split / f"pp{r}")
    proc = run(["verify", out, "--source", uri], env=s3.env(), cache=tmp_path / "c0")
    assert f"verify OK: {out} against {uri}, 4 stages" in proc.stdout, proc.stdout


def test_credentials_from_a_profile_never_shown(s3, uri, tmp_path):
    """Keys from a profile of a shared credentials file (AWS_PROFILE) reach the server; neither
    the secret nor the session token appears in stdout, stderr, --json, OUT or the cache."""
    creds = tmp_path / "credentials"
    secret = s3.credentials.secret_key
    creds.write_text(
        f"[ci]\naws_access_key_id = {s3.credentials.access_key}\naws_secret_access_key = {secret}\n"
    )
    env = {
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_SHARED_CREDENTIALS_FILE": str(creds),
        "AWS_PROFILE": "ci",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    out, cache = tmp_path / "out", tmp_path / "cache"
    proc = run(["--pp", PP, "--rank", "0", "--json", "--debug", uri, out], env=env, cache=cache)
    json.loads(proc.stdout)
    wrong = run(["plan", "--pp", PP, uri], env={**env, "AWS_SESSION_TOKEN": "TOKENsecret0123"}, check=False)
    texts = [proc.stdout, proc.stderr, wrong.stdout, wrong.stderr]
    texts += [p.read_bytes().decode("latin-1") for p in [*out.rglob("*"), *cache.rglob("*")] if p.is_file()]
    assert not [t for t in texts if secret in t or "TOKENsecret0123" in t]


def test_repair_from_the_uri(s3, uri, model, local_split, tmp_path):
    """``verify --source URI --repair`` rewrites a damaged data file of a split from the objects,
    fetching only that file's byte ranges (plus headers), and the split verifies again."""
    out = tmp_path / "out"
    shutil.copytree(local_split, out)
    victim = sorted((out / "pp2").glob("*.safetensors"))[0]
    with open(victim, "r+b") as f:
        f.seek(victim.stat().st_size - 10)
        f.write(b"\xff" * 10)
    cache = tmp_path / "cache"
    run(["plan", "--pp", PP, uri], env=s3.env(), cache=cache)  # the headers kept: only data below
    s3.clear_log()
    proc = run(["verify", out, "--source", uri, "--repair"], env=s3.env(), cache=cache, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert weights(out) == weights(local_split)
    mended = data_bytes(local_split / "pp2" / victim.name)
    every = sum(p.stat().st_size for p in model.glob("*.safetensors")) - sum(header_bytes(model).values())
    print(f"repair: {s3.sent()} bytes of shards fetched; the file mended holds {mended}, the source {every}")
    # The verify before and the one after hash every source tensor once each; the rewrite
    # fetches the damaged file's tensors, near-adjacent runs coalesced.
    assert 2 * every + mended <= s3.sent() <= 2 * every + 1.1 * mended


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "case",
    ["no bucket", "no prefix", "access denied", "wrong secret", "unknown key", "no endpoint", "no boto3"],
)
def test_bad_input_one_line(s3, uri, tmp_path, case):
    """Each is one ``error:`` line naming the URI and what to do; nothing complete in OUT."""
    env, target, expect = s3.env(), uri, ""
    if case == "no bucket":
        target, expect = "s3://nosuch-bucket/qwen/tiny", "no bucket"
    elif case == "no prefix":
        target, expect = f"s3://{BUCKET}/qwen/nothing-here", "no objects under this prefix"
    elif case == "access denied":
        env, expect = s3.env(s3.denied), "access denied"
    elif case == "wrong secret":
        env, expect = {**env, "AWS_SECRET_ACCESS_KEY": "wrong" * 8}, "refused the credentials"
    elif case == "unknown key":
        env, expect = {**env, "AWS_ACCESS_KEY_ID": "AKIAUNKNOWNUNKNOWN00"}, "refused the credentials"
    elif case == "no endpoint":
        env, expect = {**env, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}, "does not answer"
    out = tmp_path / "out"
    if case == "no boto3":
        code = "import sys; sys.modules['boto3'] = None; from qwen35_reshard.cli import main; exit(main())"
        full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        proc = subprocess.run([sys.executable, "-c", code, "--pp", "4", target, str(out)], env=full,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        expect = "pip install boto3 (the s3 extra)"
    else:
        env = {**env, "AWS_MAX_ATTEMPTS": "1"}
        proc = run(["--pp", PP, target, out], env=env, cache=tmp_path / "c", check=False)
    line = one_error_line(proc)
    assert target.rstrip("/") in line and expect in line, line
    nothing_complete(out)


# --------------------------------------------------------------------------- changes and kills


def test_object_replaced_mid_run_is_refused(s3, model, tmp_path):
    """The run is stopped (SIGSTOP) as its first ranged read of tensor data reaches the server;
    the shard is replaced; the run goes on (SIGCONT) and its read, naming the old ETag in
    If-Match, is refused: one line, no stage finished, never the two versions mixed."""
    target = s3.upload(model, BUCKET, "qwen/replaced")
    headers = header_bytes(model)
    pid: list[int] = []
    hit = threading.Event()

    def on_get(entry) -> None:
        name = entry.key.rsplit("/", 1)[-1]
        begin = int(entry.range.split("=")[1].split("-")[0])
        if "replaced" in entry.key and name in headers and begin >= headers[name] and not hit.is_set():
            hit.set()
            os.kill(pid[0], signal.SIGSTOP)
            try:
                replace_object(s3, target, name, begin)
            finally:
                os.kill(pid[0], signal.SIGCONT)

    out = tmp_path / "out"
    s3.on_get = on_get
    try:
        proc = run(["--pp", PP, "--streams", 1, target, out], env=s3.env(), cache=tmp_path / "c", popen=True)
        pid.append(proc.pid)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        s3.on_get = None
    assert hit.is_set()
    line = one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert "was replaced while this run read it" in line and target in line, line
    nothing_complete(out)


def test_rerun_after_an_object_changed(s3, model, tmp_path):
    """A rerun over a complete OUT fetches nothing when the objects are unchanged; after one
    shard is replaced (other bytes, same layout) the run sees another source: refused in one
    line, rebuilt with --overwrite, and then the stage holds the new bytes."""
    target = s3.upload(model, BUCKET, "qwen/changing")
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["--pp", PP, "--rank", "1", target, out]
    run(args, env=s3.env(), cache=cache)
    s3.clear_log()
    run(args, env=s3.env(), cache=cache)
    assert s3.sent() == 0
    stage_files = {p.name for p in (out / "pp1").glob("*.safetensors")}
    # A shard pp1 reads: the source shard of the stage's first tensor.
    index = json.loads((model / "model.safetensors.index.json").read_text())["weight_map"]
    first = json.loads((out / "pp1" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index[sorted(first)[0]]
    replace_object(s3, target, shard, header_bytes(model)[shard])
    proc = run(args, env=s3.env(), cache=cache, check=False)
    line = one_error_line(proc)
    assert "other settings" in line and "--overwrite" in line, line
    before = digests(out / "pp1")
    run([*args, "--overwrite"], env=s3.env(), cache=cache)
    assert {p.name for p in (out / "pp1").glob("*.safetensors")} == stage_files
    assert digests(out / "pp1") != before


def test_killed_mid_fetch_then_resumed(s3, model, local_split, tmp_path):
    """SIGKILL while the ranged reads are in flight (the server paced to 300 KB/s a request),
    then the same command: the stages equal the local split's."""
    target = s3.upload(model, BUCKET, "qwen/killed")
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["--pp", PP, target, out]
    s3.clear_log()
    s3.rate = 300_000
    try:
        proc = run(args, env=s3.env(), cache=cache, popen=True)
        deadline = time.monotonic() + 60
        while s3.sent() < 200_000 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.kill()
        proc.wait()
    finally:
        s3.rate = None
    assert 0 < s3.sent() and not (out / "reshard.json").exists()
    run(args, env=s3.env(), cache=cache)
    assert weights(out) == weights(local_split)
