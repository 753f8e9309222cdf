"""Where each part of the train state lives on the mesh.

Parameters and router biases follow the logical-axis rules (``moejax.parallel.sharding``)
for the chosen ZeRO stage; optimizer moments always take the ZeRO-3 layout of their
parameter (ZeRO-1 and ZeRO-3 both shard optimizer state over ``data``); step and RNG are
replicated.
"""

from __future__ import annotations

import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.parallel.sharding import state_shardings
from moejax.train.step import TrainState


def train_state_shardings(abstract: TrainState, mesh: Mesh, tx: optax.GradientTransformation,
                          zero_stage: int) -> TrainState:
    replicated = NamedSharding(mesh, P())
    params = state_shardings(abstract.params, mesh, zero=zero_stage)
    sharded_params = state_shardings(abstract.params, mesh, zero=3)
    opt_state = optax.tree_map_params(tx, lambda _, sharding: sharding, abstract.opt_state,
                                      sharded_params,
                                      transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=params,
                      biases=state_shardings(abstract.biases, mesh, zero=zero_stage),
                      opt_state=opt_state, rng=replicated)
