"""Every file name and pattern the tool reads or writes, and the layouts of a stage's data files."""

from __future__ import annotations

import os
import re
import secrets
import socket
from functools import cache
from pathlib import Path

from .._version import __version__

TOOL_NAME = "qwen35-reshard"
TOOL = {"name": TOOL_NAME, "version": __version__}

# A Hugging Face model directory, as read from the source and written for every stage.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
# Weight formats that can only be read by unpickling: refused, never opened.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")

# The split: OUT/reshard.json and one OUT/pp{rank} per stage, each with its manifest.
STAGE_MANIFEST = "reshard-stage.json"
RUN_MANIFEST = "reshard.json"
# A stage directory's name, pp{rank}; no leading zeros, so each rank has one spelling.
STAGE_DIR = re.compile(r"pp(0|[1-9][0-9]*)")
# A node's directory of an expert-parallel split: pp{rank}-node{k}, or node{k} without PP.
NODE_DIR = re.compile(r"(?:pp(0|[1-9][0-9]*)-)?node(0|[1-9][0-9]*)")
# Files of a run in progress: the marker (OUT, removed on success), the journal (a stage
# directory, removed with the stage complete) and every file before its atomic rename.
RUN_MARKER = ".reshard-run.json"  # identity of a run in progress; removed on success
JOURNAL = ".reshard-journal.jsonl"  # finished data files of an unfinished stage, with digests
PARTIAL_SUFFIX = ".partial"
# Non-weight files (config, tokenizer) are read, copied and hashed in chunks of this size.
SIDE_FILE_CHUNK = 64 << 20
# A Hugging Face cache: a repo's folder (models--org--name) and a commit's snapshot (snapshots/<sha1>).
CACHE_REPO_PREFIX = "models--"
COMMIT = re.compile(r"[0-9a-f]{40}")
# The source a run identity records for a local checkpoint directory (a Hub source: repo@commit).
LOCAL_SOURCE = "local"
# Runs sharing one OUT (see write/claims.py): held while a run decides or records what OUT
# holds, and, in a stage directory, while a run builds that stage.
LOCK = ".reshard-lock"
CLAIM = ".reshard-claim"
# A server using a stage of the stage cache (see write/claims.py, ``in_use``): one record per
# process, IN_USE plus its token, held while it runs; LAST_USED touched at each start.
IN_USE, LAST_USED = ".qwen35-stages-in-use.", ".qwen35-stages-used"
# A lock or claim taken from a gone run is moved aside under its name plus this first (see
# write/claims.py), so that it is never removed from under a run that took it meanwhile.
GONE_SUFFIX = ".gone"
# The tool's own dotfiles: a temporary of one (or of one moved aside) keeps its single leading dot.
DOTFILES = (RUN_MARKER, JOURNAL, LOCK, CLAIM)
# What the writing process adds to a temporary's name: ".HOST.PID.NONCE" (HOST without dots;
# see :func:`process_token`), so that no two processes sharing OUT (or a Hub cache) write,
# rename or delete each other's.
TEMP_TOKEN = re.compile(r"\.[A-Za-z0-9-]+\.[0-9]+\.[0-9a-f]{8}$")
_TOKEN_CHARS = re.compile(r"[^A-Za-z0-9-]")

# How a stage's data file is laid out (what each is and why: docs/format.md, "Data file layouts").
CLONE, ALIGNED, GATHERED = "clone", "aligned", "gathered"
LAYOUTS = (CLONE, ALIGNED, GATHERED)
# A multiple of every block size a filesystem shares by (4 KiB pages, ZFS records up to 1 MiB).
SHARE_ALIGN = 1024 * 1024
# What a split did with the checkpoint's MTP head (mtp.*), as manifests record it.
MTP_KEPT, MTP_DROPPED, MTP_ABSENT = "kept", "dropped", "absent"


def stage_dirname(rank: int) -> str:
    """The directory of stage ``rank`` inside OUT: ``pp{rank}``."""
    return f"pp{rank}"


def node_dirname(stage: int, node: int, pp: int) -> str:
    """The directory of node ``node`` of pipeline stage ``stage`` inside OUT: ``pp{stage}-node{node}``,
    or ``node{node}`` for a split without pipeline parallelism (``pp`` 1)."""
    return f"node{node}" if pp == 1 else f"pp{stage}-node{node}"


def is_split_dirname(name: str) -> bool:
    """A directory a split writes in OUT: a stage's (``ppN``) or a node's (``pp{r}-node{k}``, ``node{k}``)."""
    return bool(STAGE_DIR.fullmatch(name) or NODE_DIR.fullmatch(name))


def node_dir_of(path: Path) -> tuple[int, int] | None:
    """``(stage, node)`` for a directory named ``pp{stage}-node{node}`` or ``node{node}`` (stage 0);
    None for any other name."""
    m = NODE_DIR.fullmatch(path.name)
    return (int(m.group(1) or 0), int(m.group(2))) if m else None


def stage_dir_rank(path: Path) -> int | None:
    """N for a directory named ``ppN``; None for any other name."""
    m = STAGE_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def process_token() -> str:
    """``HOST.PID.NONCE``, unique to this process on any host (a forked child gets its own):
    what it adds to the name of every temporary file it writes (see :data:`TEMP_TOKEN`)."""
    return _token(os.getpid())


@cache
def _token(pid: int) -> str:
    return f"{_TOKEN_CHARS.sub('-', socket.gethostname())[:32]}.{pid}.{secrets.token_hex(4)}"


def partial_name(name: str, token: str = "") -> str:
    """The name a file ``name`` is written under before its atomic rename: hidden by one
    leading dot (a dotfile keeps its own), the writing process's ``token`` (see TEMP_TOKEN),
    and PARTIAL_SUFFIX: ``.config.json.HOST.PID.NONCE.partial``, ``.reshard-run.json.....partial``."""
    return f"{'' if name.startswith('.') else '.'}{name}{'.' + token if token else ''}{PARTIAL_SUFFIX}"


def partial_base(name: str) -> str | None:
    """The name the temporary file ``name`` stands for (what :func:`partial_name` was given,
    token or not; also an older release's ``..reshard-run.json.partial``); None when ``name``
    is no temporary."""
    if not (name.startswith(".") and name.endswith(PARTIAL_SUFFIX)):
        return None
    base = TEMP_TOKEN.sub("", name[: -len(PARTIAL_SUFFIX)])
    return base if base.removesuffix(GONE_SUFFIX) in DOTFILES else base[1:]
