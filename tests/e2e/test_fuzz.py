"""A fuzz test of reading sources and checking stages (issue 29): deterministic seeds, a few
hundred mutated shard headers, indexes, configs, Hugging Face cache folders and stages.

Every split must end one of two ways: a clean refusal (exit 2, one ``error:`` line, no
traceback, nothing in OUT that looks complete), or a split whose every stage the safetensors
reference reader and transformers read, each tensor byte-equal to the source's (which the
reference reader reads too). Every verify of a damaged stage must end in exit 1 or 2 without a
traceback, or, passing, hold a stage that reads and matches the source all the same.

The mutations are of two kinds: byte-level (a flipped bit, a span cut, copied or replaced by a
token that parsers trip on: ``-0``, ``1e0``, escapes of NUL and of a lone surrogate, a BOM,
invalid UTF-8) and well-formed (a number or string token replaced, whitespace added, another
encoding), so that both outcomes occur. Runs in this process through ``cli.main`` (a tiny
checkpoint splits in ~0.1 s); the counts per class are printed (``-s``) for the record.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
from collections import Counter
from pathlib import Path

import pytest
from test_bad_input import INDEX, assert_clean_failure, run_cli

from qwen35_reshard import cli

pytestmark = pytest.mark.slow

PER_CLASS = 70  # inputs per class: 350 in all
TOKENS = [
    b"-0", b"0.0", b"1e0", b"-1", b"18446744073709551616", b"00", b"null", b"true", b'""', b"[]", b"{}",
    b"\\u0000", b"\\ud800", b"\\n", b'"', b",", b":", b"{", b"}", b"\xff", b"\xef\xbb\xbf", b"\xc3", b"\n",
    b" ", b"\x00", b'"__metadata__"', b'"F8_E4M3"', b'"../x.safetensors"', b"9" * 40,
]  # fmt: skip
STRINGS = [
    "", "x" * 300 + ".safetensors", "../x.safetensors", "/etc/passwd", "\ud800", "a\nerror: forged", "é",
    "model.safetensors", "sub/x", "\x00", "__metadata__",
]  # fmt: skip
NUMBERS = ["-0", "0.0", "1e0", "-1", "18446744073709551616", "0", "1", "2", "7", "true", "null", '"8"']
NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


# --------------------------------------------------------------------------- mutations


def mutate_bytes(rng: random.Random, raw: bytes) -> bytes:
    """One byte-level damage at a random place."""
    i = rng.randrange(len(raw) + 1)
    j = min(len(raw), i + rng.randrange(1, 9))
    op = rng.randrange(5)
    if op == 0 and i < len(raw):
        return raw[:i] + bytes([raw[i] ^ (1 << rng.randrange(8))]) + raw[i + 1 :]
    if op == 1:
        return raw[:i] + raw[j:]
    if op == 2:
        return raw[:i] + rng.choice(TOKENS) + raw[i:]
    if op == 3:
        return raw[:i] + rng.choice(TOKENS) + raw[j:]
    return raw[:i] + raw[i:j] + raw[i:]


def mutate_json(rng: random.Random, raw: bytes) -> bytes:
    """One well-formed-looking change: a number or string token replaced, whitespace added,
    another encoding; or a byte-level damage."""
    op = rng.randrange(6)
    if op == 0 and (found := list(NUMBER.finditer(raw))):
        m = rng.choice(found)
        return raw[: m.start()] + rng.choice(NUMBERS).encode() + raw[m.end() :]
    if op == 1 and (found := list(STRING.finditer(raw))):
        m = rng.choice(found)
        return raw[: m.start()] + json.dumps(rng.choice(STRINGS)).encode() + raw[m.end() :]
    if op == 2:  # whitespace between tokens: harmless to every reader
        spots = [m.end() for m in re.finditer(rb"[,:{\[]", raw)]
        i = rng.choice(spots) if spots else 0
        return raw[:i] + rng.choice([b" ", b"\n  ", b"\t"]) + raw[i:]
    if op == 3:
        return raw.decode("utf-8", "surrogateescape").encode(
            rng.choice(["utf-16", "utf-16-le", "utf-32", "utf-8-sig"]), "surrogateescape"
        )
    return mutate_bytes(rng, raw)


def mutate_header(rng: random.Random, shard: Path) -> None:
    """Mutate a shard's header JSON (its length prefix most often rewritten to fit), or, now
    and then, its length prefix or tensor data alone."""
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = raw[8 : 8 + n], raw[8 + n :]
    op = rng.randrange(10)
    if op == 2:  # the first offset written -0: 0 to Python, a float to the reference reader
        header = header.replace(b'"data_offsets":[0,', b'"data_offsets":[-0,', 1).rstrip(b" ")
        header += b" " * (-(8 + len(header)) % 8)
        n = len(header)
    elif op == 0:  # the data: any bytes are a tensor's
        i = rng.randrange(len(data))
        data = data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :]
    elif op == 1:
        n = rng.choice([0, 1, n - 1, n + 1, len(raw), 2**63, 100_000_001])
        header = header[: min(n, len(header))] if rng.random() < 0.5 else header
    else:
        header = mutate_json(rng, header.rstrip(b" "))
        header += b" " * (-(8 + len(header)) % 8) if rng.random() < 0.8 else b""
        n = len(header)
    shard.write_bytes(struct.pack("<Q", n) + header + data)


def mutate_cache(rng: random.Random, repo: Path, elsewhere: Path) -> Path:
    """Damage a cache repo folder; returns what to pass as MODEL (the folder or its snapshot)."""
    ref = repo / "refs" / "main"
    commit = ref.read_text()
    snapshot = repo / "snapshots" / commit
    blobs = sorted((repo / "blobs").iterdir())
    op = rng.randrange(8)
    if op == 0:  # random bytes, hex or not, with path pieces and line breaks
        alphabet = b"0123456789abcdef/.\n\xff " + bytes(range(65, 70))
        ref.write_bytes(bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 48))))
    elif op == 1:
        ref.write_text(
            rng.choice(["../../../elsewhere", str(elsewhere), commit + "\n", commit.upper(), "0" * 40])
        )
    elif op == 2:
        ref.unlink()
        ref.symlink_to(rng.choice([elsewhere / "config.json", snapshot / "config.json", Path("/dev/zero")]))
    elif op in (3, 4):  # a blob's bytes no longer its name: a flip, a cut or more
        blob = rng.choice(blobs)
        blob.write_bytes(mutate_bytes(rng, blob.read_bytes()))
    elif op == 5:  # a snapshot file led elsewhere
        link = rng.choice(sorted(snapshot.iterdir()))
        link.unlink()
        link.symlink_to(
            rng.choice([f"../../blobs/{rng.choice(blobs).name}", "../../../x", str(elsewhere / link.name)])
        )
    elif op == 6:
        shutil.rmtree(snapshot)
        snapshot.symlink_to(elsewhere, target_is_directory=True)
    else:
        rng.choice(blobs).unlink()
    return snapshot if rng.random() < 0.3 and op not in (0, 1, 2) else repo


def mutate_stage(rng: random.Random, out: Path) -> None:
    """Damage one file of a finished split's stage."""
    stage = out / rng.choice(["pp0", "pp1"])
    path = rng.choice(sorted(p for p in stage.iterdir() if p.is_file()))
    op = rng.randrange(4)
    if op == 0:
        path.unlink()
    elif op == 1 and path.suffix == ".safetensors":
        mutate_header(rng, path)
    elif op == 2 and path.suffix == ".json":
        path.write_bytes(mutate_json(rng, path.read_bytes()))
    else:
        path.write_bytes(mutate_bytes(rng, path.read_bytes()))


# --------------------------------------------------------------------------- outcomes


def readable_and_equal(source: Path, out: Path, ref) -> None:
    """Every stage read by the safetensors reference reader and transformers, its tensors
    byte-equal to the source's, which the reference reader reads too."""
    from safetensors import safe_open
    from transformers import PretrainedConfig
    from transformers.utils.hub import get_checkpoint_shard_files

    src = ref.read_source(source)
    for name in {t.file for t in src.tensors.values()}:
        with safe_open(source / name, "pt") as f:
            assert set(f.keys()) == {n for n, t in src.tensors.items() if t.file == name}
    stages = sorted(out.glob("pp*"))
    assert [s.name for s in stages] == ["pp0", "pp1"]
    for stage in stages:
        files, _ = get_checkpoint_shard_files(str(stage), str(stage / INDEX))
        PretrainedConfig.get_config_dict(str(stage))
        assert (stage / "config.json").read_bytes() == (source / "config.json").read_bytes()
        for file in files:
            with safe_open(file, "pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
            for name, t in ref.read_safetensors(Path(file))[1].items():
                s = src.tensors[name]
                assert (t.dtype, t.shape, t.data) == (s.dtype, s.shape, s.data), name


# --------------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def base(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fuzz")
    small = dict(layers=4, experts=2, hidden=32, moe_intermediate=16, vocab=64, shard_bytes=60_000)
    model = Path(tiny.build_checkpoint(root / "model", **small))
    single = Path(tiny.build_checkpoint(root / "single", single_file=True, **small))
    cache = Path(tiny.build_checkpoint(root / "hub", hf_cache=True, **small)).parent.parent
    split = root / "split"
    assert cli.main(["--pp", "2", "--quiet", str(model), str(split)]) == 0
    return {"model": model, "single": single, "cache": cache, "split": split, "elsewhere": single}


CLASSES = ["header", "index", "config", "cache", "stage"]


def make_input(kind: str, rng: random.Random, base: dict[str, Path], work: Path) -> tuple[list, Path, Path]:
    """A mutated input of ``kind`` in ``work``: (the command's arguments, OUT, the source)."""
    out = work / "out"
    if kind == "stage":
        shutil.copytree(base["split"], out)
        mutate_stage(rng, out)
        return ["verify", out], out, base["model"]
    if kind == "cache":
        repo = work / "hub" / base["cache"].name
        shutil.copytree(base["cache"], repo, symlinks=True)
        model = mutate_cache(rng, repo, base["elsewhere"])
        return ["--pp", "2", "--quiet", model, out], out, model
    model = work / "model"
    shutil.copytree(base["single" if kind == "header" and rng.random() < 0.3 else "model"], model)
    if kind == "header":
        mutate_header(rng, rng.choice(sorted(model.glob("*.safetensors"))))
    else:
        path = model / (INDEX if kind == "index" else "config.json")
        path.write_bytes(mutate_json(rng, path.read_bytes()))
    return ["--pp", "2", "--quiet", model, out], out, model


@pytest.mark.parametrize("kind", CLASSES)
def test_fuzz_every_outcome_is_a_clean_refusal_or_a_faithful_split(capsys, base, ref, tmp_path, kind):
    counts: Counter[str] = Counter()
    for seed in range(PER_CLASS):
        rng = random.Random(f"{kind}-{seed}")
        work = tmp_path / str(seed)
        args, out, source = make_input(kind, rng, base, work)
        where = f"{kind} seed {seed}"
        code, stdout, stderr = run_cli(capsys, *args)
        assert "Traceback" not in stderr + stdout, where
        if kind == "stage":
            assert code in (0, 1, 2), (where, code, stderr)
            if code == 0:  # the damage changed nothing that matters (whitespace in a manifest)
                readable_and_equal(base["model"], out, ref)
            counts["passed" if code == 0 else "failed"] += 1
        elif code == 0:
            if source.name.startswith("models--"):  # a cache repo folder: its snapshot of main
                source = source / "snapshots" / (source / "refs" / "main").read_text().strip()
            try:
                readable_and_equal(source, out, ref)
            except Exception as e:
                raise AssertionError(f"{where}: split, but not faithfully: {e}") from e
            counts["split"] += 1
        else:
            try:
                assert_clean_failure(code, stdout, stderr, out)
            except AssertionError as e:
                raise AssertionError(f"{where}: not a clean refusal: {e}") from e
            counts["refused"] += 1
        shutil.rmtree(work)
    with capsys.disabled():
        print(f"\nfuzz {kind}: {PER_CLASS} inputs, {dict(sorted(counts.items()))}")
    # Both outcomes occur: the mutations are neither all fatal nor all harmless.
    assert len(counts) == 2, counts
