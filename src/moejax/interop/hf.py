"""Hugging Face DeepSeek-V3 checkpoints <-> moejax models.

One table maps every moejax parameter to its Hugging Face tensor(s) and says how to
convert (copy, transpose a (out, in) weight into an (in, out) kernel, or stack per-expert
weights); loading and saving both read that table, so they cannot drift apart. Stacked
layers map to ``model.layers.{i}``; MTP depth d maps to ``model.layers.{L+d-1}`` with
DeepSeek's names (enorm, hnorm, eh_proj, shared_head.norm).
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from moejax.config import ConfigError, ModelConfig, RopeScaling
from moejax.atomic_file import write_atomically
from moejax.interop.safetensors_io import read_safetensors, write_safetensors
from moejax.model import DeepseekV3

Path_ = tuple[str | int, ...]


class CheckpointMismatch(ValueError):
    """A checkpoint tensor is missing, has the wrong shape for the config, or is unused."""


# ---------------------------------------------------------------------------------------
# config.json <-> ModelConfig


# YaRN keys moejax's RoPE does not read, with the value it behaves as (None: absent).
# ``truncate`` True is the floor/ceil correction range that DeepSeek's YaRN uses.
_YARN_AS_IF = {"attention_factor": None, "truncate": True}


def _refuse_unsupported_yarn(rope: dict[str, Any], fields: set[str]) -> None:
    """A YaRN key that would change the rotation and that moejax ignores is an error, not
    a silently different model."""
    known = fields | {"type", "rope_type", "rope_theta"}
    for key, value in rope.items():
        if key in known or value is None or _YARN_AS_IF.get(key, object()) == value:
            continue
        allowed = (f"only {_YARN_AS_IF[key]!r} (or absent)" if key in _YARN_AS_IF
                   else f"unknown to moejax's YaRN (it reads {sorted(fields)})")
        raise ConfigError(f"rope_scaling.{key}={value!r}: {allowed}")


def config_from_hf(values: dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a Hugging Face DeepSeek-V3 ``config.json`` dict."""
    for key, allowed in (("hidden_act", "silu"), ("scoring_func", "sigmoid"),
                         ("topk_method", "noaux_tc")):
        if key in values and values[key] != allowed:
            raise ConfigError(f"{key}={values[key]!r}: moejax supports only {allowed!r}")
    if values.get("attention_bias"):
        raise ConfigError("attention_bias=True: moejax's MLA has no projection biases")
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"rope_scaling", "rope_theta"}
    kwargs = {k: v for k, v in values.items() if k in names}
    rope = values.get("rope_parameters") or values.get("rope_scaling") or {}
    kwargs["rope_theta"] = float(rope.get("rope_theta", values.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "yarn":
        fields = {f.name for f in dataclasses.fields(RopeScaling)} - {"type"}
        _refuse_unsupported_yarn(rope, fields)
        kwargs["rope_scaling"] = RopeScaling(**{k: v for k, v in rope.items()
                                                if k in fields and v is not None})
    elif rope_type != "default":
        raise ConfigError(f"rope type {rope_type!r}: moejax supports 'default' and 'yarn'")
    return ModelConfig(**kwargs)


def config_to_hf(config: ModelConfig) -> dict[str, Any]:
    values = {k: v for k, v in dataclasses.asdict(config).items()
              if k not in ("rope_scaling", "aux_loss_alpha")}
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        rope.update(dataclasses.asdict(config.rope_scaling))
        rope["rope_type"] = rope.pop("type")
    values.update(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
        num_key_value_heads=config.num_attention_heads, hidden_act="silu",
        scoring_func="sigmoid", topk_method="noaux_tc", attention_bias=False,
        rope_parameters=rope, aux_loss_alpha=config.aux_loss_alpha)
    return values


# ---------------------------------------------------------------------------------------
# The parameter table


@dataclasses.dataclass(frozen=True)
class Entry:
    """How one moejax array is stored as HF tensors.

    kind: 'copy'; 'transpose' (HF (out, in) weight vs our (in, out) kernel); 'experts'
    (HF per-expert (out, in) weights stacked into our (E, in, out)). ``names`` are HF
    names, relative to each layer prefix when the array is stacked over layers.
    """

    kind: str
    names: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Row:
    """One moejax array: its state path, its entry, and HF layer prefixes if stacked."""

    path: Path_
    entry: Entry
    prefixes: tuple[str, ...] | None = None  # None: one unstacked array (MTP's too), full names


def _block_entry(path: Path_, num_experts: int) -> Entry:
    if path == ("mlp", "router"):
        return Entry("transpose", ("mlp.gate.weight",))
    if len(path) == 2 and path[0] == "mlp" and path[1] in ("gate_proj", "up_proj", "down_proj"):
        return Entry("experts", tuple(f"mlp.experts.{e}.{path[1]}.weight"
                                      for e in range(num_experts)))
    dotted = ".".join(str(p) for p in path)
    if path[-1] == "kernel":
        return Entry("transpose", (dotted[:-len("kernel")] + "weight",))
    return Entry("copy", (dotted,))


def _mtp_prefix(config: ModelConfig, depth: int) -> str:
    """DeepSeek-V3 stores MTP depth ``depth`` (0-based) as the layer after the last block."""
    return f"model.layers.{config.num_hidden_layers + depth}."


def _leaf_paths(module: nnx.Module) -> list[Path_]:
    return [tuple(path) for path, _ in nnx.to_flat_state(nnx.state(module))]


def _table(model: DeepseekV3) -> Iterator[Row]:
    """Every array of ``model`` with where it lives in an HF checkpoint."""
    c = model.config
    yield Row(("embed_tokens",), Entry("copy", ("model.embed_tokens.weight",)))
    yield Row(("norm", "weight"), Entry("copy", ("model.norm.weight",)))
    if model.lm_head is not None:
        yield Row(("lm_head", "kernel"), Entry("transpose", ("lm_head.weight",)))
    for attr, first, count in (("dense_blocks", 0, c.first_k_dense_replace),
                               ("moe_blocks", c.first_k_dense_replace, c.num_moe_layers)):
        stack = getattr(model, attr)
        if stack is not None:
            prefixes = tuple(f"model.layers.{first + j}." for j in range(count))
            for path in _leaf_paths(stack):
                yield Row((attr,) + path, _block_entry(path, c.n_routed_experts), prefixes)
    mtp_renames = {("norm", "weight"): Entry("copy", ("shared_head.norm.weight",))}
    for d, module in enumerate(model.mtp):  # one array per depth, not stacked: full names
        prefix = _mtp_prefix(c, d)
        for path in _leaf_paths(module):
            inner = path[1:] if path[0] == "block" else path
            entry = mtp_renames.get(path) or _block_entry(inner, c.n_routed_experts)
            yield Row(("mtp", d) + path, Entry(entry.kind, tuple(prefix + n for n in entry.names)))
    rows = [f"model.layers.{c.first_k_dense_replace + j}." for j in range(c.num_moe_layers)]
    rows += [_mtp_prefix(c, d) for d in range(len(model.mtp))]
    yield Row(("router_bias",), Entry("copy", ("mlp.gate.e_score_correction_bias",)),
              tuple(rows[:model.router_bias.shape[0]]))


def _from_hf(entry: Entry, tensors: list[np.ndarray]) -> np.ndarray:
    if entry.kind == "copy":
        return tensors[0]
    if entry.kind == "transpose":
        return tensors[0].T
    return np.stack([t.T for t in tensors])


def _to_hf(entry: Entry, array: np.ndarray) -> list[np.ndarray]:
    if entry.kind == "copy":
        return [array]
    if entry.kind == "transpose":
        return [array.T]
    return [a.T for a in array]


def _hf_shape(entry: Entry, shape: tuple[int, ...]) -> tuple[int, ...]:
    if entry.kind == "copy":
        return shape
    if entry.kind == "transpose":
        return shape[::-1]
    return shape[1:][::-1]


def _layer_names(row: Row) -> list[list[str]]:
    """HF names per layer (one list for an unstacked array)."""
    prefixes = row.prefixes if row.prefixes is not None else ("",)
    return [[prefix + n for n in row.entry.names] for prefix in prefixes]


# ---------------------------------------------------------------------------------------
# Loading


def _read_checkpoint(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's *.safetensors files (a sharded checkpoint's index is
    not needed: all shards are read). A name in two files is refused: which copy the model
    got would depend on the files' order."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    found_in: dict[str, Path] = {}
    for file in files:
        for name, value in read_safetensors(file).items():
            if name in found_in:
                raise CheckpointMismatch(f"{path}: tensor {name!r} is in both "
                                         f"{found_in[name].name} and {file.name}")
            tensors[name], found_in[name] = value, file
    return tensors


def _dequantize_fp8(weight: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """DeepSeek's released FP8 weights: one scale per 128x128 block."""
    rows, cols = weight.shape
    scale = np.repeat(np.repeat(scale_inv.astype(np.float32), 128, 0), 128, 1)[:rows, :cols]
    return weight.astype(np.float32) * scale


def _tensor(tensors: dict[str, np.ndarray], name: str, expected: tuple[int, ...]) -> np.ndarray:
    if name not in tensors:
        raise CheckpointMismatch(f"checkpoint has no tensor {name!r} (shape {expected} expected)")
    value = tensors[name]
    if tuple(value.shape) != expected:
        raise CheckpointMismatch(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, "
                                 f"the config needs {expected}")
    if value.dtype == ml_dtypes.float8_e4m3fn:
        scale_name = name + "_scale_inv"
        if scale_name not in tensors:
            raise CheckpointMismatch(f"FP8 tensor {name!r} has no {scale_name!r}")
        value = _dequantize_fp8(value, tensors[scale_name])
    return value


def _has_mtp(tensors: dict[str, np.ndarray], config: ModelConfig) -> int:
    depth = 0
    while _mtp_prefix(config, depth) + "eh_proj.weight" in tensors:
        depth += 1
    return depth


# DeepSeek's checkpoints repeat the embedding and the output head in every MTP layer;
# moejax's MTP modules share the main model's, so these copies are deliberately not read.
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")
_SCALE = "_scale_inv"  # an FP8 weight's block scales, read with the weight


def _check_all_used(tensors: dict[str, np.ndarray], used: set[str], path: Path) -> None:
    """Tensors the config has no place for (an expert or layer too many) are an error."""
    unused = sorted(n for n in tensors if n not in used
                    and not (n.endswith(_SCALE) and n[:-len(_SCALE)] in used))
    if unused:
        more = f" and {len(unused) - 5} more" if len(unused) > 5 else ""
        raise CheckpointMismatch(f"{path}: the config has no place for {len(unused)} "
                                 f"checkpoint tensor(s): {', '.join(map(repr, unused[:5]))}{more}")


def load(path: str | Path, dtype: jnp.dtype = jnp.bfloat16,
         param_dtype: jnp.dtype = jnp.float32) -> DeepseekV3:
    """Reads an HF DeepSeek-V3 checkpoint directory (config.json + safetensors).

    The model computes in ``dtype``. MTP modules are loaded when the checkpoint has their
    weights; a config asking for MTP layers the checkpoint lacks loads without them.
    """
    path = Path(path)
    config = config_from_hf(json.loads((path / "config.json").read_text()))
    tensors = _read_checkpoint(path)
    depth = _has_mtp(tensors, config)
    if depth < config.num_nextn_predict_layers:
        warnings.warn(f"{path}: config asks for {config.num_nextn_predict_layers} MTP layers, "
                      f"the checkpoint has weights for {depth}; loading {depth}")
        config = config.replace(num_nextn_predict_layers=depth)
    abstract = nnx.eval_shape(lambda: DeepseekV3(config, rngs=nnx.Rngs(0), dtype=dtype,
                                                  param_dtype=param_dtype))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    used = {_mtp_prefix(config, d) + n  # skipped on purpose: count them as read
            for d in range(len(abstract.mtp)) for n in _MTP_SHARED}
    if config.tie_word_embeddings:  # some tied checkpoints still carry the head's copy
        used.add("lm_head.weight")
    for row in _table(abstract):
        target = flat[row.path]
        layer_shape = target.shape if row.prefixes is None else target.shape[1:]
        expected = _hf_shape(row.entry, layer_shape)
        names = _layer_names(row)
        layers = [_from_hf(row.entry, [_tensor(tensors, n, expected) for n in layer])
                  for layer in names]
        used.update(n for layer in names for n in layer)
        value = layers[0] if row.prefixes is None else np.stack(layers)
        target.set_value(jnp.asarray(value, dtype=target.dtype))
    _check_all_used(tensors, used, path)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


# ---------------------------------------------------------------------------------------
# Saving


def save(model: DeepseekV3, path: str | Path) -> None:
    """Writes config.json and model.safetensors in the HF DeepSeek-V3 layout, each file
    replaced whole: a save that fails midway never leaves a half-written file."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    tensors: dict[str, np.ndarray] = {}
    for row in _table(model):
        array = np.asarray(jax.device_get(flat[row.path][...]))
        layers = [array] if row.prefixes is None else list(array)
        for names, layer in zip(_layer_names(row), layers, strict=True):
            tensors.update(zip(names, _to_hf(row.entry, layer), strict=True))
    write_safetensors(path / "model.safetensors", tensors)
    config = config_to_hf(model.config)
    write_atomically(path / "config.json", json.dumps(config, indent=2) + "\n")
