"""The Triton- and Mosaic-GPU-lowered kernels on a real GPU (device tool: -m gpu)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels import mosaic_common
from pallas_kernels import triton_gemm as tg
from pallas_kernels.quantize import dequantize

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


needs_mosaic = pytest.mark.skipif(not mosaic_common.available(), reason="needs sm_90, jax>=0.11")


@needs_mosaic
@pytest.mark.parametrize("m,n,k,sizes", [
    (1300, 2112, 1024, SIZES),  # uneven groups incl. 0/1/127/129 rows, 43 zero rows, N % 128
    (1000, 384, 7168, np.array([1000], np.int32)),  # dense, long K (no chained pipelines)
    (8192, 256, 512, np.array([3000, 0, 5192], np.int32)),  # many tiles per SM (chained)
])
def test_mosaic_fp8_grouped_gemm_gpu(m, n, k, sizes):
    ka, kb = jax.random.split(jax.random.key(m + n + k))
    aq, as_ = pk.quantize_1x128(jax.random.normal(ka, (m, k), jnp.bfloat16))
    bq, bs = jax.vmap(pk.quantize_128x128)(jax.random.normal(kb, (len(sizes), n, k), jnp.bfloat16))
    with pk.use_backend("mosaic"):
        out = np.asarray(pk.fp8_grouped_gemm(aq, as_, bq, bs, jnp.asarray(sizes),
                                              out_dtype=jnp.float32))
    a64 = _ref64(lambda a: a, dequantize(aq, as_, 1))
    b64 = np.stack([_ref64(lambda w: w, dequantize(bq[g], bs[g], 128)) for g in range(len(sizes))])
    ends = np.cumsum(sizes)
    ref = np.zeros((m, n))
    for g, (lo, hi) in enumerate(zip(ends - sizes, ends)):
        ref[lo:hi] = a64[lo:hi] @ b64[g].T
    assert _rel(out[:ends[-1]], ref[:ends[-1]]) <= 1e-3
    assert np.all(out[ends[-1]:] == 0)


@needs_mosaic
def test_mosaic_fp8_gemm_nan_propagates_gpu():
    m, n, k = 256, 256, 256
    ks = jax.random.split(jax.random.key(11), 3)
    a = jax.random.normal(ks[0], (m, k), jnp.bfloat16).at[5, 7].set(jnp.nan)
    aq, as_ = pk.quantize_1x128(a)
    bq, bs = pk.quantize_128x128(jax.random.normal(ks[1], (n, k), jnp.bfloat16))
    with pk.use_backend("mosaic"):
        out = np.asarray(pk.fp8_gemm(aq, as_, bq, bs, out_dtype=jnp.float32))
    assert np.all(np.isnan(out[5])) and np.all(np.isfinite(np.delete(out, 5, axis=0)))


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=needs_mosaic)])
def test_fp8_grouped_linear_grads_gpu(backend):
    m, n, k = 1300, 256, 512
    ks = jax.random.split(jax.random.key(7), 3)
    x = jax.random.normal(ks[0], (m, k), jnp.bfloat16)
    w = jax.random.normal(ks[1], (len(SIZES), n, k), jnp.bfloat16)
    dy = jax.random.normal(ks[2], (m, n), jnp.bfloat16)
    sizes = jnp.asarray(SIZES)
    def grads(name):
        with pk.use_backend(name):
            return jax.grad(lambda x, w: jnp.sum(
                pk.fp8_grouped_linear(x, w, sizes).astype(jnp.float32) * dy),
                argnums=(0, 1))(x, w)

    got, want = grads(backend), grads("reference")
    assert _rel(got[0], want[0]) <= 1e-2 and _rel(got[1], want[1]) <= 1e-2


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=needs_mosaic)])
@pytest.mark.parametrize("m,k,n,sizes", [
    (1300, 512, 384, SIZES),  # uneven groups incl. 0/1/127/129 rows; 128-wide column tiles
    (2048, 1024, 512, np.array([1000, 0, 1000], np.int32)),  # 256-wide tiles, 48 zero rows
    (4096, 256, 384, (lambda r: r.multinomial(4000, r.dirichlet(np.full(64, 0.3))))(
        np.random.default_rng(0)).astype(np.int32)),  # 64 skewed groups, some empty
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


@pytest.mark.parametrize("backend", ["triton", pytest.param("mosaic", marks=needs_mosaic)])
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
