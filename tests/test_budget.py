"""The memory budget against XLA's own ``memory_analysis()`` of the real step, its exact
terms against hand counts, the CLI verdict, and the Trainer's fail-before-compile check."""

import re

import pytest

from moejax.budget import budget_config, parse_args
from moejax.budget import main as budget_cli
from moejax.config import ConfigError
from moejax.memory import budget as budget_model
from moejax.parallel.mesh import MeshSpec
from moejax.train.config import apply_overrides, get_experiment_preset

# Deeper than the budget's reduced-depth copies (the dense layers + 3 and 4 MoE layers), so
# the estimate extrapolates rather than compiling the very step it is checked against. No MTP
# and no dense layer keep the compiles short.
SHAPES = ["model.num_hidden_layers=5", "model.first_k_dense_replace=0",
          "model.num_nextn_predict_layers=0", "train.seq_len=32", "train.batch_size=4"]


def _tiny(*extra):
    return apply_overrides(get_experiment_preset("tiny"), SHAPES + list(extra))


@pytest.mark.parametrize("remat,precision,accumulate", [
    ("none", "bf16", 1), ("selective", "fp8", 1), ("full", "bf16", 1), ("none", "bf16", 2)])
def test_budget_within_10_percent_of_xla(remat, precision, accumulate):
    """``accumulate``: train.microbatches over a batch that many times larger, so the
    micro-batch (and the reduced copies, compiled once per process) are the same."""
    cfg = _tiny(f"train.remat={remat}", f"train.precision={precision}",
                f"train.batch_size={4 * accumulate}", f"train.microbatches={accumulate}")
    progress = []
    budget = budget_model.estimate(cfg, progress=progress.append)
    peak, _ = budget_model.compiled_peak(cfg)
    assert abs(budget.step_total / peak - 1) < 0.10, budget.table()
    # both reduced-depth compiles are announced as they start (lowered here, compiled on
    # budget threads), then each is reported done with its time
    assert [m.split(": ")[1].split(" MoE")[0] for m in progress] == [
        "lowering the step with 3", "lowering the step with 4", "3", "4"], progress


@pytest.fixture
def no_workspace_compile(monkeypatch):
    """Tests of the other terms skip the reduced-depth compiles (validated above)."""
    monkeypatch.setattr(budget_model, "depth_fit",
                        lambda cfg, micro_batch, progress, expert_rows=None:
                        budget_model.DepthFit(0, 0, (2, 3)))


def test_static_terms_are_the_sharded_state(no_workspace_compile):
    """ZeRO-3 over data=2 halves every data-split leaf; experts split 4 ways over expert."""
    cfg = _tiny("train.batch_size=8", "train.ema_decay=0.9")
    one = budget_model.estimate(cfg, MeshSpec())
    split = budget_model.estimate(cfg, MeshSpec(data=2, expert=4), device_memory=2**40)
    params = lambda b: b.term("parameters").bytes  # noqa: E731
    m = cfg.model
    experts = 3 * m.num_moe_layers * m.n_routed_experts * m.hidden_size \
        * m.moe_intermediate_size * 4
    # Expert weights: / (data 2 x expert 4); everything else (matrices over `embed`) / 2,
    # except vectors and the biases, which stay whole: so between 1/8 and 1/2 of the total.
    assert params(one) / 8 < params(split) < params(one) / 2
    assert params(one) - params(split) > experts * (1 - 1 / 8) - 1
    assert split.term("gradients").bytes < params(split)  # router biases have no gradient
    assert split.term("EMA").bytes == split.term("gradients").bytes  # sharded like them
    assert not split.term("EMA").on_device  # host RAM
    # The EMA's snapshot on the device: with ema_every=1 one group, all of a device's
    # parameters; with 4 groups the largest holds about a quarter of them
    def snapshot(every):
        term = budget_model.estimate(
            _tiny("train.batch_size=8", "train.ema_decay=0.9", f"train.ema_every={every}"),
            MeshSpec(data=2, expert=4), device_memory=2**40).term("EMA snapshot")
        assert term.on_device
        return term.bytes

    assert snapshot(1) == split.term("EMA").bytes
    # XLA's count of the step program (--validate) leaves out the copy beside it
    assert split.step_total == split.device_total - split.term("EMA snapshot").bytes > 0
    assert split.term("EMA").bytes / 4 <= snapshot(4) < split.term("EMA").bytes / 3
    tokens = (8 // 8) * 32
    copies = tokens * m.num_experts_per_tok
    assert split.term("expert exchange buffers").bytes == 2 * 4 * copies * (m.hidden_size * 4 + 4)
    # expert=8: 2 experts a device, so at most 2 of a token's k=4 copies reach one device
    wide = budget_model.estimate(cfg, MeshSpec(expert=8), device_memory=2**40)
    assert wide.term("expert exchange buffers").bytes == 2 * 8 * (tokens * 2) * (
        m.hidden_size * 4 + 4)
    assert split.term("ZeRO-3 gathered layer").bytes > 0
    assert one.term("expert exchange buffers").bytes == 0
    assert split.fits


def test_cli_validate_reuses_the_probe_that_compiled_the_same_step(capsys, monkeypatch):
    """A model of 3 MoE layers is the budget's deeper probe itself: --validate compiles the
    two probes and nothing more (an FP8 step's compile takes minutes on a GPU)."""
    lowered = []
    lower = budget_model._lower_step
    monkeypatch.setattr(budget_model, "_lower_step",
                        lambda cfg, expert_rows=None: lowered.append(cfg.model.num_moe_layers)
                        or lower(cfg, expert_rows))
    budget_model._started_compile.cache_clear()
    shapes = [s.replace("=5", "=3") for s in SHAPES]
    assert budget_cli(["--validate", "--device-memory", "1TB"]
                      + [a for s in shapes for a in ("--set", s)]) == 0
    assert lowered == [3, 2]  # the real step, started first, is the deeper probe
    out = capsys.readouterr().out
    assert "XLA memory_analysis of the real step" in out
    # the real step's own numbers: the estimate's error printed against them
    assert re.search(r"budget \d+\.\d+ GiB \([+-]\d+\.\d%\)", out), out


def test_parse_bytes():
    assert budget_model.parse_bytes("80GB") == 80 * 2**30
    assert budget_model.parse_bytes("1.5 TiB") == int(1.5 * 2**40)
    assert budget_model.parse_bytes("4096") == 4096
    for bad in ("80 parsecs", "1.2.3GB", ".", "0", "0.5B"):
        with pytest.raises(ConfigError, match=f"--device-memory={bad!r}: expected a size"):
            budget_model.parse_bytes(bad)


def test_cli_verdict_and_largest_term(capsys, no_workspace_compile):
    args = ["--preset", "tiny"] + [a for s in SHAPES for a in ("--set", s)]
    assert budget_cli(args + ["--device-memory", "1MB"]) == 1
    out = capsys.readouterr().out
    assert "DOES NOT FIT in 0.00 GiB" in out and "largest term:" in out
    assert budget_cli(["--mesh", "data=3", "--preset", "tiny"]) == 2  # 16 % 3


def test_cli_budgets_the_configs_mesh_and_checks_it(capsys, no_workspace_compile):
    """--mesh and --set mesh.* both reach the budget, through the config's checks."""
    args = ["--preset", "tiny", "--device-memory", "1TB"] + [
        a for s in SHAPES for a in ("--set", s)]
    assert budget_cli(args + ["--set", "mesh.data=2", "--set", "train.batch_size=8"]) == 0
    assert "mesh pipe=1,data=2,expert=1,tensor=1" in capsys.readouterr().out
    assert budget_cli(args + ["--mesh", "tensor=2"]) == 2
    assert "mesh.tensor=2: experiments.train has no tensor parallelism" in capsys.readouterr().err
    assert budget_cli(args + ["--mesh", "expert=32", "--set", "train.batch_size=32"]) == 2
    assert "mesh.expert=32: must divide model.n_routed_experts=" in capsys.readouterr().err


def test_micro_batch_sets_the_steps_batch_for_the_mesh():
    """--micro-batch fixes the batch (here 2 a device a pass on data=3 over 2 micro-batches)
    where the preset's own batch (16) does not divide over the mesh."""
    cfg = budget_config(parse_args(["--mesh", "data=3", "--micro-batch", "2",
                                    "--set", "train.microbatches=2"]))
    assert cfg.train.batch_size == 12 and cfg.mesh == MeshSpec(data=3)


def test_zero1_gradients_are_split_over_data_like_the_moments(no_workspace_compile):
    """Under ZeRO-1 the parameters are whole on each device, and the gradients and their
    accumulator are counted split over data, as the optimizer state is (and as ZeRO-3
    counts them)."""
    cfg = _tiny("train.batch_size=8", "train.microbatches=2")
    zero1 = budget_model.estimate(apply_overrides(cfg, ["train.zero_stage=1"]), MeshSpec(data=4))
    zero3 = budget_model.estimate(cfg, MeshSpec(data=4))
    one = budget_model.estimate(cfg, MeshSpec())
    grads = lambda b: b.term("gradients").bytes  # noqa: E731
    assert grads(zero1) == grads(zero3) < grads(one) / 3
    assert zero1.term("gradient accumulator").bytes == grads(zero1)
    assert zero1.term("parameters").bytes > 3 * zero3.term("parameters").bytes


def test_trainer_fails_before_compiling_when_the_step_cannot_fit(monkeypatch, tmp_path,
                                                                   no_workspace_compile):
    from moejax.train import loop

    compiled = []
    monkeypatch.setattr(budget_model, "device_memory_limit", lambda device: 2**20)
    monkeypatch.setattr(loop, "make_train_step", lambda *a, **k: compiled.append(1))
    cfg = _tiny("train.steps=2", "train.warmup_steps=1")
    trainer = loop.Trainer(cfg, tmp_path, resume=False, log=lambda _: None)
    with pytest.raises(ConfigError, match=r"largest term is .* GiB\)") as err:
        trainer.run()
    assert "DOES NOT FIT" in str(err.value) and not compiled


def test_pipelined_terms_follow_the_placement(no_workspace_compile):
    """pipe=2: stored state is exactly what each device holds once placed (the stacks, 1
    dense and 8 MoE blocks, padded to the pipe and split over it by the sharding rules,
    nothing divided twice); DualPipe on two ranks
    holds every stage on each rank, so the held rows are the whole model with the routed
    experts split over expert=2, twice (the parameters and their gradient accumulator)."""
    import jax
    import numpy as np
    from moejax.parallel.mesh import build_mesh
    from moejax.train.placement import train_state_shardings
    from moejax.train.optimizer import make_optimizer
    from moejax.parallel.pipeline.storage import logical_stacks
    from moejax.train.step import state_initializer

    cfg = apply_overrides(get_experiment_preset("tiny"), [
        "model.num_hidden_layers=9", "train.seq_len=32", "train.batch_size=16",
        "train.pipeline_schedule=dualpipe"])
    spec = MeshSpec(pipe=2, data=2, expert=2)
    budget = budget_model.estimate(cfg, spec, device_memory=2**40)
    _, init = state_initializer(cfg, spec.pipe)
    state = jax.jit(init)(jax.numpy.uint32(0))
    assert state.params["dense_blocks"]["mlp"]["gate_proj"]["kernel"][...].shape[0] == 2
    mesh = build_mesh(spec)
    placed = jax.device_put(state, train_state_shardings(state, mesh, make_optimizer(cfg.train),
                                                         cfg.train.zero_stage))
    on_device = lambda tree: sum(  # noqa: E731
        next(s.data.nbytes for s in leaf.addressable_shards if s.device == mesh.devices.flat[0])
        for leaf in jax.tree.leaves(tree))
    assert budget.term("parameters").bytes == on_device(placed.params) + on_device(placed.biases)
    assert budget.term("optimizer state").bytes == on_device(placed.opt_state)
    whole = sum(np.asarray(leaf).nbytes
                for leaf in jax.tree.leaves(logical_stacks(state.params, cfg.model)))
    m = cfg.model
    moe_blocks = m.num_moe_layers + m.num_nextn_predict_layers  # tiny's MTP block is MoE
    experts = 3 * moe_blocks * m.n_routed_experts * m.hidden_size * m.moe_intermediate_size * 4
    assert budget.term("pipeline stage rows held").bytes == 2 * (whole - experts // 2)
    micro = 16 // (2 * 2 * 4)  # batch over data x expert x the 4 micro-batches
    assert f"micro-batch {micro} x 32" in budget.term("saved activations").note


def _probed_and_real_keep(spec: MeshSpec, *extra: str) -> tuple[int, int]:
    """The budget's per-MoE-layer keep on ``spec`` (its one-device probes, experts on the
    receive buffer's rows) and the real step's: the growth of its temp beyond the
    gradients from 3 to 4 MoE layers, compiled on this host's devices."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from moejax.train.step import state_initializer

    base = _tiny("train.batch_size=16", "train.seq_len=128", *extra)

    def temp_beyond_gradients(moe_layers: int) -> int:
        cfg = dataclasses.replace(base, model=base.model.replace(num_hidden_layers=moe_layers))
        _, analysis = budget_model.compiled_peak_on_mesh(cfg, spec)
        abstract = jax.eval_shape(state_initializer(cfg, 1)[1], jnp.uint32(0))
        return analysis.temp_size_in_bytes - budget_model.per_device_bytes(
            abstract.params, _param_shardings(abstract, cfg, spec))

    real = temp_beyond_gradients(4) - temp_beyond_gradients(3)
    micro_batch = 16 // spec.size
    rows = budget_model.expert_side_rows(base, spec, micro_batch,
                                         base.expert_parallel.resolved_transport())
    assert rows == spec.expert * micro_batch * base.train.seq_len * min(
        base.model.num_experts_per_tok, base.model.n_routed_experts // spec.expert)
    return budget_model.depth_fit(base, micro_batch, expert_rows=rows).per_moe_layer, real


def test_expert_parallel_keep_per_moe_layer_is_the_ep_steps_own():
    """Under expert parallelism each MoE layer's backward keeps the experts' side at the
    receive buffer's rows (ep x the routed rows, dropless). The budget's one-device probes
    run their experts on that many rows; their per-layer keep is checked against the
    growth of the real step's temp from 3 to 4 MoE layers on data=2, expert=4 (8 CPU
    devices). On 4 x H200 the budget without them under-counted the `small` step by 2.5x
    (session 37)."""
    probed, real = _probed_and_real_keep(MeshSpec(data=2, expert=4))
    # Within 25%, not the one-device test's 10%: the CPU transport is padded, whose send
    # side also holds ep x C rows (the probe emulates the receive side only, as the GPU's
    # ragged transport has it), and XLA:CPU's reference grouped GEMM keeps per-expert terms.
    # The probes without the receive rows read 41-49% low on these shapes.
    assert abs(probed / real - 1) < 0.25, (probed, real)


@pytest.mark.gpu
def test_gpu_ragged_keep_per_moe_layer_is_not_above_the_probes():
    """On every GPU of the host (>= 2) as one expert axis, ragged transport: the real step
    keeps per MoE layer no more than the budget's probe says, so the budget does not read
    low (the trainer refuses a batch on it). On 4 x H100 these shapes read 15.31 MiB real
    against 17.67 probed (session 40); before ``expert._zeros_after`` the real step kept
    18.34, and on `small` 52% more than its probe."""
    import jax

    if jax.device_count() < 2:
        pytest.skip("needs at least 2 GPUs")
    probed, real = _probed_and_real_keep(MeshSpec(expert=jax.device_count()),
                                         "expert_parallel.transport=ragged")
    assert real <= probed, (probed, real)


def _param_shardings(abstract, cfg, spec):
    """The parameters' shardings on ``spec`` as the trainer lays them out."""
    import jax

    from moejax.parallel.mesh import build_mesh
    from moejax.train.optimizer import make_optimizer
    from moejax.train.placement import train_state_shardings

    mesh = build_mesh(spec, jax.devices()[:spec.size])
    return train_state_shardings(abstract, mesh, make_optimizer(cfg.train),
                                 cfg.train.zero_stage).params


def test_cli_validates_a_mesh_on_this_hosts_devices(capsys):
    """--validate with --mesh compiles the real sharded step on the host's (here simulated)
    devices (the pipeline executor's step under a pipe axis) and prints its per-device
    memory beside the budget; a mesh the host cannot hold is refused before any compile."""
    args = ["--validate", "--device-memory", "1TB"] + [a for s in SHAPES for a in ("--set", s)]
    assert budget_cli(args + ["--mesh", "pipe=2,expert=2", "--set", "train.batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"real step \(per device\).* budget \d+\.\d+ GiB \([+-]\d+\.\d%\)", out), out
    assert budget_cli(args + ["--mesh", "data=16", "--set", "train.batch_size=16"]) == 2
    assert "needs 16 devices, this host has 8" in capsys.readouterr().err


def test_accumulating_zero3_step_on_a_data_mesh_within_5_percent():
    """Gradient accumulation under ZeRO-3 on data=4: each micro-batch gathers the weights
    again (the accumulator passes them an optimization barrier). When XLA hoisted the
    gathers out of the micro-batch loop, every layer's gathered weights stayed live for the
    whole step and the budget read 11% under it; it reads within 0.1% now, and +4.6%
    without accumulation."""
    cfg = _tiny("train.batch_size=16", "train.microbatches=2", "train.layer_loop=unrolled")
    mesh = MeshSpec(data=4)
    budget = budget_model.estimate(cfg, mesh)
    peak, _ = budget_model.compiled_peak_on_mesh(cfg, mesh)
    assert budget.term("gradient accumulator").bytes == budget.term("gradients").bytes > 0
    assert abs(budget.step_total / peak - 1) < 0.05, budget.table()


def test_cli_micro_batch_under_accumulation_is_per_pass(capsys):
    """--micro-batch is sequences per device per pass: with train.microbatches=2 the
    validated one-device step runs 2 passes of it."""
    args = ["--validate", "--micro-batch", "3", "--set", "train.microbatches=2"]
    assert budget_cli(args + [a for s in SHAPES for a in ("--set", s)]) == 0
    out = capsys.readouterr().out
    assert "micro-batch 3 x 32 tokens" in out and "FP32 sum over 2 micro-batches" in out
    assert re.search(r"budget \d+\.\d+ GiB \([+-]\d\.\d%\)", out), out


def test_reduced_copies_run_the_attention_of_the_mesh(monkeypatch):
    """The budget compiles one device's share of the step, but with the attention core the
    step resolves to on its own mesh: a pipelined step runs XLA's attention (cuDNN's
    attention segfaulted XLA:GPU's compile under a pipeline, session 42), so its reduced
    copies must too; an unpipelined one keeps "auto", and the layer loop is the step's."""
    import jax

    from moejax.train import step

    fitted = []
    monkeypatch.setattr(budget_model, "depth_fit",
                        lambda cfg, micro_batch, progress, expert_rows=None:
                        fitted.append(cfg.train) or budget_model.DepthFit(0, 0, (2, 3)))
    cfg = _tiny("train.batch_size=8")
    budget_model.estimate(cfg, MeshSpec())
    budget_model.estimate(cfg, MeshSpec(pipe=2))
    assert [(t.attention, t.layer_loop) for t in fitted] == [("auto", "auto"), ("xla", "auto")]

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(step, "cuda_compute_capability", lambda: 9.0)
    bf16 = apply_overrides(cfg, ["train.compute_dtype=bfloat16"])
    resolved = budget_model._resolved_for(bf16, 2).train
    assert (resolved.attention, resolved.layer_loop) == ("xla", "auto")
    with pytest.raises(ConfigError, match=r"train.attention='cudnn': cannot run under a pipeline"):
        budget_model._resolved_for(apply_overrides(bf16, ["train.attention=cudnn"]), 2)


def test_a_gpu_limit_at_jaxs_default_share_says_how_to_raise_it():
    hint = budget_model.allocator_share_hint
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95" in hint("gpu", {})
    assert hint("gpu", {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}) == ""  # the user chose
    assert hint("cpu", {}) == hint("tpu", {}) == ""
