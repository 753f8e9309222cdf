"""The precision policy of a run's GEMMs, as a typed value."""

from __future__ import annotations

import enum


class Precision(enum.Enum):
    """``BF16``: BF16 GEMM inputs, FP32 accumulation. ``FP8``: E4M3 inputs of fprop, dgrad and
    wgrad with online fine-grained scales (1x128 activations, 128x128 weights), FP32
    accumulation, FP8 copies kept for backward."""

    BF16 = "bf16"
    FP8 = "fp8"


PRECISIONS = tuple(p.value for p in Precision)
