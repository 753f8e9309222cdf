"""Orbax checkpointing of the whole run: train state, data-iterator position, config.

Each step directory holds two items: ``state`` (params, optimizer state, router biases,
step, RNG) and ``data`` (the Grain iterator state, JSON), plus ``ema`` (the host-memory EMA
of the weights, restored into host memory) when the run keeps one. Orbax writes a step into a
temporary directory and renames it only once every item is complete, so a process killed
mid-save leaves at most a stray temporary directory that ``latest_step`` ignores and the
next manager removes. The run dir also records ``config.json``: a resume checks that the
checkpoints were made by the same configuration before touching them.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shlex
import time
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from moejax.atomic_file import write_atomically
from moejax.config import ConfigError
from moejax.train.config import CheckpointConfig

CONFIG_FILE = "config.json"
# Settings that may differ between a run and its resumption: length, LR schedule length and
# peak LR (a resume that changes the schedule logs what it does to the LR), gradient
# clipping (neither keeps optimizer state), cadences, logging,
# the device layout (a checkpoint restores onto any mesh), the attention core, the layer
# loop, and the GEMM precision (FP8 keeps no state of its own: FP32 master weights and
# optimizer state are the same in both).
RESUMABLE_CHANGES = {"train.steps", "train.schedule_steps", "train.lr", "train.grad_clip",
                     "train.log_every",
                     "train.eval_every", "train.eval_batches", "train.nonfinite",
                     "train.peak_tflops", "train.zero_stage", "train.remat",
                     "train.ema_every", "train.precision", "train.attention", "train.layer_loop",
                     "checkpoint.every", "checkpoint.keep", "checkpoint.async_save",
                     "mesh.pipe", "mesh.data", "mesh.expert", "mesh.tensor",
                     "train.pipeline_schedule", "train.microbatches",
                     "expert_parallel.transport", "expert_parallel.devices_per_node"}
# Test hook: ``MOEJAX_DEBUG_PAUSE_SAVE=STEP`` makes the save of STEP write the file
# ``<step tmp dir>/paused`` and then block forever, so a test can SIGKILL a real training
# process that is provably in the middle of writing a checkpoint.
PAUSE_ENV = "MOEJAX_DEBUG_PAUSE_SAVE"


class _PauseHandler(ocp.CheckpointHandler):
    """Blocks inside a save (test hook only; see ``PAUSE_ENV``)."""

    def save(self, directory: epath.Path, args: "_PauseSave") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "paused").write_text(str(os.getpid()))
        while True:
            time.sleep(1)

    def restore(self, directory: epath.Path, args: Any = None) -> None:
        return None


@ocp.args.register_with_handler(_PauseHandler, for_save=True)
class _PauseSave(ocp.args.CheckpointArgs):
    pass


@ocp.args.register_with_handler(_PauseHandler, for_restore=True)
class _PauseRestore(ocp.args.CheckpointArgs):
    pass


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}} -> {"a.b": 1}``: config dicts compared field by field."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check_config(run_dir: pathlib.Path, config: dict, *, has_checkpoints: bool,
                 record: bool = True) -> dict | None:
    """Records ``config`` in the run dir, after checking it against the one recorded there
    where the run dir ``has_checkpoints`` (one without, e.g. left by a run that failed
    before its first save, is simply taken over). ``record=False`` only checks: every
    process of a multi-process run checks (the run dir is shared, as Orbax's multi-process
    saves need), so all of them refuse a config together, and process 0 records it.

    Raises ConfigError naming every differing field that would make the run dir's
    checkpoints belong to another experiment, or where checkpoints have no recorded config. Returns the configuration recorded before
    (None where none is checked); the file then holds ``config``, the one the next
    checkpoints are written under. It is replaced whole (a new file renamed over it), so a
    kill mid-write leaves the old one.
    """
    path = pathlib.Path(run_dir) / CONFIG_FILE
    if has_checkpoints and not path.is_file():
        # A run records its config before its first save, so the file was removed: without
        # it nothing would stop a resume under another model, whose arrays the lenient
        # restore would then cut off or zero-fill.
        raise ConfigError(f"run dir {run_dir} holds checkpoints but no {CONFIG_FILE}, so a "
                          "resume cannot check they were made by this configuration; put "
                          f"the run's {CONFIG_FILE} back or use a new --run-dir")
    recorded = json.loads(path.read_text()) if has_checkpoints else None
    if recorded is not None:
        old, new = flatten(recorded), flatten(config)
        changed = [k for k in sorted(set(old) | set(new))
                   if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES]
        if changed:
            diffs = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
            # e.g. a preset default that changed since the run began (small's AdamW moments
            # became BF16 in session 47): --set puts a plain field back
            back = [f"--set {shlex.quote(f'{k}={old[k]}')}" for k in changed
                    if k in old and k.count(".") == 1 and not isinstance(old[k], list)]
            undo = (f", or set the recorded values back: {' '.join(back)}"
                    if len(back) == len(changed) else "")
            raise ConfigError(f"run dir {run_dir} holds checkpoints of another configuration "
                              f"({diffs}); use a new --run-dir{undo}")
    if not record:
        return recorded
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(config, indent=1))
    return recorded


def _array_tree_handler() -> ocp.PyTreeCheckpointHandler:
    """Orbax's pytree handler, writing each replicated jax.Array from one replica.

    Orbax's default handler (StandardSave's) cuts a replicated array into slices that its
    replicas write in parallel. On XLA:CPU that compiled a ``slice`` program per device
    and array: about 200 compiles, 9 s of a 33 s `tiny` run on 8 devices, where the
    write itself took under a second. Orbax already turns it off where JAX_PLATFORMS
    names a GPU; here it is off on every backend but TPU, whose default is kept.
    """
    handlers = ocp.type_handlers
    replica_parallel = None if jax.default_backend() == "tpu" else False
    scalar = handlers.ScalarHandler()
    registry = handlers.create_type_handler_registry(
        (int, scalar), (float, scalar), (bytes, scalar), (np.number, scalar),
        (np.ndarray, handlers.NumpyHandler()), (str, handlers.StringHandler()),
        (jax.Array, handlers.ArrayHandler(use_replica_parallel=replica_parallel)))
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def _restore_args(abstract: Any) -> ocp.args.PyTreeRestore:
    """Restores into ``abstract``'s shapes and shardings, non-strictly: an array stored
    with another leading size is cut off or zero-filled (see ``Checkpointer.restore``)."""
    lenient = jax.tree.map(
        lambda arg: dataclasses.replace(arg, strict=False)
        if isinstance(arg, ocp.ArrayRestoreArgs) else arg,
        ocp.checkpoint_utils.construct_restore_args(abstract))
    return ocp.args.PyTreeRestore(item=abstract, restore_args=lenient)


class Checkpointer:
    """An Orbax CheckpointManager over ``RUN_DIR/checkpoints`` keeping the last K steps."""

    def __init__(self, run_dir: pathlib.Path, cfg: CheckpointConfig,
                 progress: Callable[[str], None] = lambda message: None):
        """``progress`` hears of every wait on a write: an asynchronous save that finds
        the last one still writing, the run's end waiting for the last one, and each
        synchronous save's time. A large state takes minutes to write (`small`'s 22 GB of
        FP32 parameters and Adam moments), and the run would otherwise sit silent."""
        self.directory = pathlib.Path(run_dir).absolute() / "checkpoints"
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save, create=True,
            cleanup_tmp_directories=True)
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": _array_tree_handler(), "ema": _array_tree_handler(),
                           "data": ocp.JsonCheckpointHandler(), "pause": _PauseHandler()})
        self._pause_at = int(os.environ.get(PAUSE_ENV, "-1"))
        self._async = cfg.async_save
        self._progress = progress
        self._writing: tuple[int, float] | None = None  # the last save: step, start time

    def _await_write(self, why: str) -> None:
        """Waits for the save in flight, if any, saying so before and after."""
        if self._writing is not None and self._manager.is_saving_in_progress():
            step, began = self._writing
            self._progress(f"checkpoint: {why} waits for step {step}'s write to "
                           f"{self.directory}")
            self._manager.wait_until_finished()
            self._progress(f"checkpoint: step {step} written "
                           f"{time.perf_counter() - began:.1f} s after its save began")
        self._manager.wait_until_finished()  # also raises a failed background write's error

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: Any, data_state: dict, ema: Any = None) -> None:
        """Starts saving ``step`` (asynchronously when configured); waits for the last one."""
        items = {"state": ocp.args.PyTreeSave(state), "data": ocp.args.JsonSave(data_state)}
        if ema is not None:
            items["ema"] = ocp.args.PyTreeSave(ema)
        if step == self._pause_at:
            items["pause"] = _PauseSave()
        self._await_write(f"the save of step {step}")
        self._writing = (step, time.perf_counter())
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        if not self._async:
            self._progress(f"checkpoint: step {step} written to {self.directory} in "
                           f"{time.perf_counter() - self._writing[1]:.1f} s")

    def restore(self, step: int, abstract_state: Any,
                abstract_ema: Any = None) -> tuple[Any, dict, Any]:
        """The state (placed as ``abstract_state``'s shardings say), data position and EMA
        (None unless ``abstract_ema`` asks for it).

        Restores non-strictly: the layer stacks are stored padded to a multiple of the
        run's ``pipe`` (``parallel.pipeline.storage``), so a checkpoint written on another
        pipe size has more or fewer padding rows, cut off or zero-filled here. Nothing
        else can differ in shape: ``check_config`` has refused any other model change.
        """
        items = {"state": _restore_args(abstract_state), "data": ocp.args.JsonRestore()}
        if abstract_ema is not None:
            items["ema"] = _restore_args(abstract_ema)
        restored = self._manager.restore(step, args=ocp.args.Composite(**items))
        return restored["state"], restored["data"], restored.get("ema")

    def close(self) -> None:
        """Waits for any save in flight, then releases the manager."""
        self._await_write("the end of the run")
        self._manager.close()
