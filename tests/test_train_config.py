"""Experiment config: presets, typed --set overrides, mesh parsing, clear errors."""

import pytest

from moejax.config import ConfigError
from moejax.train.config import apply_overrides, get_experiment_preset


def test_overrides_are_parsed_by_field_type_and_validated():
    cfg = apply_overrides(get_experiment_preset("tiny"), [
        "model.num_hidden_layers=2", "train.lr=3e-4", "train.schedule_steps=none",
        "checkpoint.async_save=false", "model.q_lora_rank=None", "train.schedule=wsd"])
    assert cfg.model.num_hidden_layers == 2 and cfg.model.q_lora_rank is None
    assert cfg.train.lr == 3e-4 and cfg.train.schedule == "wsd"
    assert cfg.checkpoint.async_save is False and cfg.train.schedule_steps is None
    assert get_experiment_preset("deepseek-v3").model.n_routed_experts == 256


@pytest.mark.parametrize("override, message", [
    ("train.lr=fast", r"train.lr='fast': expected a value of type float"),
    ("train.steps=1.5", r"train.steps='1.5': expected a value of type int"),
    ("train.nope=1", r"unknown field train.nope"),
    ("optim.lr=1", r"unknown section 'optim'"),
    ("lr=1", r"expected SECTION.FIELD=VALUE"),
    ("train.lr", r"expected SECTION.FIELD=VALUE"),
    ("train.schedule=linear", r"train.schedule='linear': must be one of"),
    ("train.moments_dtype=float16", r"train.moments_dtype='float16': must be one of"),
    ("model.num_hidden_layers=0", r"^model.num_hidden_layers=0: must be a positive integer"),
    ("model.n_group=3", r"^model.n_routed_experts=16: must be divisible by n_group=3"),
    ("expert_parallel.transport=nccl", r"^expert_parallel.transport='nccl': must be one of"),
    ("mesh.data=0", r"^mesh.data=0: must be a positive integer"),
    ("mesh.expert=3", r"^mesh.expert=3: must divide model.n_routed_experts=16"),
    ("mesh.pipe=3,train.pipeline_schedule=dualpipe",
     r"^mesh.pipe=3: --mesh pipe=3 with train.pipeline_schedule='dualpipe': num_ranks=3: "
     r"DualPipe needs an even P"),
    ("mesh.pipe=2,train.pipeline_schedule=dualpipe,train.microbatches=3",
     r"^train.microbatches=3: --mesh pipe=2 with train.pipeline_schedule='dualpipe': "
     r"num_microbatches=3"),
    ("train.seq_len=4096", r"train.seq_len=4096: must be <= model.max_position_embeddings"),
    ("train.warmup_steps=200", r"train.warmup_steps=200: must be < the schedule length 200 "
                               r"\(train.steps, as train.schedule_steps is unset\); lower it, "
                               r"or for a run shorter than its schedule set "
                               r"train.schedule_steps"),
    ("checkpoint.async_save=maybe", r"expected a value of type bool"),
    ("train.seed=4294967296", r"^train.seed=4294967296: must be < 2\*\*32 = 4294967296"),
    ("train.lr=nan", r"^train.lr=nan: must be a finite number > 0"),
    ("train.grad_clip=inf", r"^train.grad_clip=inf: must be a finite number >= 0"),
    ("model.aux_loss_alpha=nan", r"^model.aux_loss_alpha=nan: must be a finite number >= 0"),
    ("train.attention=flash",
     r"train.attention='flash': must be one of \['auto', 'xla', 'cudnn'\]"),
    ("train.layer_loop=unroll",
     r"train.layer_loop='unroll': must be one of \['auto', 'scan', 'unrolled'\]"),
])
def test_bad_overrides_name_field_value_and_rule(override, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(get_experiment_preset("tiny"), override.split(","))


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ConfigError, match=r"unknown preset 'huge'; known: \[.*'tiny'"):
        get_experiment_preset("huge")


def test_cudnn_attention_is_refused_off_the_gpu():
    """cuDNN's fused attention exists only on CUDA GPUs: elsewhere the model is not built,
    and the default ("auto") picks XLA's."""
    import jax

    from moejax.train.step import attention_implementation, build_model

    cfg = apply_overrides(get_experiment_preset("tiny"), ["train.attention=cudnn"])
    if jax.default_backend() == "gpu":
        pytest.skip("on a GPU cudnn is allowed (tests/test_model.py checks its numerics)")
    with pytest.raises(ConfigError, match=r"train.attention='cudnn': needs a CUDA GPU; this "
                                          r"process runs on cpu"):
        build_model(cfg, jax.random.key(0))
    assert attention_implementation(get_experiment_preset("tiny")) == "xla"


def test_cudnn_attention_is_refused_in_float32(monkeypatch):
    """cuDNN's fused attention takes 16-bit inputs only: a float32 run asking for it is
    refused by name, and "auto" picks XLA's for it even on a Hopper GPU."""
    import jax

    from moejax.train import step

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(step, "cuda_compute_capability", lambda: 9.0)
    tiny = get_experiment_preset("tiny")
    f32 = apply_overrides(tiny, ["train.compute_dtype=float32", "train.attention=cudnn"])
    with pytest.raises(ConfigError, match=r"train.attention='cudnn': takes bfloat16 or "
                                          r"float16 inputs, and train.compute_dtype is float32"):
        step.attention_implementation(f32)
    auto = apply_overrides(tiny, ["train.attention=auto"])
    assert step.attention_implementation(
        apply_overrides(auto, ["train.compute_dtype=float32"])) == "xla"
    assert step.attention_implementation(
        apply_overrides(auto, ["train.compute_dtype=bfloat16"])) == "cudnn"


def test_cudnn_attention_is_kept_out_of_a_pipeline(monkeypatch):
    """XLA:GPU segfaults compiling the pipelined step with cuDNN attention in it (session
    42): with a pipe axis, "auto" picks XLA's attention even where it would pick cuDNN's,
    and an explicit "cudnn" is refused by name before anything compiles."""
    import jax

    from moejax.train import step

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(step, "cuda_compute_capability", lambda: 9.0)
    bf16 = apply_overrides(get_experiment_preset("tiny"), ["train.compute_dtype=bfloat16"])
    piped = apply_overrides(bf16, ["mesh.pipe=2", "mesh.data=1"])
    assert step.attention_implementation(bf16) == "cudnn"
    assert step.attention_implementation(piped) == "xla"
    with pytest.raises(ConfigError, match=r"train.attention='cudnn': cannot run under a "
                                          r"pipeline \(mesh pipe=2\)"):
        step.attention_implementation(apply_overrides(piped, ["train.attention=cudnn"]))


def test_layer_loop_auto_unrolls_on_a_gpu(monkeypatch):
    """"auto" unrolls the layers on a GPU (the faster step, with or without a pipeline) and
    scans elsewhere (the shorter compile); "scan" and "unrolled" are taken as asked; the
    model is built accordingly."""
    import jax

    from moejax.train import step

    tiny = get_experiment_preset("tiny")
    def resolved(value, *more):
        return step.layer_loop(apply_overrides(tiny, [f"train.layer_loop={value}", *more]))

    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert [resolved(v) for v in ("auto", "scan", "unrolled")] == ["scan", "scan", "unrolled"]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert [resolved(v) for v in ("auto", "scan", "unrolled")] == ["unrolled", "scan",
                                                                   "unrolled"]
    assert resolved("auto", "mesh.pipe=2", "mesh.data=1") == "unrolled"
    monkeypatch.undo()
    model = step.build_model(apply_overrides(tiny, ["train.layer_loop=unrolled"]),
                             jax.random.key(0))
    assert model.unroll_layers
