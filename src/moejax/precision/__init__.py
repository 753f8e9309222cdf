"""The FP8 training recipe: which precision a run trains in, and which linear runs where.

``Precision`` is the typed policy; ``moejax.precision.linear`` is the one place that maps
it to an implementation. Only the linears of attention and of the dense, shared and routed
expert MLPs take it; the embedding, output head, router, norms and attention core always
stay in BF16/FP32 (DeepSeek-V3's split).
"""

from moejax.precision.linear import (dense_matmul, grouped_linear, grouped_swiglu_linear, linear,
                                     swiglu, swiglu_linear)
from moejax.precision.policy import PRECISIONS, Precision

__all__ = ["PRECISIONS", "Precision", "dense_matmul", "grouped_linear",
           "grouped_swiglu_linear", "linear", "swiglu", "swiglu_linear"]
