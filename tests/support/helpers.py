"""Helpers every kind of test uses: the repository's paths, running the command, what a refused
run says, and what a run left behind."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from qwen35_reshard.source.remote.checkpoint import header_read

ROOT = Path(__file__).resolve().parents[2]  # the repository
SUPPORT = Path(__file__).resolve().parent  # the workers run as scripts from here
CLI = Path(sys.executable).with_name("qwen35-reshard")  # the installed command


def run_without(modules: list[str], code: str) -> str:
    """Run ``code`` in a fresh interpreter in which ``modules`` cannot be imported; its stdout."""
    blocked = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    res = subprocess.run(
        [sys.executable, "-c", f"import sys; {blocked}\n{code}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def run_cli(*args, check=True) -> subprocess.CompletedProcess:
    """The installed ``qwen35-reshard`` with ``args``; exit 0 asserted unless ``check=False``."""
    proc = subprocess.run([str(CLI), *map(str, args)], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def mount_namespace(probe: Path) -> list[str] | None:
    """A command prefix that runs in a private mount namespace where tmpfs can be mounted.

    Root gets a plain mount namespace; anyone else a user namespace mapped to root (where the
    kernel allows unprivileged user namespaces). The mount vanishes with the namespace.
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    candidates = [[unshare, "--user", "--map-root-user", "--mount"]]
    if os.geteuid() == 0:
        candidates.insert(0, [unshare, "--mount"])
    probe.mkdir(exist_ok=True)
    for prefix in candidates:
        p = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)],
                           capture_output=True)  # fmt: skip
        if p.returncode == 0:
            return prefix
    return None


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The one ``error:`` line of a refused run: exit 2, no traceback, exactly one ``error:``
    line and it is the last on stderr; stdout holds no more than what was printed before the
    write started (no summary, no launch line)."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "wrote" not in proc.stdout and "PP_LAYER_PARTITION" not in proc.stdout, proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and proc.stderr.rstrip("\n").splitlines()[-1] == lines[0], proc.stderr
    return lines[0]


def lone_error_line(proc: subprocess.CompletedProcess) -> str:
    """``one_error_line``, and nothing else on stderr."""
    line = one_error_line(proc)
    assert proc.stderr.strip() == line, proc.stderr
    return line


def tree(root: Path) -> dict[str, bytes | str | None]:
    """Everything under ``root``, hidden entries too, by relative path: a file's bytes, a
    symlink's target (never followed), None for a directory. Equal trees hold the same names,
    kinds and bytes."""
    out: dict[str, bytes | str | None] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = os.readlink(p) if p.is_symlink() else None if p.is_dir() else p.read_bytes()
    return out


def digests(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (hidden ones too), streamed: for outputs too big to
    hold in memory twice."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 22):
                    h.update(chunk)
            out[str(p.relative_to(root))] = h.hexdigest()
    return out


def drop_tensor(model: Path, name: str) -> None:
    """Rewrite the shard holding ``name`` without it (data re-packed) and unlist it."""
    index_path = model / "model.safetensors.index.json"
    index = json.loads(index_path.read_bytes())
    drop_tensor_file(model / index["weight_map"].pop(name), name)
    index_path.write_text(json.dumps(index, indent=2))


def drop_tensor_file(shard: Path, name: str) -> None:
    """Rewrite the safetensors file ``shard`` without tensor ``name``, the rest re-packed."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + n]), raw[8 + n :]
    del header[name]
    entries = sorted(
        ((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"]
    )
    body, pos = bytearray(), 0
    for _, v in entries:
        begin, end = v["data_offsets"]
        body += data[begin:end]
        v["data_offsets"] = [pos, pos + end - begin]
        pos += end - begin
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    shard.write_bytes(struct.pack("<Q", len(text)) + text + bytes(body))


def partition_exchange(
    python: str, script: str, variables: tuple[str | None, ...], *,
    variable: str = "VLLM_PP_LAYER_PARTITION", args: tuple[str, ...] = (),
) -> tuple[list[str], list]:
    """Run ``script`` as each rank of one gloo group on 127.0.0.1 (argv: the address, the rank,
    then ``args``), rank r with ``variable`` set to ``variables[r]`` (None: unset), as on separate
    nodes. Returns each rank's first AGREED/REFUSED line (else its stderr), and (stdout, stderr)
    by rank."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    procs = []
    for rank, var in enumerate(variables):
        env = {k: v for k, v in os.environ.items() if k != variable}
        env["PYTHONPATH"] = str(ROOT)
        if var is not None:
            env[variable] = var
        procs.append(subprocess.Popen([python, "-c", script, address, str(rank), *args], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = [p.communicate(timeout=300) for p in procs]
    lines = [next((ln for ln in o.splitlines() if ln.startswith(("AGREED", "REFUSED"))), e) for o, e in out]
    return lines, out


def other_weights(model: Path, dest: Path) -> Path:
    """A copy of ``model`` with the same config, index and headers but other bytes in one
    tensor of one shard: what a new commit of the same checkpoint looks like."""
    shutil.copytree(model, dest)
    shard = sorted(dest.glob("*.safetensors"))[2]
    raw = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n : 8 + n + 64] = bytes(b ^ 0xFF for b in raw[8 + n : 8 + n + 64])
    shard.write_bytes(bytes(raw))
    return dest


def header_bytes(model: Path) -> dict[str, int]:
    """Each shard's length prefix plus header, read with struct."""
    out = {}
    for p in sorted(model.glob("*.safetensors")):
        with open(p, "rb") as f:
            out[p.name] = 8 + struct.unpack("<Q", f.read(8))[0]
    return out


def header_reads(model: Path) -> dict[str, int]:
    """What reading each shard's header costs: the tool's first read, or more for a longer header."""
    return {f: max(n, header_read((model / f).stat().st_size)) for f, n in header_bytes(model).items()}
