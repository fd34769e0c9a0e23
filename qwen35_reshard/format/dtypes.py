"""The safetensors dtypes the tool handles, with their sizes."""

from __future__ import annotations

# Every dtype the tool handles: safetensors name -> (bytes per element, torch dtype attribute;
# the loader resolves it lazily, so torch is not imported here). Sub-byte float types (F4/F6)
# are rejected: a byte-exact splitter must not guess how they pack.
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"),
    "U8": (1, "uint8"),
    "I8": (1, "int8"),
    "F8_E5M2": (1, "float8_e5m2"),
    "F8_E4M3": (1, "float8_e4m3fn"),
    "F8_E8M0": (1, "float8_e8m0fnu"),
    "I16": (2, "int16"),
    "U16": (2, "uint16"),
    "F16": (2, "float16"),
    "BF16": (2, "bfloat16"),
    "I32": (4, "int32"),
    "U32": (4, "uint32"),
    "F32": (4, "float32"),
    "C64": (8, "complex64"),
    "F64": (8, "float64"),
    "I64": (8, "int64"),
    "U64": (8, "uint64"),
}
DTYPE_SIZES: dict[str, int] = {name: size for name, (size, _) in DTYPES.items()}
