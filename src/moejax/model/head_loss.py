"""The output head fused with its cross-entropy, in chunks of tokens: logits never whole.

The plain composition keeps the FP32 logits (tokens x vocab: 0.5 GiB per 4096 tokens of
the ``small`` preset, 2 GiB for DeepSeek-V3's vocabulary) for backward, once for the main
head and once per MTP depth, and materialises their gradient of the same size in backward.
Here the head's gradients are computed in the forward pass instead, one chunk of tokens at
a time: per chunk the FP32 logits, their log-sum-exp and the loss, then the logits'
gradient ``(softmax - onehot) / N`` rounded to the compute dtype (as the head's own VJP,
``precision.dense_matmul``, rounds its cotangent), ``dh = dlogits @ W^T`` and
``dW += h^T @ dlogits`` with FP32 accumulation. Backward only scales the kept ``dh`` (FP32,
tokens x hidden) and ``dW`` (FP32, hidden x vocab) by the loss's cotangent. The three GEMMs
are the ones autodiff would run; nothing is recomputed. Chunks run along the sequence and
keep the batch axis whole.

A batch split over mesh axes (``data``, ``expert``) runs the chunks in a ``shard_map`` over
them: each device's own rows against the kernel gathered once, its partial ``dW`` summed in
its own memory and reduced across devices once. Left to the partitioner, the chunk loop
gathered the ZeRO-3 kernel and reduce-scattered ``dW`` in every chunk, one after the other
with little beside them: 16 chunks, about 18 ms per head call of a 153 ms step (``small``,
``data=4``, 4 x H200; session 38).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from pallas_kernels.varying import mark_varying, varying_union

from moejax.parallel.sharding import check_batch_divides, manual_batch_axes, traced_batch_axes

# FP32 logits of one chunk: bounds the transient to about this much (its rounded gradient
# adds half again). 4096 tokens of a 32768-word vocabulary; 1038 of DeepSeek-V3's 129280.
CHUNK_LOGITS_BYTES = 512 * 2**20


def chunk_tokens_for(vocab_size: int) -> int:
    """Tokens per chunk whose FP32 logits fill ``CHUNK_LOGITS_BYTES``."""
    return max(1, CHUNK_LOGITS_BYTES // (4 * vocab_size))


def head_cross_entropy(h: jax.Array, kernel: jax.Array, labels: jax.Array,
                       chunk_tokens: int | None = None) -> jax.Array:
    """Mean next-token cross-entropy (nats, FP32) of ``softmax(h @ kernel)`` against
    ``labels``: h (B, S, H) in the compute dtype, kernel (H, V) in any float dtype (cast to
    h's for the GEMMs), labels (B, S) int in [0, V). ``chunk_tokens`` (default
    ``chunk_tokens_for(V)``) bounds B x positions per chunk. Under shard_map the kernel is
    typed as varying like h, so its gradient is a per-device partial like h's; inside a
    ``shard_map`` manual over the batch axes (the pipeline executor's) the mean is still
    over the whole batch, one ``pmean`` of the scalar, and dW stays this device's part."""
    if h.ndim != 3 or labels.shape != h.shape[:2] or kernel.shape[0] != h.shape[-1]:
        raise ValueError(f"head_cross_entropy: h (B, S, H), labels (B, S) and kernel (H, V) "
                         f"must agree; got h {h.shape}, labels {labels.shape}, kernel "
                         f"{kernel.shape}")
    chunk = chunk_tokens or chunk_tokens_for(kernel.shape[1])
    axes = traced_batch_axes()
    rows = h.shape[0] // (check_batch_divides(h.shape[0], axes) if axes else 1)
    positions = max(1, min(h.shape[1], chunk // rows))
    kernel = mark_varying(kernel, varying_union((h, labels)))
    loss = _head_ce(h, kernel, labels, positions, axes,
                    (np.dtype(h.dtype), np.dtype(kernel.dtype)))
    manual = manual_batch_axes()
    return jax.lax.pmean(loss, manual) if manual else loss


def _chunked(x: jax.Array, positions: int) -> jax.Array:
    """(B, S, ...) -> (S_padded / positions, B, positions, ...), zero-padded along S."""
    b, s = x.shape[:2]
    n = math.ceil(s / positions)
    x = jnp.pad(x, [(0, 0), (0, n * positions - s)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(b, n, positions, *x.shape[2:]).swapaxes(0, 1)


def _unchunked(x: jax.Array, seq: int) -> jax.Array:
    """Inverse of ``_chunked`` for (n, B, positions, ...), cut back to ``seq`` positions."""
    n, b, p = x.shape[:3]
    return x.swapaxes(0, 1).reshape(b, n * p, *x.shape[3:])[:, :seq]


def _pair_sum(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]
              ) -> tuple[jax.Array, jax.Array]:
    """Two (max, sum of exp(x - max)) pairs as one: the online softmax's recurrence."""
    (m1, s1), (m2, s2) = a, b
    m = jnp.maximum(m1, m2)
    # a pair at the running max scales by exp(0): also where both maxima are -inf
    scale = lambda mi: jnp.exp(jax.lax.select(mi == m, jnp.zeros_like(mi), mi - m))  # noqa: E731
    return m, s1 * scale(m1) + s2 * scale(m2)


def logsumexp_one_pass(x: jax.Array) -> jax.Array:
    """``jax.nn.logsumexp(x, axis=-1)`` of finite FP32 x from one read of x: a variadic
    reduction of (max, sum of exp relative to it) pairs, where jax.nn.logsumexp reads x
    twice (a max pass, then a sum-of-exp pass). On the fused head's FP32 logits that is one
    pass fewer over each (tokens, vocab) chunk: the `small` preset's head, forward and
    backward on 16 x 1024 tokens, 7.14 -> 6.66 ms on an H100 (docs/performance.md, FP8
    training, session 46)."""
    ones = jnp.ones_like(x)
    m, total = jax.lax.reduce((x, ones), (jnp.float32(-jnp.inf), jnp.float32(0.0)), _pair_sum,
                              (x.ndim - 1,))
    return m + jnp.log(total)


def _scan(h: jax.Array, kernel: jax.Array, labels: jax.Array, positions: int,
          with_grads: bool):
    """The loss sum over real tokens, and with ``with_grads`` the FP32 dh (B, S, H) and dW
    (H, V) of the mean loss."""
    batch, seq, hidden = h.shape
    vocab = kernel.shape[1]
    count = batch * seq
    w = kernel.astype(h.dtype)
    real = jnp.ones(labels.shape, bool)  # the padding _chunked adds is False
    xs = (_chunked(h, positions), _chunked(labels, positions), _chunked(real, positions))

    def body(carry, chunk):
        loss_sum, dw = carry
        hc, yc, mask = chunk
        logits = jnp.dot(hc, w, preferred_element_type=jnp.float32)  # (B, p, V)
        lse = logsumexp_one_pass(logits)
        picked = jnp.take_along_axis(logits, yc[..., None], axis=-1)[..., 0]
        loss_sum = loss_sum + jnp.sum(jnp.where(mask, lse - picked, 0.0))
        if not with_grads:
            return (loss_sum, dw), None
        onehot = jax.nn.one_hot(yc, vocab, dtype=jnp.float32)
        weight = jnp.where(mask, 1.0 / count, 0.0)[..., None]
        dlogits = ((jnp.exp(logits - lse[..., None]) - onehot) * weight).astype(h.dtype)
        dh = jnp.dot(dlogits, w.T, preferred_element_type=jnp.float32)
        dw = dw + jnp.einsum("bph,bpv->hv", hc, dlogits, preferred_element_type=jnp.float32)
        return (loss_sum, dw), dh

    axes = varying_union((h, kernel, labels))
    dw0 = mark_varying(jnp.zeros((hidden, vocab) if with_grads else (), jnp.float32), axes)
    loss0 = mark_varying(jnp.zeros((), jnp.float32), axes)
    (loss_sum, dw), dh = jax.lax.scan(body, (loss0, dw0), xs)
    if not with_grads:
        return loss_sum / count
    return loss_sum / count, _unchunked(dh, seq), dw


def _scan_per_device(h: jax.Array, kernel: jax.Array, labels: jax.Array, positions: int,
                     axes: tuple[str, ...], with_grads: bool):
    """``_scan`` where the batch is split over the mesh ``axes`` (none: as is): each device
    scans its own rows, then the means (loss, dW) are averaged across the devices and each
    row's dh scaled to the global mean (equal shards: ``head_cross_entropy`` checked). dW
    leaves whole; a reduce-scatter along H would move half the bytes (session 37 kept it
    whole for the pipeline executor, which no longer comes here: its axes are manual)."""
    if not axes:
        return _scan(h, kernel, labels, positions, with_grads)

    def body(h, kernel, labels):
        out = _scan(h, mark_varying(kernel, axes), labels, positions, with_grads)
        if not with_grads:
            return jax.lax.pmean(out, axes)
        loss, dh, dw = out
        return jax.lax.pmean(loss, axes), dh / jax.lax.psum(1, axes), jax.lax.pmean(dw, axes)

    rows = P(axes)
    out_specs = (P(), rows, P()) if with_grads else P()
    return jax.shard_map(body, in_specs=(rows, P(), rows), out_specs=out_specs)(
        h, kernel, labels)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _head_ce(h, kernel, labels, positions, axes, dtypes):
    return _scan_per_device(h, kernel, labels, positions, axes, with_grads=False)


def _head_ce_fwd(h, kernel, labels, positions, axes, dtypes):
    loss, dh, dw = _scan_per_device(h, kernel, labels, positions, axes, with_grads=True)
    return loss, (dh, dw)


def _head_ce_bwd(positions, axes, dtypes, residuals, g):
    dh, dw = residuals
    h_dtype, kernel_dtype = dtypes
    return (g * dh).astype(h_dtype), (g * dw).astype(kernel_dtype), None


_head_ce.defvjp(_head_ce_fwd, _head_ce_bwd)
