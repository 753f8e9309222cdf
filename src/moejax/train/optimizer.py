"""Learning-rate schedules and the AdamW chain.

AdamW runs on the FP32 master parameters; its two moments may be kept in BF16
(``mu_dtype`` / ``nu`` cast) to halve optimizer memory. Weight decay skips norm scales:
decaying them only fights the normalisation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax

from moejax.train.config import TrainConfig


def learning_rate(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup then cosine decay, or DeepSeek's warmup-constant-decay (``wsd``)."""
    total, warmup = cfg.total_schedule_steps, cfg.warmup_steps
    if cfg.schedule == "cosine":
        schedule = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup, decay_steps=total,
            end_value=cfg.lr * cfg.min_lr_ratio)
    else:
        # at most what warmup leaves, so the decay ends with the schedule on the final LR
        decay = min(max(1, round(cfg.wsd_decay_fraction * total)), total - warmup)
        constant = total - warmup - decay
        schedule = optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, warmup),
             optax.constant_schedule(cfg.lr),
             optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.min_lr_ratio)],
            boundaries=[warmup, warmup + constant])
    # Update n (counted from 0) uses the value at n + 1: no wasted zero-LR first step, and
    # the last update (n = total - 1) lands exactly on the final LR.
    return lambda count: schedule(count + 1)


def updates_applied(opt_state: Any) -> jax.Array:
    """The updates ``make_optimizer``'s chain has applied: the count its LR schedule (the
    chain's last link) reads. It trails the train step by the steps that a non-finite loss
    skipped (``train.nonfinite=skip`` keeps the whole optimizer state, count included), as
    a skipped iteration does not advance Megatron's scheduler either."""
    return opt_state[-1].count


def schedule_change(recorded: Mapping[str, Any], cfg: TrainConfig, step: int) -> str | None:
    """What resuming at update ``step`` under ``cfg`` does to the LR, where the schedule
    differs from the ``recorded`` run's train section: its length (``train.steps`` changed
    with ``train.schedule_steps`` unset: the cosine or WSD curve is stretched under the
    run) or its peak (``train.lr``, e.g. lowered after a non-finite loss); None where it is
    the same."""
    old = dataclasses.replace(cfg, steps=recorded["steps"],
                              schedule_steps=recorded.get("schedule_steps"),
                              lr=recorded.get("lr", cfg.lr))
    length, old_length = cfg.total_schedule_steps, old.total_schedule_steps
    changes = ([f"spans {length} steps (it spanned {old_length})"] if length != old_length
               else []) + ([f"peaks at {cfg.lr:.6g} (it peaked at {old.lr:.6g})"]
                           if cfg.lr != old.lr else [])
    if not changes:
        return None
    lr = lambda c: float(learning_rate(c)(step))  # noqa: E731
    keep = (f"; --set train.schedule_steps={old_length} keeps the old length"
            if length != old_length else "")
    return (f"the LR schedule now {' and '.join(changes)}: update {step + 1} runs at LR "
            f"{lr(cfg):.6g} (the old schedule's: {lr(old):.6g}){keep}")


def _decay_mask(params):
    """Decay matrices only: not norm scales, which are vectors even when stacked (L, h)."""

    def decays(path, p) -> bool:
        return p.ndim >= 2 and not any("norm" in str(k) for k in path)

    return jax.tree_util.tree_map_with_path(decays, params)


def adam_with_moment_dtype(cfg: TrainConfig) -> optax.GradientTransformation:
    """``scale_by_adam`` whose moments live in ``cfg.moments_dtype`` between steps."""
    dtype = jnp.dtype(cfg.moments_dtype)
    adam = optax.scale_by_adam(b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, mu_dtype=dtype)
    if dtype == jnp.float32:
        return adam

    def init(params):
        state = adam.init(params)
        return state._replace(nu=jax.tree.map(lambda v: v.astype(dtype), state.nu))

    def update(updates, state, params=None):
        full = state._replace(nu=jax.tree.map(lambda v: v.astype(jnp.float32), state.nu))
        updates, new = adam.update(updates, full, params)
        return updates, new._replace(nu=jax.tree.map(lambda v: v.astype(dtype), new.nu))

    return optax.GradientTransformation(init, update)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """clip → Adam (β2 = cfg.beta2) → decoupled weight decay on matrices → −lr(step)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        adam_with_moment_dtype(cfg),
        optax.add_decayed_weights(cfg.weight_decay, mask=_decay_mask),
        optax.scale_by_learning_rate(learning_rate(cfg)),
    )
