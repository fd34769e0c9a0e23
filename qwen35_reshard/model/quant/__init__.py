"""Quantized checkpoints: what each method writes per Linear (``schemes``) and which modules a
checkpoint's config quantizes (``config``)."""

from .config import NONE, QUANT_SIDE_FILE, SIDE_FILES, Quantization, quantization, unchecked_message
from .schemes import FLOAT_DTYPES, FP8_DTYPES, Scheme

__all__ = [
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "NONE",
    "QUANT_SIDE_FILE",
    "SIDE_FILES",
    "Quantization",
    "Scheme",
    "quantization",
    "unchecked_message",
]
