"""Strict header parsing and deterministic header writing, checked against the reference
reader (``safetensors.safe_open``) and the reference writer (``safetensors.torch.save_file``)."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qwen35_reshard.errors import ReshardError
from qwen35_reshard.format.dtypes import DTYPE_SIZES
from qwen35_reshard.source.header import encode_header, read_header


def _raw_file(path, header: dict | bytes, data: bytes = b"", *, pad: bool = True):
    """Write a file from a header object (or raw header bytes) and a data buffer."""
    body = header if isinstance(header, bytes) else json.dumps(header, separators=(",", ":")).encode()
    if pad:
        body += b" " * (-(8 + len(body)) % 8)
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return path


def _entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_reads_what_the_reference_writer_wrote(tmp_path):
    tensors = {
        "b.weight": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4),
        "a.scale": torch.ones(2, 2, dtype=torch.float32),
        "c.fp8": torch.zeros(5, 7, dtype=torch.float8_e4m3fn),
        "d.scalar": torch.tensor(3.0),
    }
    path = tmp_path / "ref.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    expected = json.loads(raw[8 : 8 + n])
    header = read_header(path)
    assert header.data_start == 8 + n
    assert header.file_size == len(raw)
    assert header.metadata == {"format": "pt"}
    assert {t.name for t in header.tensors} == set(tensors)
    for t in header.tensors:
        info = expected[t.name]
        assert (t.dtype, list(t.shape), [t.begin, t.end]) == (
            info["dtype"],
            info["shape"],
            info["data_offsets"],
        )
    begins = [t.begin for t in header.tensors]
    assert begins == sorted(begins)


def test_reads_every_shard_of_a_tiny_checkpoint(make_checkpoint, ref):
    model = make_checkpoint(layout="per_expert_fp8")
    for path in sorted(model.glob("*.safetensors")):
        _, expected = ref.read_safetensors(path)
        header = read_header(path)
        raw = path.read_bytes()
        assert {t.name for t in header.tensors} == set(expected)
        for t in header.tensors:
            e = expected[t.name]
            assert (t.dtype, t.shape) == (e.dtype, e.shape)
            assert raw[header.data_start + t.begin : header.data_start + t.end] == e.data


def _write_encoded(path, specs, fill=lambda i, n: bytes((i + k) % 251 for k in range(n))):
    prefix = encode_header(specs)
    data = b"".join(fill(i, nbytes) for i, (_, _, _, nbytes) in enumerate(specs))
    path.write_bytes(prefix + data)
    return prefix, data


SPECS = [
    ("model.language_model.layers.0.linear_attn.A_log", "F32", (8,), 32),
    ("model.language_model.layers.0.mlp.experts.gate_up_proj", "BF16", (2, 6, 4), 96),
    ("model.language_model.layers.0.mlp.experts.0.up_proj.weight", "F8_E4M3", (3, 5), 15),
    ("scalar", "F32", (), 4),
    ("empty", "BF16", (0, 4), 0),
    ("näme-ü", "I64", (1,), 8),
]


def test_encode_header_round_trips_through_the_reference_reader(tmp_path):
    path = tmp_path / "ours.safetensors"
    prefix, data = _write_encoded(path, SPECS)
    (n,) = struct.unpack("<Q", prefix[:8])
    assert len(prefix) == 8 + n and len(prefix) % 8 == 0  # data starts 8-aligned
    assert prefix[8:9] == b"{"
    obj = json.loads(prefix[8:])
    assert list(obj)[0] == "__metadata__" and obj["__metadata__"] == {"format": "pt"}
    pos = 0
    for name, dtype, shape, nbytes in SPECS:  # back to back, in the given order
        assert obj[name] == _entry(dtype, list(shape), pos, pos + nbytes)
        pos += nbytes
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == {s[0] for s in SPECS}
        for name, dtype, shape, _ in SPECS:
            assert f.get_slice(name).get_dtype() == dtype
            assert tuple(f.get_slice(name).get_shape()) == shape
        assert f.get_tensor("scalar").shape == ()
        last = sum(s[3] for s in SPECS[:-1])
        assert f.get_tensor("näme-ü").item() == int.from_bytes(data[last : last + 8], "little", signed=True)
    header = read_header(path)
    assert [(t.name, t.dtype, t.shape, t.nbytes) for t in header.tensors if t.nbytes] == [
        s for s in SPECS if s[3]
    ]


def test_encode_header_is_deterministic_and_compact():
    a = encode_header(SPECS)
    assert a == encode_header(list(SPECS))
    assert b", " not in a and b": " not in a
    empty = encode_header([])
    assert struct.unpack("<Q", empty[:8])[0] == len(empty) - 8 and len(empty) % 8 == 0
    assert json.loads(empty[8:]) == {"__metadata__": {"format": "pt"}}


@pytest.mark.parametrize("pad", [True, False])
def test_accepts_unpadded_and_padded_headers(tmp_path, pad):
    path = _raw_file(tmp_path / "x.safetensors", {"t": _entry("F32", [2], 0, 8)}, b"\0" * 8, pad=pad)
    header = read_header(path)
    assert header.metadata == {}
    assert [(t.name, t.begin, t.end) for t in header.tensors] == [("t", 0, 8)]


def test_accepts_empty_and_scalar_tensors(tmp_path):
    header = {
        "s": _entry("BF16", [], 0, 2),
        "e": _entry("F32", [0, 3], 2, 2),
        "t": _entry("U8", [3], 2, 5),
    }
    path = _raw_file(tmp_path / "x.safetensors", header, b"abcde")
    assert {t.name: t.nbytes for t in read_header(path).tensors} == {"s": 2, "e": 0, "t": 3}


def test_all_listed_dtypes_have_their_element_size():
    assert DTYPE_SIZES["BF16"] == 2 and DTYPE_SIZES["F8_E4M3"] == 1 and DTYPE_SIZES["F32"] == 4
    assert DTYPE_SIZES["I64"] == 8 and DTYPE_SIZES["BOOL"] == 1


BAD_HEADERS = {
    "hole": ({"a": _entry("F32", [1], 0, 4), "b": _entry("F32", [1], 8, 12)}, 12, "hole"),
    "overlap": ({"a": _entry("F32", [2], 0, 8), "b": _entry("F32", [1], 4, 8)}, 8, "overlaps"),
    "not_at_zero": ({"a": _entry("F32", [1], 4, 8)}, 8, "hole"),
    "trailing_byte": ({"a": _entry("F32", [1], 0, 4)}, 5, "trailing"),
    "truncated": ({"a": _entry("F32", [2], 0, 8)}, 4, "past the end"),
    "size_mismatch": ({"a": _entry("BF16", [3], 0, 4)}, 4, "needs 6"),
    "unknown_dtype": ({"a": _entry("F12", [1], 0, 4)}, 4, "unsupported dtype"),
    "sub_byte_dtype": ({"a": _entry("F4", [2], 0, 1)}, 1, "unsupported dtype"),
    "negative_shape": ({"a": _entry("F32", [-1], 0, 4)}, 4, "invalid shape"),
    "bool_offset": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [False, 1]}}, 1, "data_offsets"),
    "three_offsets": ({"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}}, 1, "data_offsets"),
    "extra_key": ({"a": {**_entry("U8", [1], 0, 1), "x": 1}}, 1, "exactly dtype"),
    "metadata_int": ({"__metadata__": {"format": 1}, "a": _entry("U8", [1], 0, 1)}, 1, "__metadata__"),
    "not_object": ([1, 2], 0, "start with"),
}


@pytest.mark.parametrize("case", sorted(BAD_HEADERS))
def test_rejects_invalid_headers(tmp_path, case):
    header, data_size, needle = BAD_HEADERS[case]
    path = _raw_file(tmp_path / "bad.safetensors", header, b"\1" * data_size)
    with pytest.raises(ReshardError, match=needle) as e:
        read_header(path)
    assert str(path) in str(e.value)


def test_rejects_duplicate_names_that_the_reference_reader_lets_through(tmp_path):
    entry = b'{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}'
    body = b'{"a":' + entry % (0, 1) + b',"a":' + entry % (1, 2) + b"}"
    path = _raw_file(tmp_path / "dup.safetensors", body, b"xy")
    with pytest.raises(ReshardError, match="'a' appears twice"):
        read_header(path)


_U8 = b'{"dtype":"U8","shape":[1],"data_offsets":[%d,%d]}'
# Headers with one repeated key, each where json would silently keep the last one. Parsing
# counts colons to skip the exact (slower) duplicate check; none of these may slip through.
DUPLICATES = {
    "tensor_name_with_colons": (b'{"a:b":' + _U8 % (0, 1) + b',"a:b":' + _U8 % (1, 2) + b"}", "'a:b'"),
    "key_of_an_entry": (b'{"a":{"dtype":"U8","dtype":"U8","shape":[2],"data_offsets":[0,2]}}', "'dtype'"),
    "metadata_key": (b'{"__metadata__":{"format":"pt","format":"pt"},"a":' + _U8 % (0, 2) + b"}", "'format'"),
    "metadata_value_with_colons": (
        b'{"__metadata__":{"k":"1:2:3","k":"4:5:6"},"a":' + _U8 % (0, 2) + b"}",
        "'k'",
    ),
    # An escape can make a ':' that raw bytes do not show (\u003a), balancing the count.
    "escaped_colon_elsewhere": (
        b'{"__metadata__":{"x":"\\u003a"},"a":' + _U8 % (0, 1) + b',"a":' + _U8 % (1, 2) + b"}",
        "'a'",
    ),
    "escaped_name": (b'{"a\\u003a":' + _U8 % (0, 1) + b',"a\\u003a":' + _U8 % (1, 2) + b"}", "'a:'"),
}


@pytest.mark.parametrize("case", sorted(DUPLICATES))
def test_rejects_every_repeated_key(tmp_path, case):
    body, name = DUPLICATES[case]
    path = _raw_file(tmp_path / "dup.safetensors", body, b"xy")
    with pytest.raises(ReshardError, match=f"{name} appears twice"):
        read_header(path)


@pytest.mark.parametrize("empty", ["e:0", "e\u00e9\n"], ids=["colon", "escaped"])
def test_accepts_colons_escapes_and_any_order(tmp_path, empty):
    """What parsing must not refuse: colons (counted) or escapes (checked exactly) in names and
    metadata, tensors listed out of offset order, an empty tensor sharing its begin."""
    header = {
        "__metadata__": {"format": "pt", "note": "a:b"},
        "t:3": _entry("U8", [3], 2, 5),
        empty: _entry("F32", [0, 3], 2, 2),
        "s": _entry("BF16", [], 0, 2),
    }
    path = _raw_file(tmp_path / "x.safetensors", header, b"abcde")
    parsed = read_header(path)
    assert [(t.name, t.begin, t.end) for t in parsed.tensors] == [("s", 0, 2), (empty, 2, 2), ("t:3", 2, 5)]
    assert parsed.metadata == {"format": "pt", "note": "a:b"}


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b' {"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', "start with"),
        (b'{"a":', "not valid JSON"),
        (b'{"\xff":1}', "UTF-8"),
    ],
)
def test_rejects_malformed_header_bytes(tmp_path, body, needle):
    path = _raw_file(tmp_path / "bad.safetensors", body, b"x", pad=False)
    with pytest.raises(ReshardError, match=needle):
        read_header(path)


@pytest.mark.parametrize("where", ["name", "metadata"])
def test_rejects_a_lone_surrogate_escape_as_the_reference_reader_does(tmp_path, where):
    """JSON's \\ud800 names no character: UTF-8 cannot hold it, so the header written for a
    stage could not be encoded (a split crashed after writing its data files). The reference
    reader refuses such a header; so does this one, naming the file."""
    name, meta = (b"a\\ud800", b"pt") if where == "name" else (b"a", b"p\\udc00t")
    body = b'{"__metadata__":{"format":"' + meta + b'"},"' + name + b'":' + _U8 % (0, 1) + b"}"
    path = _raw_file(tmp_path / "s.safetensors", body, b"x")
    with pytest.raises(Exception, match="hex escape"):  # the reference reader's refusal
        with safe_open(str(path), "pt"):
            pass
    with pytest.raises(ReshardError, match="lone surrogate") as e:
        read_header(path)
    assert str(path) in str(e.value)


def test_rejects_short_and_oversized_files(tmp_path):
    short = tmp_path / "short.safetensors"
    short.write_bytes(b"\1\2\3")
    with pytest.raises(ReshardError, match="shorter than 8 bytes"):
        read_header(short)
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 100_000_001) + b"{}")
    with pytest.raises(ReshardError, match="limit"):
        read_header(huge)
    past = tmp_path / "past.safetensors"
    past.write_bytes(struct.pack("<Q", 64) + b"{}")
    with pytest.raises(ReshardError, match="runs past the end"):
        read_header(past)
    with pytest.raises(ReshardError, match="cannot read"):
        read_header(tmp_path / "missing.safetensors")


REFERENCE_REFUSES = {
    **{
        f"metadata_{kind}": ({"__metadata__": value, "a": _entry("U8", [1], 0, 1)}, 1, "__metadata__")
        for kind, value in [("list", []), ("zero", 0), ("false", False), ("empty_string", "")]
    },
    # Zero elements, but the reference reader multiplies the dims in order with overflow checks.
    "element_count_overflows": ({"a": _entry("F32", [2**40, 2**40, 0], 0, 0)}, 0, "64 bits"),
    "dim_past_64_bits": ({"a": _entry("F32", [2**64, 0], 0, 0)}, 0, "64 bits"),
}


@pytest.mark.parametrize("case", sorted(REFERENCE_REFUSES))
def test_refuses_what_the_reference_reader_refuses(tmp_path, case):
    """Stricter than the reference reader means refusing at least what it refuses."""
    header, data_size, needle = REFERENCE_REFUSES[case]
    path = _raw_file(tmp_path / "bad.safetensors", header, b"\1" * data_size)
    with pytest.raises(Exception, match="deserializing header"):
        safe_open(str(path), framework="pt")
    with pytest.raises(ReshardError, match=needle):
        read_header(path)


def test_accepts_a_zero_dim_first_as_the_reference_reader_does(tmp_path):
    path = _raw_file(tmp_path / "x.safetensors", {"a": _entry("F32", [0, 2**40, 2**40], 0, 0)})
    with safe_open(str(path), framework="pt") as f:
        assert list(f.keys()) == ["a"]
    assert read_header(path).tensors[0].shape == (0, 2**40, 2**40)
