"""The DualPipe paper's closed forms, kept apart so the simulator is checked against them.

PP is the number of pipeline *stages* (the paper compares schedules at equal PP): P for
GPipe, 1F1B, ZB1P and DualPipe, 2P for DualPipeV on P ranks. F, B, W, F&B are per-stage
chunk costs. Activations count stage activations held per rank.
"""

from __future__ import annotations

import dataclasses

from moejax.parallel.pipeline.simulate import Costs


@dataclasses.dataclass(frozen=True)
class PaperRow:
    bubble_text: str
    activations_text: str
    params_per_device: str  # at equal PP, so DualPipeV's two stages per rank read 2x


PAPER: dict[str, PaperRow] = {
    "gpipe": PaperRow("(PP-1)(F+B)", "M", "1x"),
    "1f1b": PaperRow("(PP-1)(F+B)", "PP", "1x"),
    "zb1p": PaperRow("(PP-1)(F+B-2W)", "PP", "1x"),
    "dualpipe": PaperRow("(PP/2-1)(F&B+B-3W)", "PP+1", "2x"),
    "dualpipev": PaperRow("(PP/2-1)(F&B+B-3W)", "PP+1", "2x"),
}


def num_stages(name: str, num_ranks: int) -> int:
    return 2 * num_ranks if name == "dualpipev" else num_ranks


def paper_bubble(name: str, num_ranks: int, costs: Costs) -> float:
    """Idle time per rank in one step, as the paper states it."""
    pp = num_stages(name, num_ranks)
    c = costs
    if name in ("gpipe", "1f1b"):
        return (pp - 1) * (c.f + c.b)
    if name == "zb1p":
        return (pp - 1) * (c.f + c.b - 2 * c.w)
    return (pp / 2 - 1) * (c.f_and_b + c.b - 3 * c.w)


def paper_activations(name: str, num_ranks: int, num_microbatches: int) -> int:
    """Peak stage activations per rank, as the paper states it (GPipe: all M)."""
    pp = num_stages(name, num_ranks)
    return {"gpipe": num_microbatches, "1f1b": pp, "zb1p": pp}.get(name, pp + 1)
