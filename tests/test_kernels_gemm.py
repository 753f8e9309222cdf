"""GEMM kernels vs float64 on the same dequantized inputs (CPU: reference + interpret).

Fresh random inputs per check, outputs poisoned with NaN before kernel runs, uneven
group sizes including 0, 1, 127 and 129 rows.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels import triton_gemm as tg
from pallas_kernels.group_schedule import (aligned_layout, aligned_length, gather_aligned,
                                           num_tiles, tile_schedule)
from pallas_kernels.quantize import dequantize

SMALL = tg.TileConfig(block_m=32, block_n=32, block_k=128, num_warps=4, num_stages=2)
SIZES = np.array([0, 1, 127, 129, 40], np.int32)  # sums to 297
FP8_TOL = 1e-3


def _rng(request) -> np.random.Generator:
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


def _normal(rng, shape, dtype=jnp.bfloat16) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _rel(out, ref64: np.ndarray) -> float:
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "non-finite output (unwritten poisoned element?)"
    return float(np.linalg.norm(out - ref64) / np.linalg.norm(ref64))


def _f64(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def _grouped_ref64(a64, b64_gnk, sizes, m):
    out = np.zeros((m, b64_gnk.shape[1]))
    start = 0
    for g, s in enumerate(sizes):
        out[start:start + s] = a64[start:start + s] @ b64_gnk[g].T
        start += s
    return out


def test_quantize_roundtrip_and_layout(request):
    rng = _rng(request)
    x = _normal(rng, (5, 300), jnp.float32) * 10
    q, s = pk.quantize_1x128(x)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == (5, 300) and s.shape == (5, 3)
    assert _rel(dequantize(q, s, 1), _f64(x)) < 0.05
    w = _normal(rng, (200, 256), jnp.float32)
    wq, ws = pk.quantize_128x128(w)
    assert wq.shape == (200, 256) and ws.shape == (2, 2)
    blk = np.abs(_f64(w)[128:, 128:]).max()
    np.testing.assert_allclose(float(ws[1, 1]), blk / 448.0, rtol=1e-6)
    assert _rel(dequantize(wq, ws, 128), _f64(w)) < 0.05


def test_quantize_propagates_nan():
    x = jnp.ones((2, 256), jnp.float32).at[0, 3].set(jnp.nan)
    q, s = pk.quantize_1x128(x)
    assert np.isnan(float(s[0, 0])) and np.isfinite(np.asarray(s)[1]).all()
    # larger and multi-axis reductions: XLA:CPU's float max dropped the NaN there
    big = jnp.zeros((256, 256), jnp.float32).at[5, 7].set(jnp.nan)
    rows, blocks = pk.quantize_1x128(big)[1], pk.quantize_128x128(big)[1]
    assert np.isnan(np.asarray(rows)).tolist() == [[i == 5, False] for i in range(256)]
    assert np.isnan(np.asarray(blocks)).tolist() == [[True, False], [False, False]]


def test_quantizers_take_empty_inputs_and_name_bad_ranks_and_scales():
    q, s = pk.quantize_1x128(jnp.ones((0, 256)))
    assert q.shape == (0, 256) and s.shape == (0, 2)
    with pytest.raises(ValueError, match=r"x must be 2-D \(rows, cols\), got shape \(256,\)"):
        pk.quantize_1x128(jnp.ones((256,)))
    q, s = pk.quantize_1x128(jnp.ones((256, 256)))
    with pytest.raises(ValueError, match=r"scale has shape \(256, 2\); q \(256, 256\) with "
                                         r"row_tile=128 needs \(2, 2\)"):
        dequantize(q, s, 128)
    with pytest.raises(ValueError, match=r"row_tile=2: must be 1"):
        dequantize(q, s, 2)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
@pytest.mark.parametrize("m,n,k", [(200, 72, 256), (64, 160, 384)])
def test_fp8_gemm_matches_float64(request, backend, m, n, k):
    rng = _rng(request)
    a, b = _normal(rng, (m, k)), _normal(rng, (n, k))
    aq, as_ = pk.quantize_1x128(a)
    bq, bs = pk.quantize_128x128(b)
    with pk.use_backend(backend):
        out = pk.fp8_gemm(aq, as_, bq, bs, out_dtype=jnp.float32)
    ref = _f64(dequantize(aq, as_, 1)) @ _f64(dequantize(bq, bs, 128)).T
    assert out.shape == (m, n)
    assert _rel(out, ref) <= FP8_TOL
    print(f"fp8_gemm {m}x{n}x{k} vs unquantized: {_rel(out, _f64(a) @ _f64(b).T):.3e}")


def test_fp8_gemm_rejects_bad_shapes(request):
    rng = _rng(request)
    aq, as_ = pk.quantize_1x128(_normal(rng, (8, 256)))
    bq, bs = pk.quantize_128x128(_normal(rng, (16, 128)))
    with pytest.raises(ValueError, match=r"\(16, 128\)"):
        pk.fp8_gemm(aq, as_, bq, bs)
    with pytest.raises(ValueError, match="a_scale"):
        pk.fp8_gemm(aq, as_[:, :1], *pk.quantize_128x128(_normal(rng, (16, 256))))


def test_fp8_gemm_propagates_nan(request):
    rng = _rng(request)
    a = _normal(rng, (32, 128)).at[3, 5].set(jnp.nan)
    aq, as_ = pk.quantize_1x128(a)
    bq, bs = pk.quantize_128x128(_normal(rng, (32, 128)))
    with pk.use_backend("interpret"):
        out = np.asarray(pk.fp8_gemm(aq, as_, bq, bs, out_dtype=jnp.float32))
    assert np.isnan(out[3]).all() and np.isfinite(np.delete(out, 3, axis=0)).all()


def test_kernel_writes_every_element(request):
    """Poisoned (NaN) output buffers: grouped kernel incl. zero rows past the sum."""
    rng = _rng(request)
    m, n, k = 320, 48, 256
    a, b = _normal(rng, (m, k)), _normal(rng, (len(SIZES), n, k))
    aq, as_ = pk.quantize_1x128(a)
    bq, bs = jax.vmap(pk.quantize_128x128)(b)
    poison = jnp.full((m, n), jnp.nan, jnp.float32)
    out = tg.grouped_matmul(aq, bq, jnp.asarray(SIZES), a_scale=as_, b_scale=bs,
                            out_dtype=jnp.float32, cfg=SMALL, interpret=True, out_init=poison)
    ref = _grouped_ref64(_f64(dequantize(aq, as_, 1)), _f64(dequantize(bq, bs, 128)), SIZES, m)
    assert np.all(np.asarray(out)[SIZES.sum():] == 0)
    assert _rel(out, ref) <= FP8_TOL
    x, y = _normal(rng, (m, 40)), _normal(rng, (m, 24))
    poison = jnp.full((len(SIZES), 40, 24), jnp.nan, jnp.float32)
    out = tg.grouped_matmul_tn(x, y, jnp.asarray(SIZES), out_dtype=jnp.float32, cfg=SMALL,
                               interpret=True, out_init=poison)
    starts = np.concatenate([[0], np.cumsum(SIZES)[:-1]])
    ref = np.stack([_f64(x)[s:s + n_].T @ _f64(y)[s:s + n_] for s, n_ in zip(starts, SIZES)])
    assert np.all(np.asarray(out)[0] == 0)  # the empty group
    assert _rel(out, ref) <= 1e-5


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_fp8_grouped_gemm_matches_float64(request, backend):
    rng = _rng(request)
    m, n, k = 320, 72, 256
    a, b = _normal(rng, (m, k)), _normal(rng, (len(SIZES), n, k))
    aq, as_ = pk.quantize_1x128(a)
    bq, bs = jax.vmap(pk.quantize_128x128)(b)
    with pk.use_backend(backend):
        out = pk.fp8_grouped_gemm(aq, as_, bq, bs, jnp.asarray(SIZES), out_dtype=jnp.float32)
    ref = _grouped_ref64(_f64(dequantize(aq, as_, 1)), _f64(dequantize(bq, bs, 128)), SIZES, m)
    assert _rel(out, ref) <= FP8_TOL
    assert np.all(np.asarray(out)[SIZES.sum():] == 0)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_grouped_gemm_matches_ragged_dot_and_grads(request, backend):
    rng = _rng(request)
    m, k, n = 320, 96, 80
    a, b = _normal(rng, (m, k)), _normal(rng, (len(SIZES), k, n))
    dy = _normal(rng, (m, n), jnp.float32)
    sizes = jnp.asarray(SIZES)

    def loss(fn, a, b):
        return jnp.sum(fn(a, b, sizes).astype(jnp.float32) * dy)

    with pk.use_backend(backend):
        out = pk.grouped_gemm(a, b, sizes)
        da, db = jax.grad(lambda a, b: loss(pk.grouped_gemm, a, b), argnums=(0, 1))(a, b)
    assert out.dtype == jnp.bfloat16
    ref = _grouped_ref64(_f64(a), np.swapaxes(_f64(b), 1, 2), SIZES, m)
    assert _rel(out, ref) <= 1e-2
    ra, rb = jax.grad(lambda a, b: loss(jax.lax.ragged_dot, a, b), argnums=(0, 1))(a, b)
    assert _rel(da, _f64(ra)) <= 1e-2 and _rel(db, _f64(rb)) <= 1e-2


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_fp8_linear_grads_match_reference(request, backend):
    rng = _rng(request)
    x, w = _normal(rng, (160, 256), jnp.float32), _normal(rng, (384, 200), jnp.float32)[:256]
    dy = _normal(rng, (160, 200), jnp.float32)

    def loss(fn, x, w):
        return jnp.sum(fn(x, w) * dy)

    with pk.use_backend(backend):
        y = pk.fp8_linear(x, w)
        dx, dw = jax.grad(lambda x, w: loss(pk.fp8_linear, x, w), argnums=(0, 1))(x, w)
    exact = jax.grad(lambda x, w: loss(lambda x, w: x @ w, x, w), argnums=(0, 1))(x, w)
    assert dw.shape == w.shape  # the weight's own (K, N) layout
    assert _rel(y, _f64(x) @ _f64(w)) < 0.06  # E4M3 rounding of both operands
    assert _rel(dx, _f64(exact[0])) < 0.06 and _rel(dw, _f64(exact[1])) < 0.06


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_fp8_grouped_linear_grads(request, backend):
    rng = _rng(request)
    m, k, n = 320, 256, 72
    x, w = _normal(rng, (m, k), jnp.float32), _normal(rng, (len(SIZES), k, n), jnp.float32)
    dy = _normal(rng, (m, n), jnp.float32)
    sizes = jnp.asarray(SIZES)

    def loss(fn, x, w):
        return jnp.sum(fn(x, w, sizes) * dy)

    def exact_fn(x, w, s):
        return jax.lax.ragged_dot(x, w, s, precision=jax.lax.Precision.HIGHEST)

    with pk.use_backend(backend):
        got = jax.grad(lambda x, w: loss(pk.fp8_grouped_linear, x, w), argnums=(0, 1))(x, w)
    exact = jax.grad(lambda x, w: loss(exact_fn, x, w), argnums=(0, 1))(x, w)
    assert _rel(got[0], _f64(exact[0])) < 0.06 and _rel(got[1], _f64(exact[1])) < 0.06
    assert np.all(np.asarray(got[0])[SIZES.sum():] == 0)


def test_backend_selection_is_visible_and_overridable(monkeypatch):
    assert pk.backend() in pk.BACKENDS
    with pk.use_backend("interpret"):
        assert pk.backend() == "interpret"
    monkeypatch.setenv("MOEJAX_GEMM_BACKEND", "reference")
    assert pk.backend() == "reference"
    with pytest.raises(ValueError, match="mosaic"):  # refused where it cannot run (CPU)
        pk.set_backend("mosaic")


def test_mosaic_bf16_kernels_reject_other_dtypes():
    from pallas_kernels import mosaic_bf16_gemm

    a, sizes = jnp.ones((4, 64), jnp.float32), jnp.array([4], jnp.int32)
    with pytest.raises(ValueError, match="16-bit a and b; got float32"):
        mosaic_bf16_gemm.grouped_matmul(a, jnp.ones((1, 64, 128), jnp.float32), sizes, b_kn=True)
    with pytest.raises(ValueError, match="16-bit x and y; got float32"):
        mosaic_bf16_gemm.grouped_matmul_tn(a, a, sizes)


@pytest.mark.parametrize("field,value", [("epilogue_n", 96), ("epilogue_n", 256),
                                         ("epilogue_slots", 3)])
def test_mosaic_bf16_config_names_a_bad_epilogue(field, value):
    from pallas_kernels import mosaic_bf16_gemm

    with pytest.raises(ValueError, match=f"Bf16Config.{field}={value}: must be"):
        mosaic_bf16_gemm.Bf16Config(**{field: value})


def test_mosaic_kernel_outputs_vary_like_their_operands(monkeypatch):
    """``plgpu.kernel`` types its output as the same on every device; inside a shard_map
    that checks varying axes, each Mosaic op's output must vary over ``expert`` like its
    operands, or a custom_vjp around it gets cotangents of the wrong type (traced on CPU
    with a Hopper's 132 SMs: the kernels are lowered only on the GPU)."""
    from pallas_kernels import mosaic_common

    monkeypatch.setattr(mosaic_common, "sm_count", lambda: 132)
    mesh = jax.make_mesh((2,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:2])
    types = {}

    def body(a, b, sizes, a8, a_scale, b8, b_scale):
        outs = _mosaic_calls(a, b, sizes, a8, a_scale, b8, b_scale)
        types.update({k: jax.typeof(v) for k, v in outs.items()})
        return tuple(outs.values())

    specs = (P("expert"), P(), P("expert"), P("expert"), P("expert"), P(), P())
    kernels = len(jax.eval_shape(_mosaic_calls, *_MOSAIC_OPERANDS))
    jax.make_jaxpr(jax.shard_map(body, mesh=mesh, in_specs=specs,
                                 out_specs=(P("expert"),) * kernels))(*_MOSAIC_OPERANDS)
    assert {k: "expert" in str(t) for k, t in types.items()} == dict.fromkeys(types, True), types


def test_mosaic_kernels_lower_once_per_shape_and_settings(monkeypatch):
    """Each Mosaic GPU entry is a jit, so calls with equal shapes and settings share one
    lowered kernel: a step's identical layers lower and compile it once, not once per call
    site (the FP8 `tiny` step on the H100: lowering 29 -> 12 s, compile 67 -> 34 s;
    docs/performance.md, session 35). Lowered for a GPU from the CPU."""
    from pallas_kernels import mosaic_common

    monkeypatch.setattr(mosaic_common, "sm_count", lambda: 132)

    def twice(*operands):
        return _mosaic_calls(*operands), _mosaic_calls(*operands)

    text = jax.jit(twice).trace(*_MOSAIC_OPERANDS).lower(lowering_platforms=("cuda",)).as_text()
    kernels = len(jax.eval_shape(_mosaic_calls, *_MOSAIC_OPERANDS))  # one of each, not two
    assert text.count("custom_call @mosaic_gpu") == kernels, text.count("custom_call @mosaic_gpu")


def _mosaic_calls(a, b, sizes, a8, a_scale, b8, b_scale) -> dict[str, jax.Array]:
    """One call of each Mosaic GPU kernel on `_MOSAIC_OPERANDS`-shaped inputs."""
    from pallas_kernels import mosaic_bf16_gemm, mosaic_gemm

    return {"bf16_grouped_gemm": mosaic_bf16_gemm.grouped_matmul(a, b, sizes, b_kn=True),
            "bf16_grouped_dgrad_gemm": mosaic_bf16_gemm.grouped_matmul(
                a, b.transpose(0, 2, 1), sizes, b_kn=False),
            "bf16_grouped_wgrad_gemm": mosaic_bf16_gemm.grouped_matmul_tn(a, a, sizes),
            "fp8_grouped_gemm": mosaic_gemm.scaled_grouped_matmul(
                a8, b8, sizes, a_scale=a_scale, b_scale=b_scale),
            "fp8_grouped_wgrad_gemm": mosaic_gemm.scaled_grouped_matmul_tn(
                a8.T, a8.T, sizes * 128, x_scale=a_scale.reshape(a8.shape[1], -1),
                y_scale=a_scale.reshape(a8.shape[1], -1), out_dtype=jnp.float32)}


_MOSAIC_OPERANDS = tuple(jax.ShapeDtypeStruct(s, d) for s, d in (
    ((512, 256), jnp.bfloat16), ((4, 256, 384), jnp.bfloat16), ((8,), jnp.int32),
    ((512, 256), jnp.float8_e4m3fn), ((512, 2), jnp.float32),
    ((4, 384, 256), jnp.float8_e4m3fn), ((4, 3, 2), jnp.float32)))


def test_mosaic_kernels_lower_for_a_hopper_on_cpu(monkeypatch):
    """Every Mosaic GPU kernel traces and lowers (layout inference, the warp-specialized
    pipelines, register layouts) for CUDA on this CPU: what the interpreter cannot run
    (transposed WGMMA operands, FP8 register layouts) is at least compiled to Mosaic GPU's
    IR here. The GPU tests (-m gpu) check the numbers."""
    from pallas_kernels import mosaic_common

    monkeypatch.setattr(mosaic_common, "sm_count", lambda: 132)
    for name in jax.eval_shape(_mosaic_calls, *_MOSAIC_OPERANDS):
        call = jax.jit(lambda *ops, name=name: _mosaic_calls(*ops)[name])
        text = call.trace(*_MOSAIC_OPERANDS).lower(lowering_platforms=("cuda",)).as_text()
        assert name in text


def test_row_kernels_fit_a_walk_table_of_many_groups(monkeypatch):
    """The row walk's table sits in shared memory beside the ring: past 254 groups the
    BF16 kernels give up a ring stage for it (without, 300 groups lowered to 232520 bytes
    of the H100's 232448). At the most groups the table allows, 1022, every row kernel
    still lowers, the FP8 one on its wide tile with FP32 outputs (its largest staging);
    past that the table is refused by name."""
    from pallas_kernels import mosaic_bf16_gemm, mosaic_common, mosaic_gemm

    monkeypatch.setattr(mosaic_common, "sm_count", lambda: 132)
    groups = 1022
    bf16, fp8, f32 = jnp.bfloat16, jnp.float8_e4m3fn, jnp.float32
    wide = mosaic_gemm.MosaicConfig().with_tile_n(mosaic_gemm.WIDE_TILE_N)
    spec = jax.ShapeDtypeStruct
    a, sizes = spec((1024, 256), bf16), spec((groups,), jnp.int32)
    calls = [
        (lambda a, b, s: mosaic_bf16_gemm.grouped_matmul(a, b, s, b_kn=True),
         (a, spec((groups, 256, 384), bf16), sizes)),
        (lambda a, b, s: mosaic_bf16_gemm.grouped_matmul(a, b, s, b_kn=True, out_dtype=f32),
         (a, spec((groups, 256, 384), bf16), sizes)),
        (lambda a, b, s: mosaic_bf16_gemm.grouped_matmul(a, b, s, b_kn=False),
         (a, spec((groups, 384, 256), bf16), sizes)),
        (lambda a, a_s, b, b_s, s: mosaic_gemm.scaled_grouped_matmul(
            a, b, s, a_scale=a_s, b_scale=b_s, out_dtype=f32, cfg=wide),
         (spec((1024, 256), fp8), spec((1024, 2), f32), spec((groups, 512, 256), fp8),
          spec((groups, 4, 2), f32), sizes)),
    ]
    for call, operands in calls:
        jax.jit(call).trace(*operands).lower(lowering_platforms=("cuda",))
    mosaic_common.visit_table(jnp.zeros((groups,), jnp.int32), 64)
    with pytest.raises(ValueError, match="1023 groups: the grouped GEMM kernels take at most "
                                         "1022"):
        mosaic_common.visit_table(jnp.zeros((groups + 1,), jnp.int32), 64)


def test_fp8_wgrad_cuts_long_groups_into_pieces(monkeypatch):
    """Split-K for the FP8 wgrad: a dense layer's tokens are cut where its output tiles
    leave SMs idle (and each piece keeps enough K steps); grouped wgrads cut only a group
    longer than half of an SM's share of the steps. The piece table covers every group's
    blocks once, in order, with ranks and the last piece marked; a cut call sums in an FP32
    kernel output and still lowers for a Hopper."""
    from pallas_kernels import mosaic_common, mosaic_gemm
    from pallas_kernels.mosaic_gemm import UNSPLIT, MosaicConfig

    plan = lambda g, p, q, blocks: mosaic_gemm.wgrad_plan(  # noqa: E731
        MosaicConfig(), g, p, q, blocks, 132)[1]
    assert plan(1, 1024, 320, 128) == 26  # 24 tiles: 5 pieces fill 120 of 132 SMs
    assert plan(1, 1024, 4096, 128) == UNSPLIT  # 256 tiles already fill the SMs
    assert plan(1, 256, 256, 7) == UNSPLIT  # too few steps to share
    # The small preset's experts (768 blocks, 8 x 3 wide tiles a group): an SM's share is
    # 140 steps, so a group is cut above 70 blocks (9% of the tokens).
    assert plan(64, 1024, 704, 768) == 70
    # The bench's 8- and 64-group shapes: a group would need 36% or more of the tokens.
    assert plan(8, 7168, 4096, 256) == UNSPLIT and plan(64, 2048, 1408, 576) == UNSPLIT
    assert mosaic_gemm.wgrad_plan(MosaicConfig(), 64, 1024, 704, 768, 132,
                                  fp32_out=False)[1] == UNSPLIT  # no FP32 copy to sum in
    blocks = jnp.array([125, 0, 3, 17, 8], jnp.int32)
    starts = np.cumsum(blocks) - blocks
    for piece in (1, 4, 8, 50, UNSPLIT):
        n_pieces = len(blocks) + int(blocks.sum()) // piece
        group, start, size, rank, last = np.asarray(
            mosaic_gemm.piece_table(blocks, piece, n_pieces))
        for g, total in enumerate(np.asarray(blocks)):
            mine = group == g
            assert mine.sum() == max(1, -(-total // piece))
            assert size[mine].sum() == total and np.all(size[mine] <= piece)
            assert total == 0 or np.all(size[mine] > 0)
            assert size[mine].max() - size[mine].min() <= 1
            np.testing.assert_array_equal(start[mine],
                                          starts[g] + np.cumsum(size[mine]) - size[mine])
            np.testing.assert_array_equal(rank[mine], np.arange(mine.sum()))
            np.testing.assert_array_equal(last[mine], np.arange(mine.sum()) == mine.sum() - 1)
        used = group < len(blocks)
        assert np.all(group[~used] == len(blocks)) and np.all(used[:used.sum()])
        first_slots = [np.flatnonzero(group == g)[0] for g in range(len(blocks))]
        # Longest group first (ties by index): 125, 17, 8, 3, then the empty one.
        assert list(np.argsort(first_slots)) == [0, 3, 4, 2, 1]
    monkeypatch.setattr(mosaic_common, "sm_count", lambda: 132)
    x = jax.ShapeDtypeStruct((256, 4096), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((256, 32), jnp.float32)
    for piece, kernel_out in ((None, "tensor<1x256x256xf32>"), (UNSPLIT, "tensor<1x256x256xbf16>")):
        call = jax.jit(lambda x, xs, piece=piece: mosaic_gemm.scaled_grouped_matmul_tn(
            x, x, jnp.array([4096], jnp.int32), x_scale=xs, y_scale=xs,
            out_dtype=jnp.bfloat16, piece=piece))
        lowered = call.trace(x, scale).lower(lowering_platforms=("cuda",))
        assert kernel_out in lowered.as_text()  # cut: the pieces sum in FP32
        assert lowered.out_info.shape == (1, 256, 256) and lowered.out_info.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="piece=0"):
        mosaic_gemm.scaled_grouped_matmul_tn(jnp.zeros((256, 128), jnp.float8_e4m3fn),
                                             jnp.zeros((256, 128), jnp.float8_e4m3fn),
                                             jnp.array([128]), x_scale=jnp.ones((256, 1)),
                                             y_scale=jnp.ones((256, 1)), piece=0)


def test_mosaic_fp8_ring_depth_divides_short_k_loops():
    """Chained pipelines need the ring depth to divide the K steps; short loops get the
    deepest ring up to the configured one that does, long ones keep theirs unchained."""
    from pallas_kernels.mosaic_gemm import MosaicConfig

    cfg = MosaicConfig(stages=4)
    assert [cfg.for_steps(k).stages for k in (8, 6, 9, 5, 2)] == [4, 3, 3, 4, 2]
    assert cfg.for_steps(6).chains(6) and not cfg.for_steps(5).chains(5)
    assert cfg.for_steps(66).stages == 4 and not cfg.for_steps(66).chains(66)
    assert not MosaicConfig(chain=False).for_steps(6).chains(6)
    # A loop of 8 steps or more is not cut below 3 stages to chain: the wide tile's
    # 3-deep ring runs 8 and 16 steps unchained; shorter loops chain at any depth.
    wide = MosaicConfig().with_tile_n(256)
    assert [(wide.for_steps(k).stages, wide.for_steps(k).chains(k)) for k in (8, 16, 6, 4)] == [
        (3, False), (3, False), (3, True), (2, True)]


def test_mosaic_fp8_wide_column_tile_only_where_it_adds_no_wave(monkeypatch):
    """256-column CTA tiles where they take no more waves of the 132 SMs (in 128-column
    tile times) than 128-column ones, with the ring cut to what fits beside them; an
    explicit tile is kept, a bad one refused; which tiles split; the wide fprop (split
    too) and wgrad kernels lower for a Hopper."""
    from pallas_kernels import mosaic_common, mosaic_gemm
    from pallas_kernels.mosaic_gemm import MosaicConfig, scaled_grouped_matmul

    pick = lambda m, n, groups=1: MosaicConfig().for_tiles(-(-m // 128) + groups, n, 132)  # noqa: E731
    assert pick(8192, 7168).tile_n == 256 and pick(8192, 7168).stages == 3  # 28 = 28 waves
    assert pick(64 * 1536, 704, 64).tile_n == 256  # the small preset's experts: 38 = 38
    assert pick(8192, 2112).tile_n == 128 and pick(8192, 2112).stages == 4  # 10 > 9 waves
    assert pick(7168, 2048).tile_n == 128  # 8 > 7
    assert MosaicConfig(tile_n=128).for_tiles(65, 7168, 132).tile_n == 128
    # Given its K steps, not where the wide ring would chain only 2 deep (4 steps).
    steps_pick = lambda k_steps: MosaicConfig().for_tiles(64, 7168, 132, k_steps).tile_n  # noqa: E731
    assert [steps_pick(k) for k in (4, 6, 8, 16, 56)] == [128, 256, 256, 256, 256]
    # The wgrad: the same wave rule over its (group x row tile) visits, or (one group) its
    # pieces' visits; an explicit tile is kept.
    wgrad_pick = lambda g, p, q, blocks: mosaic_gemm.wgrad_plan(  # noqa: E731
        MosaicConfig(), g, p, q, blocks, 132)[0].tile_n
    assert wgrad_pick(64, 1024, 704, 768) == 256 and wgrad_pick(64, 704, 1024, 768) == 256
    assert wgrad_pick(8, 7168, 4096, 256) == 256 and wgrad_pick(8, 2048, 7168, 256) == 256
    assert wgrad_pick(1, 1024, 4096, 128) == 256 and wgrad_pick(1, 1024, 1408, 128) == 128
    assert mosaic_gemm.wgrad_plan(MosaicConfig(tile_n=128), 64, 1024, 704, 768,
                                  132)[0].tile_n == 128  # an explicit tile is kept
    # A tile splits where its width is one the call splits (K on the 128 grid: the wide
    # tile, and the 128-column one for one group) and this jax joins a split tile's parts
    # (>= 0.11), unless the config sets the split; the wave rule still picks the tile.
    # Older jax refuses an explicit split.
    joins = mosaic_gemm.parts_join()
    widths = mosaic_gemm.split_widths
    assert (widths(1, 2048), widths(8, 2048), widths(1, 2112)) == ((256, 128), (256,), ())
    split = MosaicConfig().for_tiles(65, 7168, 132, 56, splits=widths(1, 7168))
    assert (split.tile_n, split.split, split.stages) == (256, joins, 3)
    narrow = MosaicConfig().for_tiles(65, 2112, 132, 56, splits=widths(1, 7168))
    assert (narrow.tile_n, narrow.split) == (128, joins)  # 10 > 9 waves
    assert MosaicConfig().for_tiles(65, 2112, 132, 56, splits=widths(4, 7168)).split is False
    # Where only the wide tile would split, the wave rule counts its tile times
    # SPLIT_SPEEDUP shorter: 64 groups of 65536 rows into N = 1408 take 54 wide tile
    # times against 48 narrow ones, and go wide (split) only where the split is real.
    with monkeypatch.context() as patch:
        patch.setattr(mosaic_gemm, "parts_join", lambda: True)
        grouped = lambda k: MosaicConfig().for_tiles(  # noqa: E731
            512 + 64, 1408, 132, k // 128, splits=widths(64, k))
        assert [(grouped(k).tile_n, grouped(k).split) for k in (2048, 2112)] == [
            (256, True), (128, False)]
        # One group: both widths split, so 10 > 9 waves still keeps 128 columns.
        assert MosaicConfig().for_tiles(65, 2112, 132, 56, splits=widths(1, 7168)).tile_n == 128
    explicit = MosaicConfig(tile_n=128).for_tiles(65, 7168, 132, splits=widths(1, 7168))
    assert (explicit.tile_n, explicit.split) == (128, joins)
    unsplit = MosaicConfig(split=False).for_tiles(65, 7168, 132, splits=(256,))
    assert (unsplit.tile_n, unsplit.split) == (256, False)
    assert pick(8192, 7168).split is False
    if joins:
        assert MosaicConfig(split=True).for_tiles(65, 7168, 132).tile_n == 256
    else:
        with pytest.raises(ValueError, match=r"split=True\) needs jax >= 0.11"):
            MosaicConfig(split=True)
    with pytest.raises(ValueError, match="tile_n=192"):
        MosaicConfig(tile_n=192)
    with pytest.raises(ValueError, match="at most 3 stages"):
        MosaicConfig(tile_n=256, stages=4)
    monkeypatch.setattr(mosaic_common, "sm_count", lambda: 132)
    a8, a_scale, b8, b_scale = (_MOSAIC_OPERANDS[i] for i in (3, 4, 5, 6))
    call = jax.jit(lambda a, s_, b, bs: scaled_grouped_matmul(
        a, b, jnp.array([300, 0, 200, 12], jnp.int32), a_scale=s_, b_scale=bs,
        cfg=MosaicConfig(tile_n=256, stages=3)))
    assert "fp8_grouped_gemm" in call.trace(a8, a_scale, b8, b_scale).lower(
        lowering_platforms=("cuda",)).as_text()
    x, xs = jax.ShapeDtypeStruct((320, 1024), a8.dtype), jax.ShapeDtypeStruct((320, 8), a_scale.dtype)
    # N = 384 takes the 128-column tile by the wave rule: None splits it for one group;
    # the wide split is asked for. A jax that cannot join parts lowers the split K loop
    # with the parts staged apart instead (a lowering check only: those stores are wrong).
    if not joins:
        monkeypatch.setattr(mosaic_gemm, "parts_join", lambda: True)
        monkeypatch.setattr(mosaic_gemm, "_join_parts", lambda parts: parts)
    for cfg in (None, MosaicConfig(tile_n=256, stages=3, split=True)):
        for sizes in (jnp.array([512], jnp.int32), jnp.array([300, 0, 200, 12], jnp.int32)):
            split_call = jax.jit(lambda a, s_, b, bs, sizes=sizes, cfg=cfg: scaled_grouped_matmul(
                a, b[:len(sizes)], sizes, a_scale=s_, b_scale=bs[:len(sizes)], cfg=cfg))
            assert "fp8_grouped_gemm" in split_call.trace(a8, a_scale, b8, b_scale).lower(
                lowering_platforms=("cuda",)).as_text()
    wgrad = jax.jit(lambda x, xs: mosaic_gemm.scaled_grouped_matmul_tn(
        x, x, jnp.array([512, 0, 512], jnp.int32), x_scale=xs, y_scale=xs,
        cfg=MosaicConfig(tile_n=256, stages=3)))
    assert "fp8_grouped_wgrad_gemm" in wgrad.trace(x, xs).lower(
        lowering_platforms=("cuda",)).as_text()


def test_aligned_layout_starts_every_group_on_a_tile(request):
    rng = _rng(request)
    for sizes in (np.array([0, 1, 127, 128, 129, 300, 0]), np.ones(9, np.int64),
                  rng.multinomial(900, rng.dirichlet(np.full(12, 0.3)))):
        m = int(sizes.sum()) + 37  # rows past the groups' sum are left out
        x = rng.standard_normal((m, 3)).astype(np.float32)
        layout = aligned_layout(jnp.asarray(sizes, jnp.int32), m)
        got = np.asarray(gather_aligned(jnp.asarray(x), layout))
        assert got.shape[0] == aligned_length(m, len(sizes)) and got.shape[0] % 128 == 0
        want, row, at = np.zeros_like(got), 0, 0
        for size in sizes:
            want[at:at + size] = x[row:row + size]
            row, at = row + size, at + -(-size // 128) * 128
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.asarray(layout.sizes), -(-sizes // 128) * 128)


def _row_visits(sizes, m: int, block_m: int) -> list[tuple[int, int]]:
    """(group, row block) of each block with rows of each group, from a loop over rows;
    the rows past the groups' sum are group G, and a negative size counts as none."""
    sizes = np.maximum(sizes, 0)
    owner = np.repeat(np.arange(len(sizes) + 1), np.append(sizes, m - sizes.sum()))
    return sorted({(int(g), r // block_m) for r, g in enumerate(owner)})


@pytest.mark.parametrize("walk", ["mosaic tile_owner", "tile_schedule"])
def test_row_visits_cover_each_block_once_per_group_it_touches(request, walk):
    """The grouped kernels' row visits, against a loop over rows: each 128-row block once
    per group with rows in it, and every slot past the last visit group G + 1, which runs
    nothing. A slot given to a real group multiplies a tile of no rows: the Mosaic
    kernels' walk did that to session 48. A negative size (not a valid input) must give
    the rows the wgrad's `group_bounds` gives: none."""
    from pallas_kernels.mosaic_common import tile_owner, visit_table

    rng = _rng(request)
    for sizes in (np.array([300]), np.array([0, 1, 127, 128, 129, 300, 0]), np.full(8, 256),
                  rng.multinomial(2000, rng.dirichlet(np.full(16, 0.5))),
                  np.array([200, -50, 100]),
                  rng.multinomial(9000, rng.dirichlet(np.full(70, 0.5)))):  # 2 table rows a field
        groups, total = len(sizes), int(np.maximum(sizes, 0).sum())
        for m in (total, total + 37):
            slots = jnp.arange(num_tiles(m, groups, 128), dtype=jnp.int32)
            if walk == "tile_schedule":
                sched = tile_schedule(jnp.asarray(sizes, jnp.int32), m, 128)
                group, block = sched.tile_group, sched.tile_block
                lo, hi = sched.starts[group], sched.ends[group]
            else:
                table = visit_table(jnp.asarray(sizes, jnp.int32), m)
                group, block, lo, hi = jax.vmap(
                    lambda t: tile_owner(t, table, groups))(slots)
            group, block, lo, hi = (np.asarray(v) for v in (group, block, lo, hi))
            want = _row_visits(sizes, m, 128)
            runs = group <= groups
            assert sorted(zip(group[runs].tolist(), block[runs].tolist())) == want
            assert runs.sum() == len(want) and not runs[len(want):].any()
            assert (group[len(want):] == groups + 1).all()
            # Each visit's rows are its group's: [start, end) as `group_bounds` has them.
            bounds = np.append(0, np.cumsum(np.maximum(sizes, 0)))
            bounds = np.append(bounds, m)  # the zero rows past the last group end at m
            assert (lo[runs] == bounds[group[runs]]).all()
            assert (hi[runs] == bounds[group[runs] + 1]).all()


@pytest.mark.parametrize("tiles_n, sms", [(3, 132), (6, 132), (2, 12)])
def test_turned_columns_deal_the_narrow_tile_to_every_sm(tiles_n, sms):
    """With tiles_n dividing the SM count, the row-major walk gives SM t mod sms the same
    column tile in every wave; turned, each row still gets each column tile once and
    every SM draws the last (narrow) one in turn."""
    from pallas_kernels.mosaic_common import turned_column

    tiles_m = 7 * sms  # whole and partial waves of rows
    t = np.arange(tiles_m * tiles_n)
    mi, ni = t // tiles_n, t % tiles_n
    turned = np.asarray(turned_column(jnp.asarray(mi), jnp.asarray(ni), tiles_n, sms))
    assert sorted(zip(mi.tolist(), turned.tolist())) == sorted(zip(mi.tolist(), ni.tolist()))
    sm = t % sms
    before = np.bincount(sm[ni == tiles_n - 1], minlength=sms)
    after = np.bincount(sm[turned == tiles_n - 1], minlength=sms)
    assert before.min() == 0  # the fixed walk idles the other SMs' narrow turns
    assert after.max() - after.min() <= 1 and after.min() > 0


@pytest.mark.parametrize("stages,out_dtype", [(None, jnp.float32), (4, jnp.float32),
                                              (None, jnp.bfloat16)])
def test_mosaic_bf16_fprop_kernel_interpreted_on_cpu(stages, out_dtype):
    """The Mosaic GPU fprop kernel itself (persistent tile walk, visits of row tiles that
    straddle groups, the TMA ring, the store ladder) run by Mosaic GPU's interpreter on 3
    CTAs, against float64: groups of 0, 1, 127 and 129 rows, zeros past their sum. Its 4
    K steps do not chain on the default 5-deep ring of FP32 outputs; a 4-deep one chains
    them, and the interpreter fails a chain whose last releases the producer leaves
    unawaited (`mosaic_common.drain_chain`). BF16 outputs take 256-column tiles on a
    4-deep ring (chained), stored as four 64-column chunks through two epilogue slots.
    No partial last column tile: the interpreter refuses the loads past the edge that TMA
    zero-fills (the GPU tests cover it)."""
    from pallas_kernels import mosaic_bf16_gemm

    rng = np.random.default_rng(11)
    sizes = np.array([0, 1, 127, 129])
    a, b = _normal(rng, (320, 256)), _normal(rng, (4, 256, 512))
    cfg = mosaic_bf16_gemm.Bf16Config(stages=stages)
    got = mosaic_bf16_gemm.grouped_matmul(a, b, jnp.asarray(sizes, jnp.int32), b_kn=True,
                                          out_dtype=out_dtype, cfg=cfg, interpret=True)
    want = np.zeros((320, 512))
    ends = np.cumsum(sizes)
    for g, (start, end) in enumerate(zip(ends - sizes, ends)):
        want[start:end] = _f64(a)[start:end] @ _f64(b)[g]
    assert _rel(got, want) <= (1e-6 if out_dtype == jnp.float32 else 4e-3)
    assert not np.asarray(got)[ends[-1]:].any()


def test_group_sizes_must_be_integers_and_a_bad_backend_names_its_source(monkeypatch):
    """Float sizes were truncated silently; a list raised an AttributeError."""
    a = jnp.ones((8, 128), jnp.bfloat16)
    b = jnp.ones((2, 128, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"group_sizes has dtype float32; expected an integer"):
        pk.grouped_gemm(a, b, jnp.array([3.7, 4.2]))
    assert pk.grouped_gemm(a, b, [3, 5]).shape == (8, 16)
    monkeypatch.setenv("MOEJAX_GEMM_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"unknown GEMM backend 'cuda' \(from \$MOEJAX_GEMM_"
                                         r"BACKEND\)"):
        pk.backend()
