"""The pipeline executor against the whole-batch step: same loss, gradients and counts.

Oracle: ``jax.value_and_grad`` of the unpipelined model on one device (float32), on random
tokens and random router biases. The executor runs DualPipeV on P=2 pipe ranks, DualPipe
on P=4, with data and expert axes alongside (8 simulated devices), and DualPipeV on one
rank.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hlo_text import computations, entry, model_loops, with_callees

from experiments import pipeline_study
from moejax.config import ConfigError, get_model_preset
from moejax.model import DeepseekV3, RouterBias
from moejax.parallel.expert import ExpertParallelOptions, expert_parallel_options
from moejax.parallel.mesh import MeshSpec, build_mesh
from moejax.parallel.pipeline import SCHEDULES, build, measure
from moejax.parallel.pipeline.executor import PipelineExecutor
from moejax.parallel.pipeline.tables import tick_tables
from moejax.parallel.pipeline.stages import StagePlan
from moejax.parallel.pipeline.storage import logical_stacks, pad_stacks, stack_lengths
from moejax.parallel.sharding import batch_sharding, state_shardings
from moejax.precision import Precision

MTP_LAMBDA = 0.3
BATCH, SEQ = 16, 8
# DualPipeV on P=2 with data and expert axes, DualPipe on P=4 (uneven stages over more
# ranks), DualPipeV on one rank. Their warm-up F-only and cool-down B-only ticks are the
# ticks GPipe and 1F1B are made of (1F1B's step is also checked through the train CLI,
# tests/test_train_pipeline.py, as is DualPipeV's on P=4); what tells the schedules apart
# is their tick tables, which are replayed below for every schedule up to P=8 with tags
# for tensors. DualPipe on P=2 runs in the FP8-token test below. The other cases (GPipe's
# last: 36-50 s on 2 CPU cores) gave way, to keep the CPU suite well under 15 minutes.
CASES = [("dualpipev", MeshSpec(pipe=2, data=2, expert=2)),
         ("dualpipe", MeshSpec(pipe=4, expert=2)),
    # One rank: DualPipeV's two stages pair one micro-batch's forward with another's
    # backward around the expert exchange, with no stage to send to.
    ("dualpipev", MeshSpec(pipe=1, data=2, expert=4))]

def _config(layers: int = 5):
    """Five layers by default: one dense block (stored padded to pipe rows,
    ``storage.pad_stacks``) and four MoE blocks (split over pipe=2 and pipe=4), in stages
    of uneven size (4 stages: 2, 1, 1, 1 layers). Nine layers made each case 1.4-1.6x
    slower to compile and showed nothing more."""
    return dataclasses.replace(get_model_preset("tiny"), num_hidden_layers=layers)


def _model(config, precision: Precision = Precision.BF16):
    """(graph, params, random router biases) of the model, and random tokens."""
    graphdef, params, biases = nnx.split(
        DeepseekV3(config, rngs=nnx.Rngs(0), dtype=jnp.float32, precision=precision),
        nnx.Param, RouterBias)
    biases = jax.tree.map(
        lambda b: 0.05 * jax.random.normal(jax.random.key(1), b.shape, b.dtype), biases)
    tokens = jax.random.randint(jax.random.key(2), (BATCH, SEQ + 1), 0, config.vocab_size)
    return graphdef, params, biases, tokens


def _whole_batch_loss(graphdef, params, biases, tokens, mtp_lambda: float = MTP_LAMBDA):
    """The unpipelined model's total loss on the whole batch (the oracle's), and its parts."""
    out = nnx.merge(graphdef, params, biases).losses(tokens[:, :-1], tokens[:, 1:])
    return out.main + mtp_lambda * out.mtp + out.aux_loss, out


@pytest.fixture(scope="module")
def problem():
    """Model split into (graph, params, random biases), random tokens, the reference."""
    config = _config()
    graphdef, params, biases, tokens = _model(config)

    def loss_fn(params):
        total, out = _whole_batch_loss(graphdef, params, biases, tokens)
        return total, (out.main, out.mtp, out.aux_loss, out.expert_counts)

    (total, aux), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)
    return config, graphdef, params, biases, tokens, (total, *aux), grads


def _max_relative_error(expected, actual) -> float:
    errors = jax.tree.map(
        lambda e, a: float(jnp.max(jnp.abs(e - a)) / (jnp.max(jnp.abs(e)) + 1e-12)),
        expected, actual)
    return max(jax.tree.leaves(errors))


@pytest.mark.parametrize("name,spec", CASES, ids=[f"{n}-{m}" for n, m in CASES])
def test_executor_matches_whole_batch_step(problem, name, spec):
    config, graphdef, params, biases, tokens, (total, main, mtp, aux, counts), grads = problem
    executor = PipelineExecutor(build(name, spec.pipe, 2 * spec.pipe), graphdef, config,
                                jnp.float32, MTP_LAMBDA)
    mesh = build_mesh(spec)
    with jax.set_mesh(mesh):  # placed as in training: ZeRO-3 params, batch over data x expert
        pieces = [w for w in executor.programs[0] if executor.runs_pieces(w)]
        # DualPipe/V F&B ticks with an expert axis run piece by piece (paired.fb_tick)
        assert bool(pieces) == (name in ("dualpipe", "dualpipev") and spec.expert > 1)
        stored = pad_stacks(params, config, spec.pipe)
        args = (jax.device_put(stored, state_shardings(stored, mesh)), biases,
                jax.device_put(tokens, batch_sharding(mesh)))
        compiled = jax.jit(executor.step).lower(*args).compile()
        result = compiled(*args)
    _assert_tick_loop_reduces_no_gradients(compiled.as_text(), params)
    # ZeRO-3 shards: gathered once, their gradients reduce-scattered back to that layout
    assert ("reduce-scatter(" in compiled.as_text()) == (spec.data > 1)
    grad, stored = (tree["embed_tokens"][...] for tree in (result.grads, args[0]))
    assert grad.sharding.is_equivalent_to(stored.sharding, grad.ndim)
    np.testing.assert_allclose(result.total, total, rtol=2e-6)
    np.testing.assert_allclose(result.main, main, rtol=2e-6)
    np.testing.assert_allclose(result.mtp, mtp, rtol=2e-6)
    np.testing.assert_allclose(result.aux, aux, rtol=1e-5)
    np.testing.assert_array_equal(result.counts, counts)
    assert _max_relative_error(grads, logical_stacks(result.grads, config)) < 1e-4
    lengths = stack_lengths(config)  # the padding rows are never fetched: zero gradients
    padding = [v[...][lengths[path[0]]:] for path, v in nnx.to_flat_state(result.grads)
               if path[0] in lengths and v[...].shape[0] > lengths[path[0]]]
    assert (padding or spec.pipe == 1) and all(float(jnp.abs(g).max()) == 0.0
                                               for g in padding)


def _all_reduces(texts) -> list[str]:
    """The all-reduce and reduce-scatter instructions in HLO computations' texts."""
    return [line for text in texts for line in text.splitlines()
            if re.search(r"\b(all-reduce|reduce-scatter)(-start)?\(", line)]


def _float_elements(instruction: str) -> int:
    """Float elements in the result shape of one HLO instruction (a tuple counts all)."""
    shape = re.split(r"\b(?:all-reduce|reduce-scatter)", instruction.split("=", 1)[1])[0]
    return sum(int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
               for dims in re.findall(r"\b(?:f32|bf16|f16)\[([\d,]*)\]", shape))


def _assert_tick_loop_reduces_no_gradients(hlo: str, params) -> None:
    """Each tick's backward leaves this device's partial gradients: the compiled tick
    loop all-reduces only routing totals and losses (integers, and a few floats per MoE
    block), never a parameter's gradient, which are summed once, after the loop. (Manual
    over ``pipe`` only, every B tick all-reduced its gradients: session 39.)"""
    ticks = model_loops(hlo, within=entry(hlo))
    assert len(ticks) == 1, "the tick loop is not the step's one outer loop"
    in_loop = _all_reduces(with_callees(hlo, ticks))
    sizes = [v[...].size for _, v in nnx.to_flat_state(params)]
    assert in_loop, "the tick loop lost its routing totals"
    assert max(map(_float_elements, in_loop)) < min(sizes), in_loop
    # the detector sees the gradients' sums where they are: the embedding's, after the loop
    embedding = params["embed_tokens"][...].size
    assert sum(map(_float_elements, _all_reduces(computations(hlo).values()))) >= embedding


def test_executor_with_fp8_matches_the_sharded_step():
    """DeepSeek-V3's FP8 recipe, FP8 token transport included: DualPipe's F&B ticks pair pieces
    whose dispatch sends FP8 rows, and the linears run FP8 GEMMs. The oracle is the
    unpipelined step on the same expert mesh with the same settings. Both quantize the same
    rows for the forward, so the losses agree far inside FP8's error. The backward's
    quantizations (the expert outputs' gradient on the wire, the wgrads' 128-token tiles)
    see a micro-batch here and the whole batch there, so elements round to different E4M3
    neighbours (steps of 6-12%): the pipelined gradients must be as close to the float32
    model's as the unpipelined ones are (a few per cent on most leaves). (Before session 41
    this step hung on CPU: the partitioner put collectives in branches of the tick's switch
    that only some ranks take.) Two MoE blocks, one per stage, keep the compiles short (a
    dense block in stage 0 as well cost a quarter more time)."""
    config = dataclasses.replace(_config(layers=2), first_k_dense_replace=0)
    graphdef, params, biases, tokens = _model(config, Precision.FP8)
    exact_graph = _model(config)[0]
    spec = MeshSpec(pipe=2, expert=4)
    executor = PipelineExecutor(build("dualpipe", 2, 4), graphdef, config, jnp.float32,
                                MTP_LAMBDA)

    grad_fn = jax.jit(jax.value_and_grad(
        lambda params, graph: _whole_batch_loss(graph, params, biases, tokens)[0]),
        static_argnums=1)
    _, exact = grad_fn(params, exact_graph)  # float32 on one device: the mesh adds nothing
    with jax.set_mesh(build_mesh(spec)):
        with expert_parallel_options(ExpertParallelOptions(token_format="fp8")):
            assert any(executor.runs_pieces(w) for w in executor.programs[0])
            total, grads = grad_fn(params, graphdef)
            result = jax.jit(executor.step)(pad_stacks(params, config, 2), biases, tokens)
    np.testing.assert_allclose(result.total, total, rtol=1e-5)
    whole = _max_relative_error(exact, grads)
    pipelined = _max_relative_error(exact, logical_stacks(result.grads, config))
    # FP8 moves the smallest gradients most (a norm weight's, 1e-6, by about half of it)
    assert 0 < whole and pipelined < 1.1 * whole, (whole, pipelined)


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("ranks,microbatches", [(2, 4), (4, 8), (4, 10), (8, 16)])
def test_tables_deliver_every_input_before_its_use(name, ranks, microbatches):
    """Replays the tables with tags instead of tensors: every F reads the activation the
    previous stage made for the same micro-batch, every B the gradient of the next stage,
    no arrival overwrites an entry still in use, every chunk of the schedule runs exactly
    once, and each rank's buffers stay within the schedule's activation bound + 1."""
    schedule = build(name, ranks, microbatches)
    tables = tick_tables(schedule)
    rows = tables.rows
    last = schedule.num_stages - 1
    acts: dict = {}
    grads: dict = {}
    ran = []
    for t in range(tables.num_ticks):
        f_out, b_out = [None] * ranks, [None] * ranks
        for r in range(ranks):
            on, stage, entry, mb = rows["f"][t, r]
            if on:
                if stage > 0:
                    assert acts[(r, entry)] == ("act", stage, mb)
                f_out[r] = ("act", stage + 1, mb) if stage < last else None
                ran.append(("F", stage, mb))
            on, stage, act, grad, mb = rows["b"][t, r]
            if on:
                if stage > 0:
                    assert acts.pop((r, act)) == ("act", stage, mb)
                if stage < last:
                    assert grads.pop((r, grad)) == ("grad", stage, mb)
                b_out[r] = ("grad", stage - 1, mb) if stage > 0 else None
                ran.append(("B", stage, mb))
        for store, outs, kind, sizes in ((acts, f_out, "act", tables.act_entries),
                                         (grads, b_out, "grad", tables.grad_entries)):
            for r in range(ranks):
                for source, src in (("left", r - 1), ("right", r + 1), ("local", r)):
                    on, entry = rows[f"{kind}_{source}"][t, r]
                    if on:
                        assert outs[src] is not None
                        assert (r, entry) not in store and entry < sizes[r]
                        store[(r, entry)] = outs[src]
    assert not acts and not grads
    expected = [(k, s, mb) for k in "FB" for s in range(schedule.num_stages)
                for mb in range(microbatches)]
    assert sorted(ran) == sorted(expected)
    assert all(n <= bound + 1 for n, bound in zip(tables.act_entries,
                                                  schedule.activation_bounds))


def test_stage_plan_splits_layers_contiguously_and_rejects_too_many_stages():
    config = dataclasses.replace(get_model_preset("tiny"), num_hidden_layers=7)
    plan = StagePlan.split(config, 3)
    assert plan.layers == ((0, 3), (3, 5), (5, 7))
    assert plan.shape(0) == (True, False, 1, 2) and plan.offsets(1) == (1, 2)
    assert plan.shape(2) == (False, True, 0, 2)
    with pytest.raises(ConfigError, match=r"model.num_hidden_layers=7.*8 pipeline stages"):
        StagePlan.split(config, 8)


def test_batch_that_micro_batches_cannot_split_per_device_is_named(problem):
    """Each device splits its own rows into the micro-batches: 16 rows over data=2 x
    expert=4 is 2 a device, which 4 micro-batches cannot share; refused before tracing."""
    config, graphdef, params, biases, tokens, *_ = problem
    executor = PipelineExecutor(build("gpipe", 1, 4), graphdef, config, jnp.float32,
                                MTP_LAMBDA)
    with jax.set_mesh(build_mesh(MeshSpec(data=2, expert=4))):
        for run in (executor.step, executor.timed_step):  # the timed chain checks it too
            with pytest.raises(ConfigError, match=r"batch 16: must be divisible by the 4 "
                                                 r"micro-batches x the 8 devices"):
                run(pad_stacks(params, config, 1), biases, tokens)


def test_study_measures_the_executor(capsys, tmp_path):
    """--measure fills the measured column from the executor's per-tick timings; with
    --profile the step is traced (XLA:CPU's trace has no kernels: no exposed share)."""
    pipeline_study.main(["--ranks", "2", "--microbatches", "4", "--measure", "--schedules",
                         "1f1b", "--layers", "2", "--batch", "4", "--seq", "4",
                         "--repeats", "1", "--profile", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    measured = [line for line in lines if line.startswith("1f1b ")]
    assert len(measured) == 2  # the executor's table and the study's table
    assert "%" in measured[0].split()[4] and "pending" not in measured[1]
    assert measured[0].split()[-2] == "-"  # exp. a2a
    assert list(tmp_path.glob("1f1b/plugins/profile/*/*.trace.json.gz"))
    assert "not run" in next(line for line in lines if line.startswith("gpipe "))


def test_study_times_inputs_placed_as_training_keeps_them(monkeypatch):
    """The study hands the executor its parameters, biases and tokens in the train state's
    layout: left on the default device, every timed call first re-sent them to the other
    devices (53 peer copies in a 2-GPU step, session 42)."""
    class Captured(Exception):
        pass

    def capture(self, params, biases, tokens, *rest):
        raise Captured(self, params, biases, tokens)

    monkeypatch.setattr(PipelineExecutor, "timed_step", capture)
    problem, spec = measure.make_problem("tiny", 3, 8, 4, "float32"), MeshSpec(2, 2, 2)
    with pytest.raises(Captured) as caught:
        measure.measure_schedule(problem, "1f1b", spec, 4)
    executor, params, biases, tokens = caught.value.args
    mesh = build_mesh(spec, jax.devices()[:spec.size])
    wanted = state_shardings(params, mesh, executor.zero_stage)
    for (path, value), (_, sharding) in zip(nnx.to_flat_state(params),
                                            nnx.to_flat_state(wanted)):
        assert value[...].sharding.is_equivalent_to(sharding.get_value(), value[...].ndim), path
    assert params["dense_blocks"]["input_layernorm"]["weight"][...].shape[0] == 2  # 1, padded
    assert tokens.sharding.is_equivalent_to(batch_sharding(mesh), 2)
    assert all(b.sharding.is_fully_replicated and len(b.sharding.device_set) == mesh.size
               for b in jax.tree.leaves(biases))


def test_timed_step_chain_equals_the_step_and_compiles_the_tick_range_once(monkeypatch):
    """The timing chain (held rows, init, a tick range run tick by tick, finish) gives the
    whole-batch step's loss and gradients (the one-device oracle the executor cases use,
    a far shorter compile than the pipelined step's), and one time per tick. init lays out
    the buffers and gradients as the ticks leave them, so timing tick by tick reuses the
    chain's compile of the tick range. (Before, the second tick compiled the program
    again: 7-9 s in every per-tick timing, seen on 4 x H200; session 37.)"""
    from moejax.parallel.pipeline.measure import MTP_LAMBDA as STUDY_LAMBDA, make_problem
    p = make_problem("tiny", 2, 16, 4, "float32")
    executor = PipelineExecutor(build("1f1b", 2, 4), p.graphdef, p.config, p.dtype,
                                STUDY_LAMBDA)
    built = []
    build_programs = PipelineExecutor.timing_programs
    monkeypatch.setattr(PipelineExecutor, "timing_programs",
                        lambda self, params: built.append(build_programs(self, params))
                        or built[-1])
    total, grads = jax.jit(jax.value_and_grad(lambda params: _whole_batch_loss(
        p.graphdef, params, p.biases, p.tokens, STUDY_LAMBDA)[0]))(p.params)
    params = pad_stacks(p.params, p.config, 2)
    with jax.set_mesh(build_mesh(MeshSpec(pipe=2, data=2, expert=2))):
        got, step_s, ticks = executor.timed_step(params, p.biases, p.tokens, repeats=1)
    np.testing.assert_allclose(got.total, total, rtol=2e-6)
    assert _max_relative_error(grads, logical_stacks(got.grads, p.config)) < 1e-4
    assert len(ticks) == executor.tables.num_ticks and step_s > 0
    assert len(built) == 1 and built[0].ticks._cache_size() == 1


def test_peak_memory_is_reported_per_pipe_rank():
    """The study's peak column: per pipe rank, the largest allocator peak of its devices;
    none where a backend keeps no statistics (XLA:CPU)."""
    from types import SimpleNamespace
    from moejax.parallel.pipeline.measure import _peak_bytes

    def device(peak):
        return SimpleNamespace(memory_stats=lambda: None if peak is None
                               else {"peak_bytes_in_use": peak})

    grid = np.empty((2, 2), object)  # (pipe, expert)
    for (r, e), peak in np.ndenumerate(np.array([[5, 7], [3, 2]])):
        grid[r, e] = device(int(peak))
    mesh = SimpleNamespace(axis_names=("pipe", "expert"), devices=grid)
    assert _peak_bytes(mesh) == (7, 3)
    grid[1, 1] = device(None)
    assert _peak_bytes(mesh) is None
