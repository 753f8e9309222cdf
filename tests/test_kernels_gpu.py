"""The Triton- and Mosaic-GPU-lowered kernels on a real GPU (device tool: -m gpu)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import triton_gemm as tg
from pallas_kernels.fp8_linear import fp8_swiglu_grouped_linear
from pallas_kernels.group_schedule import aligned_layout
from pallas_kernels.quantize import dequantize

from moejax.model.layer_scan import layer_scan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")]
SIZES = np.array([0, 1, 127, 129, 300, 700], np.int32)  # 1257 of 1300 rows


def _rel(out, ref) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert np.all(np.isfinite(out))
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _ref64(f, *xs):
    with jax.default_device(jax.devices("cpu")[0]):
        return np.asarray(f(*[np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in xs]))


@pytest.mark.parametrize("m,n,k", [(1000, 2112, 1024), (512, 640, 7168)])
def test_fp8_gemm_gpu(m, n, k):
    ka, kb = jax.random.split(jax.random.key(m + n))
    aq, as_ = pk.quantize_1x128(jax.random.normal(ka, (m, k), jnp.bfloat16))
    bq, bs = pk.quantize_128x128(jax.random.normal(kb, (n, k), jnp.bfloat16))
    poison = jnp.full((m, n), jnp.nan, jnp.float32)
    out = tg.grouped_matmul(aq, bq[None], jnp.array([m], jnp.int32), a_scale=as_, b_scale=bs[None],
                            out_dtype=jnp.float32, out_init=poison)
    ref = _ref64(lambda a, b: a @ b.T, dequantize(aq, as_, 1), dequantize(bq, bs, 128))
    assert _rel(out, ref) <= 1e-3


@pytest.mark.mosaic
@pytest.mark.parametrize("tile_n,split", [(128, False), (128, True), (256, False), (256, True)])
@pytest.mark.parametrize("m,n,k,sizes", [
    (1300, 2112, 1024, SIZES),  # uneven groups incl. 0/1/127/129 rows, 43 zero rows, N % 128
    # (N = 2112 with 256-wide tiles: the last tile's second half lies past N)
    (1000, 384, 7168, np.array([1000], np.int32)),  # dense, long K (no chained pipelines)
    (8192, 256, 512, np.array([3000, 0, 5192], np.int32)),  # many tiles per SM (chained)
    (1300, 704, 704, SIZES),  # the small preset's expert width: partial K step and N tile,
    # 6 K steps: a chained 3-deep ring (MosaicConfig.for_steps)
])
def test_mosaic_fp8_grouped_gemm_gpu(m, n, k, sizes, tile_n, split):
    from pallas_kernels import mosaic_gemm

    ka, kb = jax.random.split(jax.random.key(m + n + k + tile_n + split))
    aq, as_ = pk.quantize_1x128(jax.random.normal(ka, (m, k), jnp.bfloat16))
    bq, bs = jax.vmap(pk.quantize_128x128)(jax.random.normal(kb, (len(sizes), n, k), jnp.bfloat16))
    cfg = mosaic_gemm.MosaicConfig(split=split).with_tile_n(tile_n)
    out = np.asarray(jax.jit(lambda *ops: mosaic_gemm.scaled_grouped_matmul(
        *ops, jnp.asarray(sizes), a_scale=as_, b_scale=bs, out_dtype=jnp.float32, cfg=cfg))(
            aq, bq))
    a64 = _ref64(lambda a: a, dequantize(aq, as_, 1))
    b64 = np.stack([_ref64(lambda w: w, dequantize(bq[g], bs[g], 128)) for g in range(len(sizes))])
    ends = np.cumsum(sizes)
    ref = np.zeros((m, n))
    for g, (lo, hi) in enumerate(zip(ends - sizes, ends)):
        ref[lo:hi] = a64[lo:hi] @ b64[g].T
    assert _rel(out[:ends[-1]], ref[:ends[-1]]) <= 1e-3
    assert np.all(out[ends[-1]:] == 0)


@pytest.mark.mosaic
def test_mosaic_fp8_gemm_nan_propagates_gpu():
    m, n, k = 256, 256, 256
    ks = jax.random.split(jax.random.key(11), 3)
    a = jax.random.normal(ks[0], (m, k), jnp.bfloat16).at[5, 7].set(jnp.nan)
    aq, as_ = pk.quantize_1x128(a)
    bq, bs = pk.quantize_128x128(jax.random.normal(ks[1], (n, k), jnp.bfloat16))
    with pk.use_backend("mosaic"):
        out = np.asarray(pk.fp8_gemm(aq, as_, bq, bs, out_dtype=jnp.float32))
    assert np.all(np.isnan(out[5])) and np.all(np.isfinite(np.delete(out, 5, axis=0)))


def _wgrad_operands(p: int, q: int, sizes: np.ndarray, seed: int, nan_row: int | None = None):
    """x (M, P), y (M, Q) quantized along tokens in the tile-aligned layout of `sizes`
    (43 rows past their sum), and the layout."""
    m = int(sizes.sum()) + 43
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, p), jnp.bfloat16)
    if nan_row is not None:
        x = x.at[nan_row, 5].set(jnp.nan)
    y = jax.random.normal(ky, (m, q), jnp.bfloat16)
    layout = aligned_layout(jnp.asarray(sizes), m)
    return pk.quantize_along_tokens(x, layout), pk.quantize_along_tokens(y, layout), layout


def _mosaic_fp8_wgrad(xq, yq, layout, tile_n: int | None = None, piece: int | None = None,
                      out_dtype=jnp.float32) -> np.ndarray:
    from pallas_kernels import mosaic_gemm

    cfg = mosaic_gemm.MosaicConfig().with_tile_n(tile_n)
    return np.asarray(mosaic_gemm.scaled_grouped_matmul_tn(
        xq[0], yq[0], layout.sizes, x_scale=xq[1], y_scale=yq[1], out_dtype=out_dtype,
        cfg=cfg, piece=piece).astype(jnp.float32))


def _wgrad_ref64(xq, yq, layout) -> np.ndarray:
    x64, y64 = (_ref64(lambda v: v, dequantize(v, s, 1)) for v, s in (xq, yq))
    ends = np.cumsum(np.asarray(layout.sizes))
    return np.stack([x64[:, lo:hi] @ y64[:, lo:hi].T
                     for lo, hi in zip(ends - np.asarray(layout.sizes), ends)])


SKEWED_64 = (lambda r: r.multinomial(4000, r.dirichlet(np.full(64, 0.3))))(
    np.random.default_rng(0)).astype(np.int32)


@pytest.mark.mosaic
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("p,q,sizes,piece", [
    (320, 200, SIZES, None),  # groups of 0/1/127/129 rows; P and Q off the 128 grid
    (512, 384, np.array([1000], np.int32), None),  # dense, long K; a 256 tile's half past Q
    (256, 256, SKEWED_64, None),  # 64 skewed groups, some empty
    (256, 200, np.array([16000], np.int32), None),  # dense, 4 tiles of 125 steps: cut
    (256, 320, SKEWED_64, 1),  # every block its own piece: chains of up to 9 pieces
])
def test_mosaic_fp8_wgrad_gpu(p, q, sizes, piece, tile_n):
    """The wgrad against float64 on the same FP8 inputs; where groups are cut into
    pieces, the in-kernel sum is deterministic (two runs bitwise equal) and a BF16 output
    is the FP32 sum rounded once."""
    from pallas_kernels import mosaic_common, mosaic_gemm

    xq, yq, layout = _wgrad_operands(p, q, sizes, seed=p + q + len(sizes) + tile_n)
    blocks = layout.length // 128
    cfg = mosaic_gemm.MosaicConfig().with_tile_n(tile_n)
    planned = mosaic_gemm.wgrad_plan(cfg, len(sizes), p, q, blocks,
                                     mosaic_common.sm_count())[1]
    cut = (piece or planned) < blocks
    if sizes.sum() > 8000:  # the dense long-K case cuts its tokens
        assert cut
    out = _mosaic_fp8_wgrad(xq, yq, layout, tile_n, piece)
    assert _rel(out, _wgrad_ref64(xq, yq, layout)) <= 1e-3
    assert np.all(out[sizes == 0] == 0)
    if cut:
        np.testing.assert_array_equal(_mosaic_fp8_wgrad(xq, yq, layout, tile_n, piece), out)
        bf16 = _mosaic_fp8_wgrad(xq, yq, layout, tile_n, piece, out_dtype=jnp.bfloat16)
        np.testing.assert_array_equal(bf16, out.astype(jnp.bfloat16).astype(np.float32))


@pytest.mark.mosaic
def test_mosaic_fp8_wgrad_nan_stays_in_its_group_gpu():
    """A NaN in group 2's first token reaches only group 2's gradient: group 1's pieces end
    on the block before it."""
    xq, yq, layout = _wgrad_operands(256, 128, SIZES, seed=3, nan_row=int(SIZES[:2].sum()))
    out = _mosaic_fp8_wgrad(xq, yq, layout)
    assert np.all(np.isnan(out[2, 5])) and np.all(np.isfinite(np.delete(out, 2, axis=0)))
    assert np.all(np.isfinite(np.delete(out[2], 5, axis=0)))


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=pytest.mark.mosaic)])
def test_fp8_grouped_linear_grads_gpu(backend):
    m, n, k = 1300, 256, 512
    ks = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(ks[1], (len(SIZES), k, n), jnp.bfloat16)
    dy = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
    sizes = jnp.asarray(SIZES)
    def grads(name):
        with pk.use_backend(name):
            return jax.grad(lambda x, w: jnp.sum(
                pk.fp8_grouped_linear(x, w, sizes).astype(jnp.float32) * dy),
                argnums=(0, 1))(x, w)

    got, want = grads(backend), grads("reference")
    assert _rel(got[0], want[0]) <= 1e-2 and _rel(got[1], want[1]) <= 1e-2


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=pytest.mark.mosaic)])
def test_fp8_swiglu_grouped_linear_grads_gpu(backend):
    """The SwiGLU down projection, whose forward kernel also writes the FP8 copies of gate
    and up that backward recomputes from: output and all three gradients (gate, up, the
    router weights; the weights) against the reference backend."""
    m, i, n = 1300, 704, 256
    ks = jax.random.split(jax.random.key(8), 5)
    gate, up = (jax.random.normal(key, (m, i), jnp.bfloat16) * 2 for key in ks[:2])
    w = jax.random.normal(ks[2], (len(SIZES), i, n), jnp.float32) / 16
    row_weights = jax.random.uniform(ks[3], (m,), jnp.float32)
    dy = jax.random.normal(ks[4], (m, n), jnp.bfloat16)
    sizes = jnp.asarray(SIZES)

    def run(name):
        with pk.use_backend(name):
            y, pullback = jax.vjp(lambda *a: fp8_swiglu_grouped_linear(*a[:3], sizes, a[3]),
                                  gate, up, w, row_weights)
            return (y, *pullback(dy))

    for got, want in zip(run(backend), run("reference")):
        assert _rel(got, want) <= 2e-2


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=pytest.mark.mosaic)])
@pytest.mark.parametrize("m,k,n,sizes", [
    (1300, 512, 384, SIZES),  # uneven groups incl. 0/1/127/129 rows; 128-wide column tiles
    (1300, 704, 704, SIZES),  # partial last tiles of N (fprop) and of P and Q (wgrad)
    (2048, 1024, 512, np.array([1000, 0, 1000], np.int32)),  # 256-wide tiles, 48 zero rows
    (4096, 256, 384, SKEWED_64),  # 64 skewed groups, some empty
])
@pytest.mark.parametrize("b_dtype", [jnp.bfloat16, jnp.float32])  # FP32: master weights
def test_grouped_gemm_gpu_grads(backend, m, k, n, sizes, b_dtype):
    ks = jax.random.split(jax.random.key(m + k + n), 3)
    a = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    b = jax.random.normal(ks[1], (len(sizes), k, n), jnp.bfloat16).astype(b_dtype)
    dy = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
    sizes_j = jnp.asarray(sizes)
    with pk.use_backend(backend):
        out, vjp = jax.vjp(lambda a, b: pk.grouped_gemm(a, b, sizes_j), a, b)
        da, db = vjp(dy)
    a64, b64, dy64 = (_ref64(lambda v: v, v) for v in (a, b, dy))
    ends = np.cumsum(sizes)
    ref, ref_da, ref_db = np.zeros((m, n)), np.zeros((m, k)), np.zeros(b.shape)
    for g, (lo, hi) in enumerate(zip(ends - sizes, ends)):
        ref[lo:hi] = a64[lo:hi] @ b64[g]
        ref_da[lo:hi] = dy64[lo:hi] @ b64[g].T
        ref_db[g] = a64[lo:hi].T @ dy64[lo:hi]
    used = ends[-1]
    assert _rel(out[:used], ref[:used]) <= 1e-2 and _rel(da[:used], ref_da[:used]) <= 1e-2
    assert np.all(np.asarray(out[used:]) == 0) and np.all(np.asarray(da[used:]) == 0)
    # An FP32 weight gradient comes straight from the FP32 accumulator: no BF16 rounding
    # (which alone is ~1e-3 norm-wise).
    tolerance = 5e-4 if b_dtype == jnp.float32 else 1e-2
    assert db.dtype == b_dtype and _rel(db, ref_db) <= tolerance
    assert np.all(np.asarray(db)[sizes == 0] == 0)


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=pytest.mark.mosaic)])
def test_grouped_gemm_nan_stays_in_its_group_gpu(backend):
    m, k, n = 1300, 256, 256
    ks = jax.random.split(jax.random.key(5), 3)
    a = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    b = jax.random.normal(ks[1], (len(SIZES), k, n), jnp.bfloat16)
    # Row 300 is in group 4 (rows 257-556) and in the 64-row block it shares with group 3.
    dy = jax.random.normal(ks[2], (m, n), jnp.bfloat16).at[300, 7].set(jnp.nan)
    with pk.use_backend(backend):
        _, vjp = jax.vjp(lambda a, b: pk.grouped_gemm(a, b, jnp.asarray(SIZES)), a, b)
        da, db = (np.asarray(v, np.float32) for v in vjp(dy))
    assert np.all(np.isnan(da[300])) and np.all(np.isfinite(np.delete(da, 300, axis=0)))
    assert np.all(np.isnan(db[4][:, 7])) and np.all(np.isfinite(np.delete(db, 4, axis=0)))
    assert np.all(np.isfinite(np.delete(db[4], 7, axis=1)))


@pytest.mark.mosaic
def test_grouped_gemm_runs_once_per_layer_in_a_layer_loop():
    """A forward GEMM output that the layer reads and backward keeps: XLA's dynamic-slice
    fusion must not clone the kernel into the residual stack's write (it did: each forward
    expert GEMM of the `small` step ran twice). One kernel call each for forward, dgrad and
    wgrad in the compiled step (in each layer's, unrolled, but the first layer's dgrad: x0
    is a constant, so XLA drops it), and the gradients still match a per-layer loop."""
    layers, m, k = 3, 512, 256
    sizes = jnp.asarray([200, 0, 312], jnp.int32)
    ks = jax.random.split(jax.random.key(11), 2)
    x0 = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(ks[1], (layers, 3, k, k), jnp.float32) / 16

    def layer(x, w_l, sizes):
        y = pk.grouped_gemm(x, w_l, sizes)
        return x + y * y, None  # backward keeps y; the layer also reads it

    def loss(w, scan):
        return jnp.sum(scan(layer, x0, w, sizes)[0].astype(jnp.float32) ** 2)

    def looped(step, x, ws, consts):
        for w_l in ws:
            x = step(x, w_l, consts)[0]
        return x, None

    with pk.use_backend("mosaic"):
        grad = jax.jit(jax.grad(loss), static_argnums=1)
        scanned = grad.lower(w, layer_scan).compile()
        unrolled = grad.lower(w, functools.partial(layer_scan, unroll=True)).compile()
        got, got_unrolled, want = scanned(w), unrolled(w), grad(w, looped)
    assert scanned.as_text().count('custom_call_target="mosaic_gpu_v2"') == 3
    assert unrolled.as_text().count('custom_call_target="mosaic_gpu_v2"') == 3 * layers - 1
    assert _rel(got, want) <= 1e-2 and _rel(got_unrolled, want) <= 1e-2
