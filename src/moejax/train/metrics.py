"""Per-step metrics: one JSON object per line in ``metrics.jsonl`` and a progress line.

On resume the file is cut back to the restored step, so it always reads as one run's
history (the steps a killed process logged past its last checkpoint are re-run).
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, TextIO

from moejax.atomic_file import write_atomically

METRICS_FILE = "metrics.jsonl"
# with an expert axis: tokens on the busiest device over the mean (``step.load_balance``)
DEVICE_LOAD = "expert_device_load_max_over_mean"


def _clean(value: Any) -> Any:
    """JSON-safe scalars: numpy/jax 0-d arrays to Python numbers, NaN/inf to strings."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLog:
    """Appends records to ``RUN_DIR/metrics.jsonl``, truncated to ``resume_step`` first.

    In a multi-process run only process 0 writes (``enabled``); the others' records are the
    same global numbers.
    """

    def __init__(self, run_dir: pathlib.Path, resume_step: int | None = None, *,
                 enabled: bool = True):
        self.path = pathlib.Path(run_dir) / METRICS_FILE
        self._file: TextIO | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = [line for line in read_metrics(self.path)
                if resume_step is not None and line.get("step", 0) <= resume_step]
        # replaced whole: a kill during the cut leaves the old history, not an empty file
        write_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_metrics(path: pathlib.Path) -> list[dict[str, Any]]:
    """Every record of a metrics file (an absent file has none). A last line cut short (the
    process was killed while writing it, so it has no newline) is dropped: its step is
    re-run after the resume. Any other line that does not parse is an error naming it."""
    path = pathlib.Path(path)
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise ValueError(f"{path}, line {number}: not a metrics record ({err})") from err
    return records


def progress_line(record: dict[str, Any]) -> str:
    """A one-line human summary of a train record."""
    mfu = record.get("mfu")
    parts = [f"step {record['step']:>6}",
             f"loss {record['loss']:.4f}",
             f"mtp {record['mtp_loss']:.4f}",
             f"gnorm {record['grad_norm']:.3f}",
             f"lr {record['lr']:.2e}",
             f"load max/mean {record['expert_load_max_over_mean']:.2f}",
             *([f"device load max/mean {record[DEVICE_LOAD]:.2f}"]
               if DEVICE_LOAD in record else []),
             f"{record['tokens_per_s']:,.0f} tok/s",
             f"step {record['step_time_s'] * 1e3:.0f} ms",
             f"MFU {mfu:.1%}" if mfu is not None else "MFU n/a"]
    if record.get("dropped_tokens"):
        parts.append(f"dropped {record['dropped_tokens']} copies")
    if record.get("peak_memory_gib") is not None:
        parts.append(f"peak mem {record['peak_memory_gib']:.2f} GiB")
    return " | ".join(parts)
