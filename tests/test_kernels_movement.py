"""Token-movement ops (dispatch, combine, transposed quantization) against independent
references: NumPy index math, `quantize_1x128`, float64 sums, jax.grad of the pure-JAX
reference. CPU runs the kernels in Pallas interpret mode; `-m gpu` runs them as Triton,
and the streamed Mosaic GPU quantize_along_tokens on a Hopper.

Fresh random inputs per check; kernel outputs start as NaN (interpret mode's fill, or an
explicit poisoned buffer) so an unwritten element fails the comparison.
"""
from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import movement, movement_reference as ref
from pallas_kernels import mosaic_movement as mm, triton_movement as tm
from pallas_kernels.fp8_linear import fp8_swiglu_grouped_linear
from pallas_kernels.group_schedule import aligned_layout, gather_aligned

SMALL = tm.MoveConfig(block_rows=16, block_cols=256)  # tiles smaller than every T, H below
# (tokens, k, experts, routing): T never a multiple of a tile; one expert only; empty experts.
ROUTINGS = [(37, 1, 5, "random"), (45, 8, 16, "random"), (33, 4, 8, "one expert"),
            (50, 2, 12, "two experts")]


def _rng(request) -> np.random.Generator:
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def _expert_ids(rng, tokens, k, experts, routing) -> np.ndarray:
    if routing == "one expert":
        return np.full((tokens, k), experts // 2, np.int32)
    if routing == "two experts":  # every other expert stays empty
        return rng.choice([0, experts - 1], (tokens, k)).astype(np.int32)
    return np.argsort(rng.random((tokens, experts)), axis=1)[:, :k].astype(np.int32)  # top-k


def _bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8) if a.dtype == jnp.float8_e4m3fn else np.asarray(a)


def _rel64(out, ref64: np.ndarray) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "non-finite output (unwritten element?)"
    return float(np.linalg.norm(out - ref64) / np.linalg.norm(ref64))


@pytest.mark.parametrize("tokens,k,experts,routing", ROUTINGS)
def test_sort_by_expert_is_a_stable_sort(request, monkeypatch, tokens, k, experts, routing):
    ids = _expert_ids(_rng(request), tokens, k, experts, routing)
    want = np.argsort(ids.reshape(-1), kind="stable")
    sizes = np.bincount(ids.reshape(-1), minlength=experts)
    perm, group_sizes = pk.sort_by_expert(jnp.asarray(ids), experts)
    np.testing.assert_array_equal(perm, want)
    np.testing.assert_array_equal(group_sizes, sizes)
    monkeypatch.setattr(movement, "SORT_KEY_LIMIT", 0)  # the argsort path for huge E * T * k
    perm, group_sizes = pk.sort_by_expert(jnp.asarray(ids), experts)
    np.testing.assert_array_equal(perm, want)
    np.testing.assert_array_equal(group_sizes, sizes)


@pytest.mark.parametrize("tokens,k,experts,routing", ROUTINGS)
@pytest.mark.parametrize("hidden", [300, 256])
def test_permute_kernel_is_bitwise_the_gather(request, tokens, k, experts, routing, hidden):
    rng = _rng(request)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * 4, jnp.bfloat16)
    ids = _expert_ids(rng, tokens, k, experts, routing)
    perm = np.argsort(ids.reshape(-1), kind="stable").astype(np.int32)
    rows = np.asarray(x)[perm // k]  # every copy once, sorted by expert
    rows_q, scales = pk.quantize_1x128(jnp.asarray(rows))
    n, nb = tokens * k, -(-hidden // 128)
    poison = (jnp.full((n, hidden), jnp.nan, jnp.float8_e4m3fn), jnp.full((n, nb), jnp.nan))
    q, s = tm.permute(x, jnp.asarray(perm), k, quantize=True, cfg=SMALL, interpret=True,
                      out_init=poison)
    np.testing.assert_array_equal(_bits(q), _bits(rows_q))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(scales))
    plain, none = tm.permute(x, jnp.asarray(perm), k, quantize=False, cfg=SMALL, interpret=True)
    assert none is None
    np.testing.assert_array_equal(np.asarray(plain).view(np.uint16), rows.view(np.uint16))


def test_permute_packs_fp8_rows_into_words_bitwise(request):
    """The layout used where an FP8 byte buffer would pass Pallas Triton's 32-bit offsets."""
    rng = _rng(request)
    x = jnp.asarray(rng.standard_normal((37, 384)) * 4, jnp.bfloat16)
    perm = jnp.asarray(rng.permutation(37 * 3).astype(np.int32))
    q, s = tm.permute(x, perm, 3, quantize=True, cfg=SMALL, interpret=True, packed=True)
    want_q, want_s = pk.quantize_1x128(x[perm // 3])
    np.testing.assert_array_equal(_bits(q), _bits(want_q))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    assert tm.packs_fp8(2**19, 7168) and not tm.packs_fp8(2**17, 7168)


def test_permute_blocks_narrow_to_the_rows(request):
    """The default 2048-wide FP8 tile is cut to H's power of two (H = 1024 runs 1024-wide
    tiles, not half-masked ones), and the cut tile still writes every row exactly."""
    cfg = tm.QUANTIZED_PERMUTE_CONFIG
    assert [tm._narrowed(cfg, h).block_cols for h in (7168, 1024, 1000, 100)] == [
        2048, 1024, 1024, 128]
    rng = _rng(request)
    x = jnp.asarray(rng.standard_normal((21, 384)) * 4, jnp.bfloat16)
    perm = jnp.asarray(rng.permutation(21 * 2).astype(np.int32))
    q, s = tm.permute(x, perm, 2, quantize=True, interpret=True)  # 512-wide tile, 3 of 4 used
    want_q, want_s = pk.quantize_1x128(x[perm // 2])
    np.testing.assert_array_equal(_bits(q), _bits(want_q))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))


def test_quantized_permute_propagates_nan_like_quantize_1x128(request):
    x = jnp.asarray(_rng(request).standard_normal((9, 256)), jnp.float32).at[4, 200].set(jnp.nan)
    perm = jnp.arange(9, dtype=jnp.int32)[::-1]
    q, s = tm.permute(x, perm, 1, quantize=True, cfg=SMALL, interpret=True)
    want_q, want_s = pk.quantize_1x128(x[perm])
    np.testing.assert_array_equal(np.isnan(np.asarray(s)), np.isnan(np.asarray(want_s)))
    assert np.isnan(np.asarray(s)[4, 1]) and np.isfinite(np.asarray(s)[4, 0])
    fin = np.isfinite(np.asarray(want_q, np.float32))
    np.testing.assert_array_equal(_bits(q)[fin], _bits(want_q)[fin])


@pytest.mark.parametrize("tokens,k,experts,routing", ROUTINGS[:2])
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-7), (jnp.bfloat16, 4e-3)])
def test_combine_kernel_matches_float64(request, tokens, k, experts, routing, dtype, tol):
    rng = _rng(request)
    hidden = 300
    ids = _expert_ids(rng, tokens, k, experts, routing)
    perm = np.argsort(ids.reshape(-1), kind="stable").astype(np.int32)
    y = jnp.asarray(rng.standard_normal((tokens * k, hidden)), dtype)
    w = rng.random((tokens, k)).astype(np.float32)
    y64 = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
    want = np.zeros((tokens, hidden))
    for row, copy in enumerate(perm):
        want[copy // k] += w[copy // k, copy % k] * y64[row]
    poison = (jnp.full((tokens, hidden), jnp.nan, dtype),)
    out = tm.combine(y, jnp.asarray(perm), jnp.asarray(w), cfg=SMALL, interpret=True,
                     out_init=poison)
    assert out.dtype == dtype and _rel64(out, want) <= tol


def test_combine_backward_kernel_matches_float64(request):
    rng = _rng(request)
    tokens, k, hidden = 29, 3, 300
    perm = rng.permutation(tokens * k).astype(np.int32)
    g, y = rng.standard_normal((tokens, hidden)), rng.standard_normal((tokens * k, hidden))
    w = rng.random((tokens, k))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    dy, dw = tm.combine_backward(f32(g), f32(y), jnp.asarray(perm), f32(w), cfg=SMALL,
                                 interpret=True)
    g, y, w = (np.asarray(f32(a), np.float64) for a in (g, y, w))
    want_dy = w.reshape(-1)[perm][:, None] * g[perm // k]
    want_dw = np.zeros(tokens * k)
    want_dw[perm] = np.sum(g[perm // k] * y, axis=1)
    assert _rel64(dy, want_dy) <= 1e-6 and _rel64(dw, want_dw.reshape(tokens, k)) <= 1e-6


def test_sum_copies_is_the_unit_weight_combine_and_keeps_only_the_order(request):
    """``sum_copies``: forward bitwise equal to ``combine`` with unit weights; its gradient
    is each token's gradient copied to its k rows (float64 check); what backward keeps
    is the permutation alone, nothing of y's size."""
    rng = _rng(request)
    tokens, k, hidden = 41, 4, 384
    perm = jnp.asarray(rng.permutation(tokens * k).astype(np.int32))
    y = jnp.asarray(rng.standard_normal((tokens * k, hidden)), jnp.bfloat16)
    g = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    out, pullback = jax.vjp(lambda y: pk.sum_copies(y, perm, k), y)
    np.testing.assert_array_equal(out, pk.combine(y, perm, jnp.ones((tokens, k), jnp.float32)))
    (dy,) = pullback(g)
    np.testing.assert_array_equal(np.asarray(dy, np.float64),
                                  np.asarray(g, np.float64)[np.asarray(perm) // k])
    kept = [x for x in jax.tree.leaves(pullback) if hasattr(x, "shape")]
    assert all(x.size <= perm.size for x in kept), [x.shape for x in kept]


def test_permute_values_gradient_is_the_inverse_gather(request):
    """``permute_values``: values[permutation], and its gradient equals autodiff's of the
    plain indexing (a scatter-add), here a gather by the inverse permutation."""
    rng = _rng(request)
    n = 6 * 41
    perm = jnp.asarray(rng.permutation(n).astype(np.int32))
    values, g = (jnp.asarray(rng.standard_normal(n), jnp.float32) for _ in range(2))
    out, pullback = jax.vjp(lambda v: pk.permute_values(v, perm), values)
    want, want_pullback = jax.vjp(lambda v: v[perm], values)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(pullback(g)[0], want_pullback(g)[0])


@pytest.mark.parametrize("m,kdim,sizes", [(300, 200, None), (128, 64, None), (77, 129, None),
                                          (300, 200, [0, 1, 127, 129, 2]),  # aligned layout
                                          (77, 129, [77])])
def test_quantize_along_tokens_is_quantize_1x128_of_the_transpose(request, m, kdim, sizes):
    x = jnp.asarray(_rng(request).standard_normal((m, kdim)) * 3, jnp.bfloat16)
    layout = None if sizes is None else aligned_layout(jnp.asarray(sizes, jnp.int32), m)
    width = m if layout is None else layout.length
    poison = (jnp.full((kdim, width), jnp.nan, jnp.float8_e4m3fn),
              jnp.full((kdim, -(-width // 128)), jnp.nan))
    q, s = tm.quantize_along_tokens(x, layout, interpret=True, out_init=poison)
    want_q, want_s = pk.quantize_1x128((x if layout is None else gather_aligned(x, layout)).T)
    np.testing.assert_array_equal(_bits(q), _bits(want_q))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))


@pytest.mark.parametrize("m,kdim,sizes", [(300, 200, [0, 1, 127, 129, 2]),  # 41 rows left out
                                          (256, 384, [256]), (77, 129, [77]),
                                          (300, 130, [300, 0])])
def test_quantize_both_ways_is_quantize_1x128_and_along_tokens(request, m, kdim, sizes):
    """One read, both quantizations bitwise (interpreted; every output poisoned): along K
    for each row the layout holds, along the tokens into the aligned layout, with a 1e4x
    outlier that only its own row tile and token tile may feel."""
    x = _rng(request).standard_normal((m, kdim)) * 3
    x[m // 3, kdim // 2] = 3e4
    x = jnp.asarray(x, jnp.bfloat16)
    layout = aligned_layout(jnp.asarray(sizes, jnp.int32), m)
    width, covered = layout.length, int(sum(sizes))
    poison = (jnp.full((m, kdim), jnp.nan, jnp.float8_e4m3fn),
              jnp.full((m, -(-kdim // 128)), jnp.nan),
              jnp.full((kdim, width), jnp.nan, jnp.float8_e4m3fn),
              jnp.full((kdim, width // 128), jnp.nan))
    got = tm.quantize_both_ways(x, layout, interpret=True, out_init=poison)
    want = (*pk.quantize_1x128(x), *pk.quantize_1x128(gather_aligned(x, layout).T))
    for a, b in zip(got[:2], want[:2]):  # rows past the groups' sum: left unwritten
        np.testing.assert_array_equal(_bits(a)[:covered], _bits(b)[:covered])
    for a, b in zip(got[2:], want[2:]):
        np.testing.assert_array_equal(_bits(a), _bits(b))
    for a, b in zip(pk.quantize_both_ways(x, layout), want):  # the public op (reference here)
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_quantize_both_ways_names_a_wrong_rank_and_tile():
    layout = aligned_layout(jnp.asarray([128], jnp.int32), 128)
    with pytest.raises(ValueError, match=r"x \(M, K\)"):
        pk.quantize_both_ways(jnp.zeros((128,), jnp.bfloat16), layout)
    with pytest.raises(ValueError, match="128 x 128 tiles, got block_rows=16, block_cols=256"):
        tm.quantize_both_ways(jnp.zeros((128, 256), jnp.bfloat16), layout, cfg=SMALL,
                              interpret=True)


@pytest.mark.parametrize("m", [256, 300])
def test_quantize_both_ways_without_a_layout_is_one_group_of_all_rows(request, m):
    """layout None (a dense linear's gradient) is the one-group aligned layout: tokens in
    place, the last tile zero-padded where M is not a multiple of 128."""
    x = jnp.asarray(_rng(request).standard_normal((m, 256)) * 3, jnp.bfloat16)
    one_group = aligned_layout(jnp.asarray([m], jnp.int32), m)
    for name in ("reference", "interpret"):
        with pk.use_backend(name):
            got, want = pk.quantize_both_ways(x), pk.quantize_both_ways(x, one_group)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    assert got[2].shape == (256, one_group.length)


@pytest.mark.parametrize("m,dense,plain", [(256, True, True), (300, True, False),
                                           (256, False, False)])
def test_fp8_linear_backward_hands_a_dense_gradient_over_without_a_layout(monkeypatch, m,
                                                                          dense, plain):
    """The dense FP8 linear's dy goes to quantize_both_ways with no layout (the streamed
    kernel's case) where M is a multiple of 128; a grouped linear's, or a ragged M's, with
    its aligned layout. The gradients are the same either way (the reference runs both)."""
    fp8 = importlib.import_module("pallas_kernels.fp8_linear")
    seen = []

    def spy(dy, layout=None):
        seen.append(layout)
        return movement.quantize_both_ways(dy, layout)

    monkeypatch.setattr(fp8, "quantize_both_ways", spy)
    rng = np.random.default_rng(m)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((256, 128)) * 0.05, jnp.float32)
    if dense:
        loss = lambda x, w: jnp.sum(pk.fp8_linear(x, w).astype(jnp.float32) ** 2)  # noqa: E731
    else:
        sizes = jnp.asarray([m // 2, m - m // 2], jnp.int32)
        loss = lambda x, w: jnp.sum(pk.fp8_grouped_linear(  # noqa: E731
            x, jnp.stack([w, -w]), sizes).astype(jnp.float32) ** 2)
    with pk.use_backend("reference"):
        grads = jax.grad(loss, argnums=(0, 1))(x, w)
    assert (seen[-1] is None) == plain
    assert all(np.all(np.isfinite(np.asarray(g, np.float32))) for g in grads)


@pytest.mark.parametrize("m,kdim,sizes", [(300, 200, None), (77, 384, None),
                                          (300, 200, [0, 1, 127, 129, 2])])
def test_quantize_along_tokens_from_fp8_requantizes_the_dequantized_rows(request, m, kdim,
                                                                         sizes):
    """FP8 x with its 1x128 scales along K: dequantized in registers, then as BF16 x."""
    x = jnp.asarray(_rng(request).standard_normal((m, kdim)) * 3, jnp.float32)
    xq, xs = pk.quantize_1x128(x)
    layout = None if sizes is None else aligned_layout(jnp.asarray(sizes, jnp.int32), m)
    width = m if layout is None else layout.length
    poison = (jnp.full((kdim, width), jnp.nan, jnp.float8_e4m3fn),
              jnp.full((kdim, -(-width // 128)), jnp.nan))
    q, s = tm.quantize_along_tokens(xq, layout, xs, interpret=True, out_init=poison)
    rows = xq.astype(jnp.float32) * jnp.repeat(xs, 128, axis=1)[:, :kdim]  # independent dequant
    want_q, want_s = pk.quantize_1x128((rows if layout is None else gather_aligned(rows, layout)).T)
    np.testing.assert_array_equal(_bits(q), _bits(want_q))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    np.testing.assert_array_equal(_bits(pk.quantize_along_tokens(xq, layout, xs)[0]), _bits(q))


@pytest.mark.parametrize("shape", [(2, 300, 200), (1, 128, 256), (3, 77, 129)])
def test_quantize_weights_is_quantize_128x128_in_both_layouts(request, shape):
    """Every block read once, written as is and transposed, with the reference's bits."""
    w = jnp.asarray(_rng(request).standard_normal(shape) * 3, jnp.float32)
    g, k, n = shape
    poison = (jnp.full((g, k, n), jnp.nan, jnp.float8_e4m3fn),
              jnp.full((g, n, k), jnp.nan, jnp.float8_e4m3fn),
              jnp.full((g, -(-k // 128), -(-n // 128)), jnp.nan))
    q, q_t, s = tm.quantize_weights(w, interpret=True, out_init=poison)
    for i in range(g):
        want_q, want_s = pk.quantize_128x128(w[i])
        want_qt, want_st = pk.quantize_128x128(w[i].T)
        np.testing.assert_array_equal(_bits(q[i]), _bits(want_q))
        np.testing.assert_array_equal(_bits(q_t[i]), _bits(want_qt))
        np.testing.assert_array_equal(np.asarray(s[i]), np.asarray(want_s))
        np.testing.assert_array_equal(np.asarray(s[i]).T, np.asarray(want_st))
    for got, want in zip(pk.quantize_weights(w), (q, q_t, s)):
        np.testing.assert_array_equal(_bits(got), _bits(want))


def _swiglu64(gate, up) -> np.ndarray:
    g, u = (np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (gate, up))
    return g / (1 + np.exp(-g)) * u


def _dequantized64(q, s) -> np.ndarray:
    return np.asarray(pk.dequantize(q, s, row_tile=1), np.float64)


def _check_swiglu_quantized(q, s, gate, up, exact: bool) -> None:
    """Against the reference and an independent float64 SwiGLU. ``exact``: bitwise the
    reference. Else (Triton's exp is not XLA's) a few BF16 roundings land one ulp apart,
    and where that moves a tile's amax the whole tile re-rounds: the dequantized rows then
    agree with the reference's to well under one E4M3 ulp on average (a wrong tile, mask
    or scale is off by order one)."""
    want_q, want_s = jax.jit(ref.swiglu_quantize)(gate, up)
    if exact:
        np.testing.assert_array_equal(_bits(q), _bits(want_q))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    else:
        assert _rel64(_dequantized64(q, s), _dequantized64(want_q, want_s)) <= 1e-2
    assert _rel64(_dequantized64(q, s), _swiglu64(gate, up)) <= 0.04  # E4M3: 2^-4 half-ulps


@pytest.mark.parametrize("rows,cols", [(45, 704), (16, 256), (33, 130)])
def test_swiglu_quantize_is_quantize_1x128_of_swiglu(request, rows, cols):
    """Interpret mode: bitwise the reference on the CPU, where both run XLA:CPU's SiLU."""
    rng = _rng(request)
    gate, up = (jnp.asarray(rng.standard_normal((rows, cols)) * 3, jnp.bfloat16) for _ in "gu")
    poison = (jnp.full((rows, cols), jnp.nan, jnp.float8_e4m3fn),
              jnp.full((rows, -(-cols // 128)), jnp.nan))
    q, s = tm.swiglu_quantize(gate, up, cfg=SMALL, interpret=True, out_init=poison)
    if jax.default_backend() != "cpu":
        # Interpreted on a GPU, the body runs through XLA:GPU, whose excess precision may
        # skip the BF16 rounding; the compiled kernel is checked by the GPU test below.
        assert _rel64(_dequantized64(q, s), _swiglu64(gate, up)) <= 0.04
        return
    _check_swiglu_quantized(q, s, gate, up, exact=True)
    _check_swiglu_quantized(*pk.swiglu_quantize(gate, up), gate, up, exact=True)


@pytest.mark.parametrize("rows,cols,dtype", [(45, 704, jnp.bfloat16), (33, 130, jnp.bfloat16),
                                            (16, 256, jnp.float32)])
def test_quantize_rows_is_quantize_1x128(request, rows, cols, dtype):
    """The one-pass kernel (interpreted) and the public op: bitwise quantize_1x128, with an
    outlier, an all-zero tile and a tile past the last whole 128 columns; outputs poisoned."""
    x = _rng(request).standard_normal((rows, cols)) * 3
    x[rows // 2, 3], x[1, :128] = 3e4, 0.0
    x = jnp.asarray(x, dtype)
    poison = (jnp.full((rows, cols), jnp.nan, jnp.float8_e4m3fn),
              jnp.full((rows, -(-cols // 128)), jnp.nan))
    want_q, want_s = pk.quantize_1x128(x)
    for q, s in (tm.quantize_rows(x, cfg=SMALL, interpret=True, out_init=poison),
                 pk.quantize_rows(x)):
        np.testing.assert_array_equal(_bits(q), _bits(want_q))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))


def test_quantize_rows_names_a_wrong_rank():
    with pytest.raises(ValueError, match=r"x \(M, K\)"):
        pk.quantize_rows(jnp.zeros((2, 4, 128), jnp.bfloat16))


@pytest.mark.parametrize("rows,cols", [(45, 704), (33, 130)])
def test_swiglu_quantize_with_inputs_adds_quantize_1x128_of_gate_and_up(request, rows, cols):
    """The inputs' copies from the same pass: bitwise quantize_1x128 of gate and of up,
    each tile with its own scale (one gate row holds a 1e4x outlier), the SwiGLU output
    unchanged; every output poisoned first."""
    rng = _rng(request)
    gate, up = (rng.standard_normal((rows, cols)) * 3 for _ in "gu")
    gate[rows // 2, 5] = 3e4
    gate, up = (jnp.asarray(a, jnp.bfloat16) for a in (gate, up))
    poison = (jnp.full((rows, cols), jnp.nan, jnp.float8_e4m3fn),
              jnp.full((rows, -(-cols // 128)), jnp.nan)) * 3
    got = tm.swiglu_quantize(gate, up, with_inputs=True, cfg=SMALL, interpret=True,
                             out_init=poison)
    assert len(got) == 6
    if jax.default_backend() == "cpu":
        _check_swiglu_quantized(*got[:2], gate, up, exact=True)
    for (q, s), x in zip((got[2:4], got[4:]), (gate, up)):
        want_q, want_s = pk.quantize_1x128(x)
        np.testing.assert_array_equal(_bits(q), _bits(want_q))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    for a, b in zip(pk.swiglu_quantize(gate, up, with_inputs=True), got):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def test_swiglu_quantize_names_mismatched_inputs():
    with pytest.raises(ValueError, match="one \\(M, I\\) shape and dtype"):
        pk.swiglu_quantize(jnp.zeros((4, 256), jnp.bfloat16), jnp.zeros((4, 128), jnp.bfloat16))


def test_quantize_weights_names_a_wrong_rank():
    with pytest.raises(ValueError, match=r"w \(G, K, N\)"):
        pk.quantize_weights(jnp.zeros((4, 256), jnp.float32))


def test_quantize_along_tokens_names_a_wrong_scale_shape():
    with pytest.raises(ValueError, match=r"scale \(M, ceil\(K/128\)\)"):
        pk.quantize_along_tokens(jnp.zeros((4, 256), jnp.float8_e4m3fn), None,
                                 jnp.ones((4, 1), jnp.float32))


def _moe_loss(dispatch, combine, probe, experts):
    """A scalar through dispatch -> a per-row nonlinearity -> combine, as the MoE uses them."""
    def loss(x, ids, w):
        tokens, perm = dispatch(x, ids, experts)
        y = jnp.tanh(tokens.astype(jnp.float32)).astype(x.dtype) * 1.5
        return jnp.sum(combine(y, perm, w).astype(jnp.float32) * probe)
    return loss


def _public_dispatch(x, ids, experts):
    sent = pk.dispatch(x, ids, experts, quantize=False)
    return sent.tokens, sent.permutation


def _reference_dispatch(x, ids, experts):
    perm, _ = pk.sort_by_expert(ids, experts)
    return ref.permute(x, perm, ids.shape[1], quantize=False)[0], perm


@pytest.mark.parametrize("backend", ["interpret", "reference"])
@pytest.mark.parametrize("tokens,k,experts,routing", [ROUTINGS[1], ROUTINGS[2]])
def test_gradients_match_jax_grad_of_the_reference(request, backend, tokens, k, experts,
                                                   routing):
    rng = _rng(request)
    hidden = 300
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    ids = jnp.asarray(_expert_ids(rng, tokens, k, experts, routing))
    w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    probe = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    want = jax.grad(_moe_loss(_reference_dispatch, ref.combine, probe, experts),
                    argnums=(0, 2))(x, ids, w)
    with pk.use_backend(backend):
        got = jax.grad(_moe_loss(_public_dispatch, pk.combine, probe, experts),
                       argnums=(0, 2))(x, ids, w)
    for g, r in zip(got, want):
        assert _rel64(g, np.asarray(r, np.float64)) <= 1e-6


def test_public_ops_agree_across_backends(request):
    rng = _rng(request)
    tokens, k, experts, hidden = 45, 8, 16, 300
    x = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.bfloat16)
    ids = jnp.asarray(_expert_ids(rng, tokens, k, experts, "random"))
    w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    out = {}
    for backend in ("interpret", "reference"):
        with pk.use_backend(backend):
            sent = pk.dispatch(x, ids, experts)
            plain = pk.dispatch(x, ids, experts, quantize=False)
            out[backend] = (sent, pk.combine(plain.tokens, plain.permutation, w),
                            pk.quantize_along_tokens(x))
    (a, ca, qa), (b, cb, qb) = out["interpret"], out["reference"]
    np.testing.assert_array_equal(_bits(a.tokens), _bits(b.tokens))
    np.testing.assert_array_equal(a.scales, b.scales)
    np.testing.assert_array_equal(a.group_sizes, b.group_sizes)
    np.testing.assert_array_equal(a.permutation, b.permutation)
    assert a.group_sizes.sum() == tokens * k
    np.testing.assert_allclose(np.asarray(ca, np.float32), np.asarray(cb, np.float32),
                               rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(_bits(qa[0]), _bits(qb[0]))


def test_fp8_dispatch_refuses_differentiation():
    x = jnp.ones((4, 128), jnp.float32)
    ids = jnp.zeros((4, 2), jnp.int32)
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda x: jnp.sum(pk.dispatch(x, ids, 2).scales))(x)


def test_shape_errors_name_the_operands():
    with pytest.raises(ValueError, match="expert_ids"):
        pk.dispatch(jnp.ones((4, 128)), jnp.zeros((5, 2), jnp.int32), 2)
    with pytest.raises(ValueError, match="weights"):
        pk.combine(jnp.ones((8, 128)), jnp.arange(8), jnp.ones((3, 2)))


def test_offsets_fit_marks_the_fp8_buffers_pallas_triton_would_wrap():
    assert tm.offsets_fit((2**20, 2**10), jnp.float8_e4m3fn)
    assert not tm.offsets_fit((2**21, 2**10), jnp.float8_e4m3fn)  # 2 GiB of 1-byte elements
    assert not tm.offsets_fit((2**21, 2**10), jnp.bfloat16)  # exactly 4 GiB: still 32-bit
    assert tm.offsets_fit((2**21 + 1, 2**10), jnp.bfloat16)  # over 4 GiB: 64-bit offsets


@pytest.mark.parametrize("n", [1, 511, 512, 1300])
def test_inverse_permutation_kernel_inverts(request, n):
    perm = _rng(request).permutation(n).astype(np.int32)
    got = tm.inverse_permutation(jnp.asarray(perm), interpret=True)
    np.testing.assert_array_equal(np.asarray(got), np.argsort(perm))


@pytest.mark.parametrize("op", ["permute_fp8", "permute_fp8_words", "permute", "combine",
                                "combine_backward", "quantize_along_tokens",
                                "quantize_along_tokens_from_fp8", "inverse_permutation",
                                "quantize_weights", "quantize_rows", "quantize_both_ways",
                                "swiglu_quantize",
                                "swiglu_quantize_with_inputs"])
def test_triton_kernels_lower_for_cuda(op):
    """The Triton lowering (not the interpreter) accepts every kernel: caught here, on CPU,
    before a GPU is needed."""
    t, k, h = 37, 3, 300
    x, perm = jax.ShapeDtypeStruct((t, h), jnp.bfloat16), jax.ShapeDtypeStruct((t * k,), jnp.int32)
    w, y = jax.ShapeDtypeStruct((t, k), jnp.float32), jax.ShapeDtypeStruct((t * k, h), jnp.bfloat16)
    fn, args = {
        "permute_fp8": (lambda x, p: tm.permute(x, p, k, quantize=True), (x, perm)),
        "permute_fp8_words": (lambda x, p: tm.permute(x, p, k, quantize=True, packed=True),
                              (x, perm)),
        "permute": (lambda x, p: tm.permute(x, p, k, quantize=False), (x, perm)),
        "combine": (tm.combine, (y, perm, w)),
        "combine_backward": (tm.combine_backward, (x, y, perm, w)),
        "quantize_along_tokens": (tm.quantize_along_tokens, (x,)),
        "quantize_along_tokens_from_fp8": (
            lambda x, s: tm.quantize_along_tokens(x, None, s),
            (jax.ShapeDtypeStruct((t, h), jnp.float8_e4m3fn),
             jax.ShapeDtypeStruct((t, 3), jnp.float32))),
        "inverse_permutation": (tm.inverse_permutation, (perm,)),
        "quantize_weights": (tm.quantize_weights,
                             (jax.ShapeDtypeStruct((k, t, h), jnp.float32),)),
        "quantize_rows": (tm.quantize_rows, (x,)),
        "quantize_both_ways": (
            lambda x, p: tm.quantize_both_ways(x, aligned_layout(p[:4], t)), (x, perm)),
        "swiglu_quantize": (tm.swiglu_quantize, (x, x)),
        "swiglu_quantize_with_inputs": (
            lambda g, u: tm.swiglu_quantize(g, u, with_inputs=True), (x, x)),
    }[op]
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # the scatter-form kernels run the inverse permutation's kernel first
    inverted = op.startswith(("permute", "combine"))
    assert text.count("xla.gpu.triton") == 1 + inverted


def test_fp8_swiglu_linear_quantizes_each_operand_in_one_pass():
    """Lowered for CUDA on the Triton backend, the FP8 SwiGLU down projection's forward and
    backward hold no `quantize_rows` pass: gate's and up's FP8 copies come from the SwiGLU
    pass itself, and dy's two quantizations from one `quantize_both_ways` (session 36:
    XLA's separate passes cost the `small` FP8 step 8 ms)."""
    m, i, n = 256, 256, 128
    sizes = jnp.asarray([100, 156], jnp.int32)
    rows = jax.ShapeDtypeStruct((m, i), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((2, i, n), jnp.float32)
    dy = jax.ShapeDtypeStruct((m, n), jnp.bfloat16)
    grads = jax.grad(lambda g, u, w, dy: jnp.sum(
        fp8_swiglu_grouped_linear(g, u, w, sizes).astype(jnp.float32) * dy), argnums=(0, 1, 2))
    with pk.use_backend("triton"):
        text = jax.jit(grads).trace(rows, rows, w, dy).lower(lowering_platforms=("cuda",)).as_text()
    kernels = {re.search(r'name = "([a-z_]+)"', line).group(1)
               for line in text.splitlines() if "xla.gpu.triton" in line}
    assert kernels == {"weights_transpose_quantize", "swiglu_quantize", "grouped_gemm",
                       "quantize_both_ways", "transpose_quantize", "grouped_wgrad_gemm"}


@pytest.mark.parametrize("field,value,allowed", [("block_cols", 96, "64 or 128"),
                                                 ("steps", 6, "multiple of 4"),
                                                 ("depth", 1, "[2, steps=8]")])
def test_stream_config_names_a_bad_field(field, value, allowed):
    with pytest.raises(ValueError, match=rf"{field}={value}: .*{re.escape(allowed)}"):
        mm.StreamConfig(**{field: value})


@pytest.mark.parametrize("tokens,steps", [(4096, 8), (1536, 4), (512, 4), (640, None),
                                          (4000, None)])
def test_stream_config_takes_the_most_steps_that_tile_the_tokens(tokens, steps):
    cfg = mm.StreamConfig().for_tokens(tokens)
    assert (cfg and cfg.steps) == steps
    if cfg:
        assert (tokens // 128) % cfg.steps == 0 and cfg.depth <= cfg.steps


@pytest.mark.parametrize("shape,dtype,takes", [
    ((4096, 2048), jnp.bfloat16, True), ((512, 64), jnp.float16, True),
    ((4096, 2048), jnp.float32, False),  # the register transpose shuffles 16-bit pairs
    ((4096, 2000), jnp.bfloat16, False), ((4000, 2048), jnp.bfloat16, False),
    ((4096,), jnp.bfloat16, False)])
def test_streamed_quantize_along_tokens_says_what_it_takes(shape, dtype, takes):
    assert mm.applies(shape, dtype) == takes
    if not takes and len(shape) == 2:
        with pytest.raises(ValueError, match=re.escape(f"got {shape}")):
            mm.quantize_along_tokens(jnp.zeros(shape, dtype))


@pytest.mark.parametrize("op,shape,cfg", [
    ("along_tokens", (4096, 2048), mm.StreamConfig()),
    ("along_tokens", (1536, 384), mm.StreamConfig(block_cols=128, depth=4)),
    ("both_ways", (4096, 384), mm.BOTH_WAYS_CONFIG),
    ("both_ways", (1536, 256), mm.StreamConfig(block_cols=128, depth=2))])
def test_streamed_kernels_lower_for_cuda(op, shape, cfg):
    """Traced and lowered for a GPU on the CPU (register layouts, the TMA pipeline), with
    the documented outputs: the both-ways kernel's row scales come back (M, K/128)."""
    kernel = getattr(mm, f"quantize_{op}")
    lowered = jax.jit(lambda x: kernel(x, cfg=cfg)).trace(
        jax.ShapeDtypeStruct(shape, jnp.bfloat16)).lower(lowering_platforms=("cuda",))
    assert "mosaic_gpu" in lowered.as_text()
    (m, k), f8 = shape, jnp.float8_e4m3fn
    rows = [((m, k), f8), ((m, k // 128), jnp.float32)] if op == "both_ways" else []
    assert [(o.shape, o.dtype) for o in lowered.out_info] == rows + [
        ((k, m), f8), ((k, m // 128), jnp.float32)]


@pytest.mark.parametrize("shape,dtype,ctas_per_sm,takes", [
    ((65536, 1408), jnp.bfloat16, 1, True), ((16384, 2048), jnp.float16, 1, True),
    ((16384, 1024), jnp.bfloat16, 1, False),  # 128 CTAs on 132 SMs: Triton's
    ((65536, 1408), jnp.bfloat16, 8, False),  # a GPU with 8x the SMs
    ((65536, 1000), jnp.bfloat16, 1, False), ((65536, 1408), jnp.float32, 1, False),
    ((65000, 1408), jnp.bfloat16, 1, False)])
def test_streamed_quantize_both_ways_says_what_it_takes(monkeypatch, shape, dtype,
                                                        ctas_per_sm, takes):
    monkeypatch.setattr(mm, "sm_count", lambda: 132 * ctas_per_sm)
    assert mm.both_ways_applies(shape, dtype) == takes


def test_streamed_quantize_both_ways_names_a_shape_and_config_it_cannot_take():
    with pytest.raises(ValueError, match=re.escape("got (4096, 1000) bfloat16")):
        mm.quantize_both_ways(jnp.zeros((4096, 1000), jnp.bfloat16))
    with pytest.raises(ValueError, match="block_cols=64"):
        mm.quantize_both_ways(jnp.zeros((4096, 1024), jnp.bfloat16), cfg=mm.StreamConfig())


# ---- on a GPU: the Triton kernels at model shapes -------------------------------------

@pytest.mark.parametrize("tokens,hidden,k,experts", [(1000, 7168, 8, 256), (777, 2048, 6, 64)])
@pytest.mark.gpu
def test_gpu_dispatch_combine_and_grads(tokens, hidden, k, experts):
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)) * 3, jnp.bfloat16)
    ids = jnp.asarray(_expert_ids(rng, tokens, k, experts, "random"))
    w = jnp.asarray(rng.random((tokens, k)), jnp.float32)
    with pk.use_backend("triton"):
        sent = jax.jit(lambda x, i: pk.dispatch(x, i, experts))(x, ids)
        plain = jax.jit(lambda x, i: pk.dispatch(x, i, experts, quantize=False))(x, ids)
        mixed = jax.jit(pk.combine)(plain.tokens, plain.permutation, w)
        qt = jax.jit(pk.quantize_along_tokens)(x)
    perm = np.argsort(np.asarray(ids).reshape(-1), kind="stable")
    np.testing.assert_array_equal(sent.permutation, perm)
    rows = np.asarray(x)[perm // k]
    want_q, want_s = pk.quantize_1x128(jnp.asarray(rows))
    np.testing.assert_array_equal(_bits(sent.tokens), _bits(want_q))
    np.testing.assert_array_equal(np.asarray(sent.scales), np.asarray(want_s))
    np.testing.assert_array_equal(np.asarray(plain.tokens).view(np.uint16), rows.view(np.uint16))
    words, _ = jax.jit(lambda x, p: tm.permute(x, p, k, quantize=True, packed=True))(
        x, sent.permutation)
    np.testing.assert_array_equal(_bits(words), _bits(want_q))
    x64 = np.asarray(jnp.asarray(x, jnp.float32), np.float64)
    assert _rel64(mixed, x64 * np.asarray(w, np.float64).sum(1, keepdims=True)) <= 4e-3
    want_qt = pk.quantize_1x128(x.T)
    np.testing.assert_array_equal(_bits(qt[0]), _bits(want_qt[0]))
    np.testing.assert_array_equal(np.asarray(qt[1]), np.asarray(want_qt[1]))
    xf = x.astype(jnp.float32)
    probe = jnp.asarray(rng.standard_normal((tokens, hidden)), jnp.float32)
    want = jax.grad(_moe_loss(_reference_dispatch, ref.combine, probe, experts),
                    argnums=(0, 2))(xf, ids, w)
    with pk.use_backend("triton"):
        got = jax.jit(jax.grad(_moe_loss(_public_dispatch, pk.combine, probe, experts),
                               argnums=(0, 2)))(xf, ids, w)
    for g, r in zip(got, want):
        assert _rel64(g, np.asarray(r, np.float64)) <= 1e-5



def _fp8_bits_match(got, want) -> None:
    """FP8 arrays equal bit for bit, NaNs anywhere one is NaN (their sign bits may differ)."""
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
    fin = ~np.isnan(w)
    np.testing.assert_array_equal(_bits(got)[fin], _bits(want)[fin])


def _quantized_match(got, want) -> None:
    """Each pair of a quantization's outputs equal: FP8 values as `_fp8_bits_match`, FP32
    scales exactly."""
    for a, b in zip(got, want, strict=True):
        if b.dtype == jnp.float8_e4m3fn:
            _fp8_bits_match(a, b)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
def test_gpu_quantizing_kernels_leave_the_clamp_to_the_fp8_cast():
    """Compiled, the kernels drop quantize_1x128's clamp (the GPU's E4M3 cast saturates).
    Tiles along both axes with a 1e4x outlier, tiny values, values at the smallest normal
    (their scale underflows), all-equal values, inf and NaN still give its exact bits (also
    both ways at once, in an aligned layout that leaves rows out), and re-quantizing x's
    FP8 copy along tokens gives the reference's; so do the same tiles quantized as weight
    blocks."""
    rng = np.random.default_rng(18)
    t, h = 512, 1024
    x = rng.standard_normal((t, h)).astype(np.float32)
    x[0, 7], x[40, 20] = 3e4, 3e4
    x[1], x[:, 21] = 1e-30 * x[1], 1e-30 * x[:, 21]
    x[2, :128], x[:128, 22] = 1.2e-38, 1.2e-38
    x[3], x[:, 23] = 2.5, 2.5
    x[4, 9], x[70, 24] = np.inf, -np.inf
    x[5, 11], x[80, 25] = np.nan, np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    perm = jnp.asarray(rng.permutation(t).astype(np.int32))
    with pk.use_backend("triton"):
        q, s = jax.jit(lambda x, p: tm.permute(x, p, 1, quantize=True))(x, perm)
        qt, st = jax.jit(pk.quantize_along_tokens)(x)
        rows_q, rows_s = jax.jit(pk.quantize_rows)(x)
    want_rows_q, want_rows_s = pk.quantize_1x128(x)
    _fp8_bits_match(rows_q, want_rows_q)
    np.testing.assert_array_equal(np.asarray(rows_s), np.asarray(want_rows_s))
    layout = aligned_layout(jnp.asarray([100, 0, 300], jnp.int32), t)  # 112 rows left out
    with pk.use_backend("triton"):
        both = jax.jit(pk.quantize_both_ways)(x, layout)
    want_t = jax.jit(ref.quantize_along_tokens)(x, layout)
    _quantized_match([got[:400] if got.shape[0] == t else got for got in both],
                     (want_rows_q[:400], want_rows_s[:400], *want_t))
    want_q, want_s = pk.quantize_1x128(x[perm])
    _fp8_bits_match(q, want_q)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))
    want_qt, want_st = pk.quantize_1x128(x.T)
    _fp8_bits_match(qt, want_qt)
    np.testing.assert_array_equal(np.asarray(st), np.asarray(want_st))
    xq, xs = jax.jit(pk.quantize_1x128)(x)  # and from FP8, as an FP8 linear's saved input
    with pk.use_backend("triton"):
        rq, rs = jax.jit(pk.quantize_along_tokens)(xq, None, xs)
    want_rq, want_rs = jax.jit(ref.quantize_along_tokens)(xq, None, xs)
    _fp8_bits_match(rq, want_rq)
    np.testing.assert_array_equal(np.asarray(rs), np.asarray(want_rs))
    square = x[:, :t].astype(jnp.float32)  # the same special tiles, as 128x128 weight blocks
    w = jnp.stack([square, square.T])
    with pk.use_backend("triton"):
        q, q_t, s = jax.jit(pk.quantize_weights)(w)
    want_q, want_qt, want_s = jax.jit(ref.quantize_weights)(w)
    _fp8_bits_match(q, want_q)
    _fp8_bits_match(q_t, want_qt)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))


@pytest.mark.gpu
def test_gpu_swiglu_quantize_tracks_xla():
    """The Triton kernel at an expert-row shape against XLA's compile of the reference."""
    rng = np.random.default_rng(20)
    gate, up = (jnp.asarray(rng.standard_normal((4096, 704)) * 3, jnp.bfloat16) for _ in "gu")
    with pk.use_backend("triton"):
        q, s = jax.jit(pk.swiglu_quantize)(gate, up)
        with_inputs = jax.jit(functools.partial(pk.swiglu_quantize, with_inputs=True))(gate, up)
    _check_swiglu_quantized(q, s, gate, up, exact=False)
    np.testing.assert_array_equal(_bits(with_inputs[0]), _bits(q))
    np.testing.assert_array_equal(np.asarray(with_inputs[1]), np.asarray(s))
    for (got_q, got_s), x in zip((with_inputs[2:4], with_inputs[4:]), (gate, up)):
        want_q, want_s = pk.quantize_1x128(x)  # XLA's compile, as the step ran it
        _fp8_bits_match(got_q, want_q)
        np.testing.assert_array_equal(np.asarray(got_s), np.asarray(want_s))


def _special_tiles(tokens: int, hidden: int) -> jax.Array:
    """Random BF16 rows with special 1x128 tiles along both axes: a 1e4x outlier, tiny
    values, the smallest normal, all-equal, all-zero, inf and NaN."""
    rng = np.random.default_rng(tokens + hidden)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32) * 3
    x[0, 7], x[300, 20] = 3e4, -3e4
    x[128:256, 21] *= 1e-30
    x[:128, 22] = 1.2e-38
    x[256:384, 23] = 2.5
    x[384:512, 24] = 0.0
    x[4, 9], x[70, 25] = np.inf, -np.inf
    x[5, 11], x[200, 26] = np.nan, np.nan
    x[400, 128:256] = 0.0  # an all-zero row tile
    return jnp.asarray(x, jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.mosaic
@pytest.mark.parametrize("tokens,hidden,cfg", [(4096, 2048, mm.StreamConfig()),
                                               (1536, 192, mm.StreamConfig()),
                                               (1024, 384, mm.StreamConfig(block_cols=128))])
def test_gpu_streamed_quantize_along_tokens_is_bitwise_the_reference(tokens, hidden, cfg):
    """The TMA-streamed kernel is quantize_1x128 of x.T bit for bit, special tiles included.
    Its buffers first hold another input's results, so an unwritten tile would show."""
    x = _special_tiles(tokens, hidden)
    run = jax.jit(lambda x: mm.quantize_along_tokens(x, cfg=cfg))
    jax.block_until_ready(run(x[::-1] * 2))
    q, s = run(x)
    want_q, want_s = jax.jit(ref.quantize_along_tokens)(x)
    _fp8_bits_match(q, want_q)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(want_s))


@pytest.mark.gpu
@pytest.mark.mosaic
def test_gpu_public_quantize_along_tokens_streams_where_the_kernel_applies():
    """The mosaic backend runs the streamed kernel for the plain layout, Triton for an
    aligned layout, FP8 input or a shape it does not take; all equal the reference."""
    rng = np.random.default_rng(24)
    x = jnp.asarray(rng.standard_normal((1024, 256)), jnp.bfloat16)
    layout = aligned_layout(jnp.asarray([300, 0, 724], jnp.int32), 1024)
    xq, xs = jax.jit(pk.quantize_1x128)(x)
    cases = [((x,), "mosaic_gpu"), ((x, layout), "triton"), ((xq, None, xs), "triton"),
             ((x[:1000],), "triton")]
    with pk.use_backend("mosaic"):
        for args, kernel in cases:
            call = jax.jit(pk.quantize_along_tokens)
            assert kernel in call.trace(*args).lower().as_text()
            got, want = call(*args), jax.jit(ref.quantize_along_tokens)(*args)
            _fp8_bits_match(got[0], want[0])
            np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


@pytest.mark.gpu
@pytest.mark.mosaic
@pytest.mark.parametrize("tokens,hidden,cfg", [(4096, 2048, mm.BOTH_WAYS_CONFIG),
                                               (1536, 256, mm.BOTH_WAYS_CONFIG),
                                               (1024, 384, mm.StreamConfig(128, 4, 2))])
def test_gpu_streamed_quantize_both_ways_is_bitwise_the_reference(tokens, hidden, cfg):
    """Both quantizations of the TMA-streamed kernel are the reference's bit for bit (rows
    1x128 along H, x.T 1x128 along the tokens), special tiles included, its buffers first
    holding another input's results."""
    x = _special_tiles(tokens, hidden)
    run = jax.jit(lambda x: mm.quantize_both_ways(x, cfg=cfg))
    jax.block_until_ready(run(x[::-1] * 2))
    got = run(x)
    _quantized_match(got, (*jax.jit(pk.quantize_1x128)(x), *jax.jit(ref.quantize_along_tokens)(x)))


@pytest.mark.gpu
@pytest.mark.mosaic
def test_gpu_public_quantize_both_ways_streams_where_the_kernel_applies():
    """The mosaic backend streams a dense gradient (no layout) that fills the GPU, and runs
    Triton for an aligned layout or too few CTAs; all equal the reference."""
    rng = np.random.default_rng(56)
    big = jnp.asarray(rng.standard_normal((8192, 2176)), jnp.bfloat16)  # 8 x 17 CTAs
    small = big[:1024, :256]
    layout = aligned_layout(jnp.asarray([3000, 0, 5192], jnp.int32), 8192)
    cases = [((big,), "mosaic_gpu"), ((big, layout), "triton"), ((small,), "triton")]
    with pk.use_backend("mosaic"):
        for args, kernel in cases:
            call = jax.jit(pk.quantize_both_ways)
            assert kernel in call.trace(*args).lower().as_text()
            x = args[0]
            lay = args[1] if len(args) > 1 else aligned_layout(
                jnp.asarray([x.shape[0]], jnp.int32), x.shape[0])
            _quantized_match(call(*args), jax.jit(ref.quantize_both_ways)(x, lay))


def test_movement_arguments_are_named_before_a_kernel_reads_them():
    """A wrong k reordered other rows silently; k = 0 divided by zero; num_experts 0 gave
    empty group sizes."""
    x = jnp.ones((8, 256), jnp.bfloat16)
    perm = jnp.arange(16, dtype=jnp.int32)
    with pytest.raises(ValueError, match=r"permute_rows: permutation has 16 entries; x's 8 "
                                         r"rows with k=3 copies need 24"):
        movement.permute_rows(x, perm, 3)
    with pytest.raises(ValueError, match=r"permute_quantized: k=0 must be a positive integer"):
        movement.permute_quantized(x, perm, 0)
    with pytest.raises(ValueError, match=r"sum_copies: k=0 must be a positive integer"):
        movement.sum_copies(jnp.ones((16, 256), jnp.bfloat16), perm, 0)
    with pytest.raises(ValueError, match=r"permute_rows wants 2-D rows and a 1-D permutation"):
        movement.permute_rows(x[0], perm, 2)
    ids = jnp.zeros((8, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"num_experts >= 1 and k >= 1.*num_experts=0"):
        movement.dispatch(x, ids, 0)
    assert movement.permute_rows(x, perm, 2).shape == (16, 256)
