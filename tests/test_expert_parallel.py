"""Expert-parallel MoE over simulated CPU devices equals the single-device layer."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from moejax.config import get_model_preset
from moejax.model import DeepseekV3
from moejax.model import moe as moe_module
from moejax.model.expert_ffn import grouped_swiglu
from moejax.model.moe import MoE
from moejax.model.routing import route
from moejax.parallel import expert as expert_module
from moejax.parallel.expert import ExpertParallelOptions, expert_parallel_options
from moejax.parallel.mesh import AXES, MeshSpec, build_mesh

CONFIG = get_model_preset("tiny")


def _mesh(**axes):
    return jax.make_mesh(tuple(axes.values()), tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


@pytest.fixture(scope="module")
def moe():
    return MoE(CONFIG, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)


def _inputs(seed):
    x = jax.random.normal(jax.random.key(seed), (8, 6, CONFIG.hidden_size))
    bias = 0.1 * jax.random.normal(jax.random.key(seed + 1), (CONFIG.n_routed_experts,))
    return x, bias


def _call(moe, x, bias):
    return nnx.jit(lambda m, a, b: m(a, b))(moe, x, bias)


@pytest.mark.parametrize("axes", [dict(expert=8), dict(data=2, expert=4), dict(data=4, expert=2),
                                  dict(data=8)])
def test_padded_dropless_matches_single_device(moe, axes):
    x, bias = _inputs(sum(axes.values()))
    ref = _call(moe, x, bias)
    with jax.set_mesh(_mesh(**axes)):
        got = _call(moe, x, bias)
    np.testing.assert_allclose(got.y, ref.y, rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(got.stats.counts, ref.stats.counts)
    np.testing.assert_allclose(got.stats.balance_loss, ref.stats.balance_loss, rtol=1e-5)
    assert int(got.stats.dropped) == 0


def _ragged_all_to_all_by_gather(operand, output, input_offsets, send_sizes, output_offsets,
                                 recv_sizes, *, axis_name):
    """ragged_all_to_all's documented semantics from all_gather and gathers (XLA:CPU has no
    ragged_all_to_all): output row r takes the row of whichever slice sent to me covers it."""
    del recv_sizes  # implied by the senders' sizes
    everything = [jax.lax.all_gather(a, axis_name)
                  for a in (operand, input_offsets, send_sizes, output_offsets)]
    operands, starts, sizes, lands = everything  # (ep, N, H) and (ep, K) each
    ep, slices = starts.shape
    per_device = slices // ep
    mine = jax.lax.axis_index(axis_name) * per_device
    pick = lambda a: jax.lax.dynamic_slice_in_dim(a, mine, per_device, axis=1).reshape(-1)
    source = jnp.repeat(jnp.arange(ep), per_device)
    starts, sizes, lands = pick(starts), pick(sizes), pick(lands)
    r = jnp.arange(output.shape[0])[:, None]
    covers = (r >= lands) & (r < lands + sizes)  # (rows, ep * per_device)
    rows = jnp.clip(starts + r - lands, 0, operand.shape[0] - 1)
    taken = operands[source[None, :], rows]  # (rows, slices, H)
    received = jnp.sum(jnp.where(covers[..., None], taken, 0), axis=1).astype(output.dtype)
    return jnp.where(covers.any(axis=1)[:, None], received, output)


@pytest.mark.parametrize("axes,piece_bytes,transport", [
    (dict(expert=8), None, "ragged"), (dict(data=2, expert=4), None, "ragged"),
    (dict(expert=8), 256, "ragged"), (dict(data=2, expert=4), None, "padded")])
def test_transport_matches_single_device(moe, axes, piece_bytes, transport, monkeypatch):
    """Values, counts and gradients equal the single-device layer. The ragged plan (slices
    landing expert-major, returned to where they came from) runs on CPU through an
    all_gather emulation of ragged_all_to_all; ``piece_bytes``: slices cut into many pieces
    (these shapes' default is one piece a slice)."""
    monkeypatch.setattr(expert_module.jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_gather)
    if piece_bytes is not None:
        monkeypatch.setattr(expert_module, "ragged_piece_bytes", lambda: piece_bytes)
        ep = axes["expert"]
        ragged = expert_module.make_transport(
            ExpertParallelOptions(transport="ragged"), ep, ("expert",), 8 * 6 // ep,
            CONFIG.num_experts_per_tok, CONFIG.n_routed_experts)
        assert ragged.pieces(CONFIG.hidden_size * 4) > 1  # the rows of these shapes are cut
    x, bias = _inputs(5 + sum(axes.values()))

    def loss(m, a):
        out = m(a, bias)
        return jnp.sum(out.y ** 2), out.stats.counts

    step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (ref, ref_counts), ref_grads = step(moe, x)
    with jax.set_mesh(_mesh(**axes)), expert_parallel_options(
            ExpertParallelOptions(transport=transport)):
        (got, got_counts), got_grads = step(moe, x)
    np.testing.assert_allclose(got, ref, rtol=2e-5)
    np.testing.assert_array_equal(got_counts, ref_counts)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_ragged_backward_sends_no_offsets(moe):
    """Each ragged exchange's transpose is the exchange the other way on the layer's own
    plan (``expert.ragged_move``). The lowered gradient of the layer holds its six ragged
    exchanges (rows, router weights and expert outputs, each way) and no all_to_all. JAX's
    own transpose adds two per backward exchange, to send the offsets (six here). The
    gradients' values are checked in ``test_transport_matches_single_device``. Each
    exchange's zero receive buffer is made behind an optimization barrier on its rows
    (``expert._zeros_after``): as a constant, XLA made every layer's buffers, the
    backward's too, in one kernel at the start of the step (5.2 GiB more at the peak of
    `small` on 4 x H100, session 40)."""
    x, bias = _inputs(3)
    with jax.set_mesh(_mesh(data=2, expert=4)), expert_parallel_options(
            ExpertParallelOptions(transport="ragged")):
        text = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a, bias).y ** 2), argnums=(0, 1))
                       ).lower(moe, x).as_text()
    assert len(re.findall(r"ragged_all_to_all", text)) == 6
    assert not re.findall(r"(?<!ragged_)all_to_all", text)
    # the barrier passes a scalar zero (the buffer's fill) alongside the rows sent
    assert len(re.findall(r"optimization_barrier %\S+, %\S+ : tensor<f32>, ", text)) == 6


def test_ragged_plan_lands_slices_expert_major():
    """Per-device plans agree with each other: every slice lands inside its expert's group
    on the receiver, in source order, and goes back to where it was sent from."""
    ep, num_local = 4, 3
    counts = np.random.default_rng(0).integers(0, 5, (ep, ep * num_local)).astype(np.int32)
    plans = [expert_module.ragged_plan(jnp.asarray(counts), jnp.int32(d)) for d in range(ep)]
    for dest in range(ep):
        expected = np.full(counts[:, dest * num_local:(dest + 1) * num_local].sum(), -1)
        got = np.full_like(expected, -1)
        cursor = 0
        for j in range(num_local):
            for src in range(ep):  # expert-major, then source-major
                e = dest * num_local + j
                expected[cursor:cursor + counts[src, e]] = src * 100 + e
                cursor += counts[src, e]
                land = int(plans[src].land_offsets[e])
                got[land:land + counts[src, e]] = src * 100 + e
                slot = src * num_local + j
                assert int(plans[dest].recv_offsets[slot]) == land
                assert int(plans[dest].recv_sizes[slot]) == counts[src, e]
                assert int(plans[dest].return_offsets[slot]) == int(plans[src].send_offsets[e])
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(plans[dest].group_sizes,
                                      counts[:, dest * num_local:(dest + 1) * num_local].sum(0))


@pytest.mark.parametrize("pieces", [1, 3, 8])
def test_cut_into_pieces_tiles_every_slice(pieces):
    """Pieces cover each slice exactly once, in order, whatever its size (0 and sizes below
    ``pieces`` included)."""
    sizes = jnp.asarray([0, 1, 2, 7, 8, 29], jnp.int32)
    within, piece_sizes = expert_module.cut_into_pieces(sizes, pieces)
    within = np.asarray(within).reshape(len(sizes), pieces)
    piece_sizes = np.asarray(piece_sizes).reshape(len(sizes), pieces)
    for n, starts, lengths in zip(np.asarray(sizes), within, piece_sizes):
        covered = np.concatenate([np.arange(a, a + b) for a, b in zip(starts, lengths)])
        np.testing.assert_array_equal(covered, np.arange(n))


def test_take_rows_gradient_is_autodiffs():
    """take_rows' gather-by-inverse backward equals autodiff's scatter-add transpose of the
    same gather, with rows taken nowhere (dropped) and slots taking no row (padding)."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((10, 3)), jnp.float32)
    index = np.full(14, 10)  # 14 slots, out of range: padding
    slots = rng.permutation(14)[:8]
    index[slots] = rng.permutation(10)[:8]  # 8 of the 10 rows placed, 2 dropped
    inverse = np.full(10, 14)
    inverse[index[slots]] = slots
    g = jnp.asarray(rng.standard_normal((14, 3)), jnp.float32)
    got, vjp = jax.vjp(lambda a: expert_module.take_rows(a, jnp.asarray(index),
                                                         jnp.asarray(inverse)), x)
    ref, ref_vjp = jax.vjp(lambda a: jnp.take(a, jnp.asarray(index), axis=0, mode="fill",
                                              fill_value=0), x)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(vjp(g)[0], ref_vjp(g)[0])


def test_capacity_factor_drops_and_counts(moe):
    x, bias = _inputs(3)
    # Skew routing so some expert device is over capacity: bias two experts upward.
    bias = bias.at[jnp.array([0, 1])].add(5.0)
    with jax.set_mesh(_mesh(expert=8)), expert_parallel_options(
            ExpertParallelOptions(capacity_factor=1.0)):
        got = _call(moe, x, bias)
    ref = _call(moe, x, bias)
    assert int(got.stats.dropped) > 0
    # counts are what the router chose, before drops
    np.testing.assert_array_equal(got.stats.counts, ref.stats.counts)
    assert not np.allclose(got.y, ref.y)


def test_dropless_buffers_hold_the_worst_case_exactly(moe):
    """Dropless padded buffers hold T * min(k, E/ep) copies per destination (a token's k
    experts are distinct): on expert=8, 2 experts a device, k=4, so half of T*k. Every
    token routed to experts 0 and 1 fills device 0's slots from every source exactly;
    nothing may drop and the layer must equal the single-device one."""
    x, bias = _inputs(4)
    bias = bias.at[jnp.array([0, 1])].add(10.0)
    ref = _call(moe, x, bias)
    assert np.all(np.asarray(ref.stats.counts)[:2] == x.shape[0] * x.shape[1])
    with jax.set_mesh(_mesh(expert=8)):
        got = _call(moe, x, bias)
    transport = expert_module.make_transport(ExpertParallelOptions(), 8, (), 6, 4, 16)
    assert transport.capacity == 6 * 2  # 6 tokens a device here, not 6 * 4
    assert int(got.stats.dropped) == 0
    np.testing.assert_allclose(got.y, ref.y, rtol=2e-5, atol=2e-6)


def test_cross_node_copies_counted_and_capped_by_group_limit(moe):
    """8 devices, 2 per node: expert shards 0-1, 2-3, ... share a node; with 16 experts in 4
    groups each routing group is exactly one node's experts, so topk_group=2 caps the nodes
    a token reaches at 2."""
    x, bias = _inputs(11)
    with jax.set_mesh(_mesh(expert=8)), expert_parallel_options(
            ExpertParallelOptions(devices_per_node=2)):
        got = _call(moe, x, bias)
    flat = x.reshape(-1, CONFIG.hidden_size)
    r = route(flat @ moe.router[...], bias, CONFIG)
    experts_per_node = CONFIG.n_routed_experts // 4
    expert_node = np.asarray(r.experts) // experts_per_node  # (T, k)
    token_node = np.repeat(np.arange(8) // 2, flat.shape[0] // 8)  # the sender's node
    assert int(got.stats.cross_node) == int((expert_node != token_node[:, None]).sum())
    assert max(len(set(row)) for row in expert_node) <= CONFIG.topk_group


def test_cross_node_counts_only_the_copies_a_capacity_lets_leave(moe):
    """With a capacity factor, each device sends at most C copies to each destination:
    the copies over it are dropped, not sent, so they do not count as cross-node
    traffic."""
    x, bias = _inputs(11)
    bias = bias.at[jnp.array([0, 1, 2, 3])].add(3.0)  # node 0's experts wanted by all
    with jax.set_mesh(_mesh(expert=8)), expert_parallel_options(
            ExpertParallelOptions(capacity_factor=0.5, devices_per_node=2)):
        got = _call(moe, x, bias)
    flat = x.reshape(-1, CONFIG.hidden_size)
    experts = np.asarray(route(flat @ moe.router[...], bias, CONFIG).experts)
    tokens = flat.shape[0] // 8
    capacity = int(np.ceil(0.5 * tokens * CONFIG.num_experts_per_tok / 8))
    local = CONFIG.n_routed_experts // 8
    sent = cross = 0
    for device in range(8):
        wanted = np.bincount(experts[device * tokens:(device + 1) * tokens].ravel() // local,
                             minlength=8)
        kept = np.minimum(wanted, capacity)
        sent += kept.sum()
        cross += kept[np.arange(8) // 2 != device // 2].sum()
    assert int(got.stats.dropped) == experts.size - sent > 0
    assert int(got.stats.cross_node) == cross


def test_nodes_of_destinations_follow_the_pipe_rank_inside_the_executor():
    """Inside a shard_map manual over pipe (the pipeline executor's), pipe rank r exchanges
    among its own devices: with 4 a rank and 3 a node, rank 1's devices 4-7 sit on nodes
    1, 1, 2, 2, not on rank 0's 0, 0, 0, 1. Outside one, tokens are replicated over pipe."""
    mesh = build_mesh(MeshSpec(pipe=2, expert=4))
    shape = dict(mesh.shape)

    def executor(_):  # manual over every axis, as the pipeline executor is
        senders = expert_module.sender_axes()
        nodes = expert_module._node_of_expert_position(jnp.arange(4), shape, 3, senders)
        return nodes.reshape(1, 1, 1, 1, 4)

    with jax.set_mesh(mesh):
        assert "pipe" not in expert_module.sender_axes()
        got = jax.shard_map(executor, in_specs=P(), out_specs=P(*AXES))(jnp.zeros(()))
    want = (np.arange(2)[:, None] * 4 + np.arange(4)) // 3  # (rank, destination)
    np.testing.assert_array_equal(np.asarray(got)[:, 0, :, 0], np.broadcast_to(
        want[:, None, :], (2, 4, 4)))


def test_data_parallel_experts_see_only_their_devices_tokens(moe, monkeypatch):
    """With data > 1 and no expert axis each device runs its own tokens' copies through the
    experts: XLA, left to itself, gathered the batch and ran them all on every device."""
    rows_seen = []

    def recording_experts(rows, *args, **kw):
        rows_seen.append(rows.shape[0])
        return grouped_swiglu(rows, *args, **kw)

    monkeypatch.setattr(moe_module, "grouped_swiglu", recording_experts)
    x, bias = _inputs(5)
    with jax.set_mesh(_mesh(data=8)):
        _call(moe, x, bias)
    assert rows_seen == [x.shape[0] // 8 * x.shape[1] * CONFIG.num_experts_per_tok]


@pytest.mark.parametrize("axes", [dict(data=2, expert=4), dict(data=8)])
def test_model_forward_and_grads_under_mesh_match(axes):
    config = CONFIG.replace(num_hidden_layers=2)
    model = DeepseekV3(config, rngs=nnx.Rngs(1), dtype=jnp.float32)
    ids = jax.random.randint(jax.random.key(2), (8, 10), 0, config.vocab_size)

    def loss(m):
        out = m.forward(ids)
        return jnp.mean(jax.nn.logsumexp(out.logits, -1)) + out.aux_loss, out.expert_counts

    grad_fn = nnx.jit(nnx.value_and_grad(loss, has_aux=True))
    (ref_loss, ref_counts), ref_grads = grad_fn(model)
    with jax.set_mesh(_mesh(**axes)):
        (got_loss, got_counts), got_grads = grad_fn(model)
    np.testing.assert_allclose(got_loss, ref_loss, rtol=1e-5)
    np.testing.assert_array_equal(got_counts, ref_counts)
    for (path, a), (_, b) in zip(nnx.to_flat_state(got_grads), nnx.to_flat_state(ref_grads)):
        a, b = np.asarray(a[...]), np.asarray(b[...])
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-7, path


def test_bad_expert_axis_is_named(moe):
    x, bias = _inputs(0)
    small = CONFIG.replace(n_routed_experts=12, n_group=4)
    layer = MoE(small, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    with jax.set_mesh(_mesh(expert=8)), pytest.raises(Exception, match="n_routed_experts=12"):
        _call(layer, x, bias[:12])


@pytest.mark.gpu
@pytest.mark.parametrize("transport,token_format",
                         [("ragged", "compute"), ("padded", "compute"), ("ragged", "fp8")])
def test_gpu_transports_match_single_device(transport, token_format):
    """On >= 2 GPUs: ragged_all_to_all (GPU-only) and padded exchange vs one device; FP8
    tokens through the fused Triton dispatch, within E4M3's error."""
    n = jax.device_count()
    if n < 2:
        pytest.skip("needs at least 2 GPUs")
    layer = MoE(CONFIG, rngs=nnx.Rngs(0), dtype=jnp.float32, param_dtype=jnp.float32)
    x, bias = _inputs(21)

    def loss_and_grads(m, a):
        def loss(m, a):
            out = m(a, bias)
            return jnp.sum(out.y ** 2), out.stats.counts
        return nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(m, a)

    step = nnx.jit(loss_and_grads)
    (ref, ref_counts), ref_grads = step(layer, x)
    with jax.set_mesh(_mesh(expert=n)), expert_parallel_options(
            ExpertParallelOptions(transport=transport, token_format=token_format)):
        (got, got_counts), got_grads = step(layer, x)
    # GPU matmuls of FP32 inputs may use TF32: a wrong exchange is off by O(1), not 1e-3.
    tolerance = 5e-3 if token_format == "compute" else 5e-2
    np.testing.assert_allclose(got, ref, rtol=tolerance)
    np.testing.assert_array_equal(got_counts, ref_counts)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        a, b = np.asarray(a), np.asarray(b)
        assert np.linalg.norm(a - b) <= 2 * tolerance * np.linalg.norm(b) + 1e-6


def _fp8_options(transport):
    return expert_parallel_options(ExpertParallelOptions(transport=transport,
                                                         token_format="fp8"))


def test_fp8_tokens_arrive_as_their_1x128_quantization(moe):
    """Identity experts: each token comes back as dequantize(quantize_1x128(x)) times the
    sum of its router weights, so the FP8 bytes and FP32 scales cross intact."""
    import pallas_kernels
    from moejax.model.expert_ffn import ExpertWeights
    x, bias = _inputs(31)
    x = x * jnp.exp(jax.random.normal(jax.random.key(5), (x.shape[-1],)))  # uneven columns
    weights = ExpertWeights(moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...])

    def identity(rows, group_sizes, weights, rows_fp8, row_weights):  # weighted, as experts are
        return rows * row_weights[:, None]

    with jax.set_mesh(_mesh(expert=8)), _fp8_options("padded"):
        y, _ = jax.jit(lambda a: expert_module.expert_parallel_moe(
            a, moe.router[...], bias, weights, CONFIG, run_experts=identity))(x)
    flat = x.reshape(-1, CONFIG.hidden_size)
    r = route(flat @ moe.router[...], bias, CONFIG)
    q, s = pallas_kernels.quantize_1x128(flat)
    want = pallas_kernels.dequantize(q, s, 1) * r.weights.sum(-1, keepdims=True)
    np.testing.assert_allclose(y.reshape(flat.shape), want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(want, flat * r.weights.sum(-1, keepdims=True), rtol=1e-4)


@pytest.mark.parametrize("transport", ["padded", "ragged"])
def test_fp8_output_gradient_arrives_as_its_1x128_quantization(moe, transport, monkeypatch):
    """Identity experts, a zero router (no gradient path through the routing): the input
    gradient of sum(y * G) is dequantize(quantize_1x128(G)) times each token's summed
    router weights, so the outputs' gradient crossed to the experts as FP8 with its
    scales, and the rows' gradient came back exactly."""
    import pallas_kernels
    from moejax.model.expert_ffn import ExpertWeights
    monkeypatch.setattr(expert_module.jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_gather)
    x, bias = _inputs(33)
    g = jax.random.normal(jax.random.key(8), x.shape)
    g = g * jnp.exp(jax.random.normal(jax.random.key(9), (x.shape[-1],)))  # uneven columns
    router = jnp.zeros_like(moe.router[...])
    weights = ExpertWeights(moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...])

    def identity(rows, group_sizes, weights, rows_fp8, row_weights):  # weighted, as experts are
        return rows * row_weights[:, None]

    def loss(a):
        y, _ = expert_module.expert_parallel_moe(a, router, bias, weights, CONFIG,
                                                 run_experts=identity)
        return jnp.sum(y * g)

    with jax.set_mesh(_mesh(expert=8)), _fp8_options(transport):
        got = jax.jit(jax.grad(loss))(x)
    flat = g.reshape(-1, CONFIG.hidden_size)
    r = route(jnp.zeros((flat.shape[0], CONFIG.n_routed_experts)), bias, CONFIG)
    summed = r.weights.sum(-1, keepdims=True)
    want = pallas_kernels.dequantize(*pallas_kernels.quantize_1x128(flat), 1) * summed
    np.testing.assert_allclose(got.reshape(flat.shape), want, rtol=1e-6, atol=1e-7)
    assert not np.allclose(want, flat * summed, rtol=1e-4)


@pytest.mark.parametrize("transport", ["padded", "ragged"])
def test_fp8_transport_layer_and_gradients_within_fp8_error(moe, transport, monkeypatch):
    monkeypatch.setattr(expert_module.jax.lax, "ragged_all_to_all", _ragged_all_to_all_by_gather)
    x, bias = _inputs(41)

    def loss(m, a):
        out = m(a, bias)
        return jnp.sum(out.y ** 2), out.y

    step = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, ref), ref_grads = step(moe, x)
    with jax.set_mesh(_mesh(data=2, expert=4)), _fp8_options(transport):
        (_, got), got_grads = step(moe, x)
    rel = lambda a, b: float(np.linalg.norm(np.asarray(a) - b) / np.linalg.norm(b))  # noqa: E731
    assert 1e-4 < rel(got, ref) < 0.05  # quantized (not exact), within E4M3's error
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)):
        assert rel(a, b) < 0.1


def test_fp8_tokens_feed_the_fp8_expert_gemms_as_they_arrived(monkeypatch):
    """With FP8 expert GEMMs, rows that travelled in FP8 go into the gate and up GEMMs as
    they arrived (values and 1x128 scales: no dequantize-then-requantize pass), and the
    layer equals the one-device FP8 layer, which quantizes the same rows itself."""
    import importlib
    from moejax.precision import Precision
    # the module (the package's attribute of that name is the function fp8_linear)
    fp8_linear = importlib.import_module("pallas_kernels.fp8_linear")
    fp8_moe = MoE(CONFIG, rngs=nnx.Rngs(0), dtype=jnp.bfloat16, param_dtype=jnp.float32,
                  precision=Precision.FP8)
    x, bias = _inputs(51)
    x = (x * jnp.exp(jax.random.normal(jax.random.key(6), (x.shape[-1],)))).astype(jnp.bfloat16)
    ref = _call(fp8_moe, x, bias).y.astype(jnp.float32)
    given = []
    forward = fp8_linear._forward

    def spy(x, w, sizes, x_fp8=None):
        given.append(x_fp8 is not None)
        return forward(x, w, sizes, x_fp8)

    monkeypatch.setattr(fp8_linear, "_forward", spy)
    with jax.set_mesh(_mesh(expert=8)), _fp8_options("padded"):
        got = _call(fp8_moe, x, bias).y.astype(jnp.float32)
    # routed gate and up took the arrived FP8 rows; the shared experts' (never sent) did not
    assert sorted(given) == [False, False, True, True]
    rel = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
    assert rel < 1e-4, rel

    # gradients pass straight through the travelled quantization, as on one device; the
    # routed experts' FP8 wgrad quantizes along tokens, which arrive in another order than
    # on one device (other 1x128 token tiles), so those differ within E4M3's error
    monkeypatch.undo()
    step = nnx.jit(nnx.grad(lambda m, a: jnp.sum(m(a, bias).y.astype(jnp.float32) ** 2),
                            argnums=(0, 1)))
    ref_grads = step(fp8_moe, x)
    with jax.set_mesh(_mesh(expert=8)), _fp8_options("padded"):
        got_grads = step(fp8_moe, x)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) <= 0.05 * np.linalg.norm(b) + 1e-6


def test_experts_on_a_padded_buffer_change_nothing_but_its_size(moe):
    """The budget's probes run one device's experts on an expert-parallel receive buffer's
    rows (``moe.experts_on_rows``): the output and every gradient stay the same."""
    x, bias = _inputs(11)

    def loss(m, x):
        out = m(x, bias)
        return jnp.sum(out.y ** 2), out.stats.counts

    def grad_fn(m, x):  # traced afresh each call: the row count is read while tracing
        return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(m, x)

    (want, want_counts), want_grads = grad_fn(moe, x)
    rows = 4 * x.shape[0] * x.shape[1] * CONFIG.num_experts_per_tok
    with moe_module.experts_on_rows(rows):
        (got, got_counts), got_grads = grad_fn(moe, x)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_array_equal(got_counts, want_counts)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
