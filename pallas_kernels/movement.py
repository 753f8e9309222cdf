"""Public token-movement ops around a MoE layer: dispatch (sort the T*k token copies by
expert, optionally quantized to FP8 on the way) and combine (un-sort, weight, sum over k);
and the FP8 linears' quantizing passes (along tokens for wgrad, weights into both layouts,
the SwiGLU output for the down projection).

The sort itself is index math on T*k int32 keys, shared by every backend; the passes over
the (T*k, H) data run on the backend chosen in `backend.py` (Triton kernels, the same
kernels interpreted, or the pure-JAX reference in `movement_reference.py`); on the
"mosaic" backend the plain-layout quantize_along_tokens and quantize_both_ways stream
through TMA instead (`mosaic_movement.py`).

Differentiation: the BF16 dispatch's backward is the inverse permutation with the k copies
summed (a combine with unit weights); combine's backward is a weighted dispatch of the
gradient plus one dot per copy for the router weights. The FP8 dispatch is forward-only:
its consumers (an all_to_all, an FP8 GEMM) own the backward, which moves BF16 gradients.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import mosaic_movement, movement_reference, triton_movement
from pallas_kernels.backend import backend
from pallas_kernels.group_schedule import AlignedLayout, aligned_layout
from pallas_kernels.quantize import TILE, cdiv

# Ops whose XLA compile of the reference already runs at the kernel's speed on a GPU, so
# the GPU backends use the reference for them: combine's forward (mostly reads; XLA
# fuses it into one pass, and the kernel ran at 0.82-1.07x XLA's speed on an H100 over
# T = 4096-65536; experiments/bench_movement.py, docs/performance.md).
XLA_MATCHES_ON_GPU: frozenset[str] = frozenset({"combine"})
SORT_KEY_LIMIT = 2**31  # sort_by_expert's keys expert * T*k + position must fit int32


class Dispatched(NamedTuple):
    tokens: jax.Array  # (T*k, H) token copies sorted by expert; FP8 when quantized
    scales: jax.Array | None  # (T*k, ceil(H/128)) FP32 1x128 scales, None for BF16
    group_sizes: jax.Array  # (E,) int32 rows per expert
    permutation: jax.Array  # (T*k,) int32: sorted row j holds flat copy permutation[j]


def _impl(op: str, *shape_dtypes: tuple[tuple[int, ...], jnp.dtype]):
    """The function that runs `op` on the current backend; the reference where XLA matches
    the kernel, or where an operand is too large for the kernels' 32-bit offsets."""
    name = backend()
    fits = all(triton_movement.offsets_fit(shape, dtype) for shape, dtype in shape_dtypes)
    if name == "reference" or not fits or (name != "interpret" and op in XLA_MATCHES_ON_GPU):
        return getattr(movement_reference, op)
    return functools.partial(getattr(triton_movement, op), interpret=name == "interpret")


def sort_by_expert(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(permutation, group_sizes) of a stable sort of the flat (T*k,) expert ids.

    One single-operand sort of the unique keys expert * n + position (stable by
    construction) instead of a key-value argsort; the group sizes come from a binary
    search of the sorted keys, not a bincount (its scatter-add into E counters took as
    long as the sort on an H100: 100-360 us at T*k = 32K-512K).
    """
    flat = expert_ids.reshape(-1).astype(jnp.int32)
    n = flat.shape[0]
    if num_experts * n >= SORT_KEY_LIMIT:
        sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
        return jnp.argsort(flat, stable=True).astype(jnp.int32), sizes
    keys = jax.lax.sort(flat * n + jnp.arange(n, dtype=jnp.int32))
    bounds = jnp.arange(num_experts + 1, dtype=jnp.int32) * n
    starts = jnp.searchsorted(keys, bounds, method="scan_unrolled")
    return keys % n, jnp.diff(starts).astype(jnp.int32)


def _check_copies(op: str, rows: jax.Array, permutation: jax.Array, k: int,
                  copies_of_rows: bool) -> None:
    """Arguments named before a kernel reads them: a wrong k indexes other rows silently
    (``permutation[j] // k``), and k = 0 divided by zero. ``copies_of_rows``: ``rows`` is
    x (T, H), whose k copies the permutation orders, so it has T*k entries."""
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"{op}: k={k!r} must be a positive integer (copies per row)")
    if rows.ndim != 2 or permutation.ndim != 1:
        raise ValueError(f"{op} wants 2-D rows and a 1-D permutation; got {rows.shape}, "
                         f"{permutation.shape}")
    if copies_of_rows and permutation.shape[0] != rows.shape[0] * k:
        raise ValueError(f"{op}: permutation has {permutation.shape[0]} entries; x's "
                         f"{rows.shape[0]} rows with k={k} copies need {rows.shape[0] * k}")


def inverse_permutation(permutation: jax.Array) -> jax.Array:
    """inverse[permutation[j]] = j: where each row went, one store per row."""
    return _impl("inverse_permutation", (permutation.shape, permutation.dtype))(permutation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def permute_rows(x: jax.Array, permutation: jax.Array, k: int) -> jax.Array:
    """Row j of the result is x[permutation[j] // k]: the k copies of each row of x (T, H)
    in ``sort_by_expert``'s order, in x's dtype (dispatch's BF16 pass, without the sort).
    Backward sums each row's k copies of the gradient back (``sum_copies``)."""
    _check_copies("permute_rows", x, permutation, k, copies_of_rows=True)
    shapes = ((x.shape, x.dtype), ((permutation.shape[0], x.shape[1]), x.dtype))
    return _impl("permute", *shapes)(x, permutation, k, quantize=False)[0]


def _permute_rows_fwd(x, permutation, k):
    return permute_rows(x, permutation, k), permutation


def _permute_rows_bwd(k, permutation, ct):
    return sum_copies(ct, permutation, k), None


permute_rows.defvjp(_permute_rows_fwd, _permute_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def sum_copies(y: jax.Array, permutation: jax.Array, k: int) -> jax.Array:
    """(T, H) = the sum of each token's k rows of y (T*k, H, in ``sort_by_expert``'s
    order), in FP32, in y's dtype: ``combine`` with unit weights, the transpose of
    ``permute_rows``. For expert outputs the router weights are already in (the MoE layer
    weights each row inside its expert), so backward keeps only the permutation, where
    ``combine`` keeps y for the weights' gradient."""
    _check_copies("sum_copies", y, permutation, k, copies_of_rows=False)
    return combine(y, permutation, jnp.ones((permutation.shape[0] // k, k), jnp.float32))


def _sum_copies_fwd(y, permutation, k):
    return sum_copies(y, permutation, k), permutation


def _sum_copies_bwd(k, permutation, g):
    return permute_rows(g, permutation, k), None


sum_copies.defvjp(_sum_copies_fwd, _sum_copies_bwd)


@jax.custom_vjp
def permute_values(values: jax.Array, permutation: jax.Array) -> jax.Array:
    """values[permutation] for one value per token copy (values (T*k,), flat copy order):
    e.g. the router weights of the sorted rows. Backward gathers the gradient by the
    inverse permutation. Autodiff's scatter-add there let XLA fuse the gradient's producer
    (a row reduction over the expert width) into the scatter, one reduction per thread:
    4.3 ms of the BF16 `small` step on the H100."""
    return values[permutation]


def _permute_values_fwd(values, permutation):
    return values[permutation], permutation


def _permute_values_bwd(permutation, g):
    return g[inverse_permutation(permutation)], None


permute_values.defvjp(_permute_values_fwd, _permute_values_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def permute_quantized(x: jax.Array, permutation: jax.Array, k: int
                      ) -> tuple[jax.Array, jax.Array]:
    """``permute_rows`` fused with ``quantize_1x128`` of its result (identical values and
    scales) in one read of x: (T*k, H) FP8 and (T*k, ceil(H/128)) FP32 scales.
    Forward-only: its consumers (an all_to_all, an FP8 GEMM) own the backward."""
    _check_copies("permute_quantized", x, permutation, k, copies_of_rows=True)
    n, h = permutation.shape[0], x.shape[1]
    out = (n, h // 4) if triton_movement.packs_fp8(n, h) else (n, h)  # uint32 words or bytes
    shapes = ((x.shape, x.dtype), (out, jnp.float8_e4m3fn if out[1] == h else jnp.uint32))
    return _impl("permute", *shapes)(x, permutation, k, quantize=True)


def _permute_quantized_fwd(x, permutation, k):
    return permute_quantized(x, permutation, k), None


def _permute_quantized_bwd(k, residuals, ct):
    raise TypeError("dispatch(quantize=True) and permute_quantized are forward-only: "
                    "differentiate the BF16 dispatch, or give the FP8 consumer (all_to_all, "
                    "FP8 GEMM) its own backward")


permute_quantized.defvjp(_permute_quantized_fwd, _permute_quantized_bwd)


def dispatch(x: jax.Array, expert_ids: jax.Array, num_experts: int, *,
             quantize: bool = True) -> Dispatched:
    """Sorts the k copies of each row of x (T, H) by their expert in expert_ids (T, k).

    quantize=True: FP8 E4M3 tokens with 1x128 scales, identical to quantize_1x128 of the
    sorted BF16 rows, in one read of x and one write of the result.
    """
    if x.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != x.shape[0]:
        raise ValueError(f"dispatch wants x (T, H) and expert_ids (T, k); got {x.shape}, "
                         f"{expert_ids.shape}")
    k = expert_ids.shape[1]
    if not isinstance(num_experts, int) or num_experts < 1 or k < 1:
        raise ValueError(f"dispatch wants num_experts >= 1 and k >= 1 experts a row; got "
                         f"num_experts={num_experts!r}, expert_ids {expert_ids.shape}")
    permutation, group_sizes = sort_by_expert(expert_ids, num_experts)
    if quantize:
        tokens, scales = permute_quantized(x, permutation, k)
    else:
        tokens, scales = permute_rows(x, permutation, k), None
    return Dispatched(tokens, scales, group_sizes, permutation)


@jax.custom_vjp
def combine(y: jax.Array, permutation: jax.Array, weights: jax.Array) -> jax.Array:
    """(T, H) = sum over k of weights[t, s] * y[row of copy (t, s)], summed in FP32, in y's
    dtype; y (T*k, H) holds the expert outputs in dispatch's sorted order.

    Backward needs y only for the router weights' gradient (one dot per copy): it keeps y.
    The MoE layer avoids that keep by weighting rows inside the experts (``sum_copies``)."""
    if y.ndim != 2 or weights.ndim != 2 or not y.shape[0] == weights.size == permutation.shape[0]:
        raise ValueError(f"combine wants y (T*k, H), permutation (T*k,), weights (T, k); got "
                         f"{y.shape}, {permutation.shape}, {weights.shape}")
    return _impl("combine", (y.shape, y.dtype))(y, permutation, weights)


def _combine_fwd(y, permutation, weights):
    return combine(y, permutation, weights), (y, permutation, weights)


def _combine_bwd(residuals, g):
    y, permutation, weights = residuals
    dy, dweights = _impl("combine_backward", (y.shape, y.dtype))(g, y, permutation, weights)
    return dy, None, dweights


combine.defvjp(_combine_fwd, _combine_bwd)


def quantize_along_tokens(x: jax.Array, layout: AlignedLayout | None = None,
                          scale: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """quantize_1x128(x.T) for wgrad, read straight from row-major x (M, K): (K, M) FP8 and
    (K, ceil(M/128)) FP32 scales, with no separate transpose pass. With a
    `group_schedule.AlignedLayout`, the tokens land in its tile-aligned layout: (K, R) and
    (K, R/128), each group's tokens starting on a 128-token tile, zeros between. With a
    `scale`, x is FP8 with 1x128 scales along K (M, ceil(K/128)) and is dequantized on the
    way (an FP8 linear's saved input, re-quantized along tokens in the same pass)."""
    if x.ndim != 2:
        raise ValueError(f"quantize_along_tokens wants x (M, K), got {x.shape}")
    if scale is not None and scale.shape != (x.shape[0], cdiv(x.shape[1], TILE)):
        raise ValueError(f"quantize_along_tokens wants scale (M, ceil(K/128)) for x "
                         f"{x.shape}, got {scale.shape}")
    if (backend() == "mosaic" and layout is None and scale is None
            and mosaic_movement.applies(x.shape, x.dtype)):
        return mosaic_movement.quantize_along_tokens(x)
    shapes = ((x.shape, x.dtype), (x.shape, jnp.float8_e4m3fn))
    return _impl("quantize_along_tokens", *shapes)(x, layout, scale)


def quantize_both_ways(x: jax.Array, layout: AlignedLayout | None = None
                       ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """An FP8 linear's output gradient x (M, K), read once and quantized for both GEMMs that
    take it: ``quantize_1x128(x)`` for dgrad and ``quantize_along_tokens(x, layout)`` for
    wgrad, bit for bit (4 arrays: values and scales of each). Rows the layout leaves out
    (past the groups' sum) are not written in the first pair on the GPU: no GEMM uses
    them. ``layout`` None: one group of all M rows (a dense linear's gradient), which the
    "mosaic" backend streams through TMA where the shape fits
    (`mosaic_movement.both_ways_applies`)."""
    if x.ndim != 2:
        raise ValueError(f"quantize_both_ways wants x (M, K), got {x.shape}")
    if layout is None:
        if backend() == "mosaic" and mosaic_movement.both_ways_applies(x.shape, x.dtype):
            return mosaic_movement.quantize_both_ways(x)
        layout = aligned_layout(jnp.array([x.shape[0]], jnp.int32), x.shape[0])
    shapes = ((x.shape, x.dtype), (x.shape, jnp.float8_e4m3fn),
              ((x.shape[1], layout.length), jnp.float8_e4m3fn))
    return _impl("quantize_both_ways", *shapes)(x, layout)


def quantize_weights(w: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """An FP8 linear's weights w (G, K, N), as stored, quantized per 128x128 block once and
    written in both layouts: (G, K, N) FP8 for dgrad, (G, N, K) FP8 for fprop (the WGMMA
    kernels read FP8 operands K-major), and their shared (G, ceil(K/128), ceil(N/128)) FP32
    scales. Bit-identical to ``quantize_128x128`` of each w[g] and its transpose."""
    if w.ndim != 3:
        raise ValueError(f"quantize_weights wants w (G, K, N), got {w.shape}")
    return _impl("quantize_weights", (w.shape, w.dtype), (w.shape, jnp.float8_e4m3fn))(w)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``quantize.quantize_1x128(x)`` of x (M, K), values and scales bit for bit, in one
    pass over x on the GPU backends (XLA's compile of it reads x twice: an amax pass and a
    quantizing pass, at about 60% of copy bandwidth on the FP8 step's (98304, 704)
    gradients; docs/performance.md, session 36)."""
    if x.ndim != 2:
        raise ValueError(f"quantize_rows wants x (M, K), got {x.shape}")
    return _impl("quantize_rows", (x.shape, x.dtype), (x.shape, jnp.float8_e4m3fn))(x)


def swiglu_quantize(gate: jax.Array, up: jax.Array, *, with_inputs: bool = False
                    ) -> tuple[jax.Array, ...]:
    """quantize_1x128(SwiGLU(gate, up)) of the 16-bit (M, I) gate and up rows, with SwiGLU in
    FP32 rounded to gate's dtype first: one read of gate and up, one write of the (M, I) FP8
    rows and (M, ceil(I/128)) scales. ``with_inputs``: then also quantize_1x128(gate) and
    quantize_1x128(up), values and scales, from the same read (an FP8 SwiGLU linear keeps
    them for backward; XLA's compile of those two took an amax pass and a quantizing pass
    each)."""
    if gate.ndim != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu_quantize wants gate and up of one (M, I) shape and dtype, got "
                         f"{gate.shape} {gate.dtype} and {up.shape} {up.dtype}")
    return _impl("swiglu_quantize", (gate.shape, gate.dtype), (gate.shape, jnp.float8_e4m3fn))(
        gate, up, with_inputs=with_inputs)
