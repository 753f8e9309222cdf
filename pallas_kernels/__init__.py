"""Pallas kernels for moejax: FP8 block-scaled and grouped GEMMs, fused token movement.

Public API (layouts as in DeepGEMM: both operands K-major):
  quantize_1x128, quantize_128x128, fp8_gemm, fp8_grouped_gemm, grouped_gemm,
  fp8_linear, fp8_grouped_linear; backend(), set_backend(), use_backend().
Token movement: dispatch, combine, sum_copies (combine's unit-weight form), permute_values,
  quantize_along_tokens, sort_by_expert, inverse_permutation, permute_rows, permute_quantized;
  quantize_weights (an FP8 linear's weights in both layouts), quantize_rows (quantize_1x128
  in one pass), quantize_both_ways (an output gradient for dgrad and wgrad in one pass),
  swiglu_quantize (SwiGLU and its 1x128 FP8 quantization in one pass).
"""
from pallas_kernels.backend import BACKENDS, backend, set_backend, use_backend
from pallas_kernels.fp8_linear import fp8_grouped_linear, fp8_linear
from pallas_kernels.gemm import fp8_gemm, fp8_grouped_gemm, grouped_gemm
from pallas_kernels.movement import (Dispatched, combine, dispatch, inverse_permutation,
                                     permute_quantized, permute_rows, permute_values,
                                     quantize_along_tokens, quantize_both_ways, quantize_rows,
                                     quantize_weights, sort_by_expert, sum_copies,
                                     swiglu_quantize)
from pallas_kernels.quantize import dequantize, quantize_1x128, quantize_128x128

__all__ = [
    "BACKENDS", "backend", "set_backend", "use_backend", "dequantize", "quantize_1x128",
    "quantize_128x128", "fp8_gemm", "fp8_grouped_gemm", "grouped_gemm", "fp8_linear",
    "fp8_grouped_linear", "Dispatched", "dispatch", "combine", "quantize_along_tokens",
    "sort_by_expert", "inverse_permutation", "permute_rows", "permute_values",
    "permute_quantized", "quantize_both_ways", "quantize_rows", "quantize_weights",
    "sum_copies", "swiglu_quantize",
]
