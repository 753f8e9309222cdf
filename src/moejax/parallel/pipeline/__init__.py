"""Pipeline parallelism schedules (GPipe, 1F1B, DualPipe, DualPipeV) as plain data.

``build(name, P, M)`` gives per-rank op lists; ``simulate`` turns them into timelines
(bubbles, in-flight activations); ``timeline.render`` draws them. Pure Python: the
executor over the mesh (``executor``, on the model cut by ``stages``; not
imported here, as it needs jax) consumes the same ``Schedule`` objects; ``fb_pair``
interleaves an F&B pair of expert-parallel MoE blocks piece by piece.
"""

from moejax.parallel.pipeline.schedule import (
    SCHEDULES,
    Chunk,
    Kind,
    Op,
    Schedule,
    ScheduleError,
    Tensor,
    Transfer,
    build,
)
from moejax.parallel.pipeline.simulate import Costs, Timeline, run, simulate, tick_grid

__all__ = [
    "SCHEDULES", "Chunk", "Costs", "Kind", "Op", "Schedule", "ScheduleError", "Tensor",
    "Timeline", "Transfer", "build", "run", "simulate", "tick_grid",
]
