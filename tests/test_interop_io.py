"""moejax's HF checkpoint export/import and its safetensors files, without transformers."""

import json
import os
import shutil
import struct

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from moejax.config import ConfigError, RopeScaling, get_model_preset
from moejax.interop import hf, safetensors_io
from moejax.model import DeepseekV3

MTP = "model.layers.4."  # tiny: 4 blocks, then MTP depth 0


def _random_model(config) -> DeepseekV3:
    """Every leaf random (init leaves norms at one and router biases at zero)."""
    graphdef, state = nnx.split(DeepseekV3(config, rngs=nnx.Rngs(0)))
    flat = nnx.to_flat_state(state)
    for i, (_, leaf) in enumerate(flat):
        leaf.set_value(jax.random.normal(jax.random.key(i), leaf.shape, leaf.dtype))
    return nnx.merge(graphdef, nnx.from_flat_state(dict(flat)))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A random tiny model (MTP depth 1) and its HF export."""
    model = _random_model(get_model_preset("tiny"))
    path = tmp_path_factory.mktemp("hf")
    hf.save(model, path)
    return model, path


def _variant(saved_path, dst, changes: dict[str, np.ndarray]):
    """A copy of the export with tensors added or replaced."""
    dst.mkdir()
    shutil.copy(saved_path / "config.json", dst)
    tensors = dict(safetensors_io.read_safetensors(saved_path / "model.safetensors"))
    safetensors_io.write_safetensors(dst / "model.safetensors", {**tensors, **changes})
    return dst


def test_save_load_roundtrip_with_mtp(saved):
    model, path = saved
    names = safetensors_io.read_safetensors(path / "model.safetensors")
    for name in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "self_attn.q_a_proj.weight", "mlp.experts.15.gate_proj.weight",
                 "mlp.gate.e_score_correction_bias"):
        assert MTP + name in names
    loaded = hf.load(path)
    assert loaded.config == model.config
    want, got = nnx.to_flat_state(nnx.state(model)), nnx.to_flat_state(nnx.state(loaded))
    assert [p for p, _ in got] == [p for p, _ in want]
    for (p, a), (_, b) in zip(want, got):
        np.testing.assert_array_equal(np.asarray(b[...]), np.asarray(a[...]), err_msg=str(p))


def test_load_skips_deepseek_mtp_copies_and_fp8_scales(saved, tmp_path):
    """DeepSeek's own layout: the MTP layer repeats the embedding and head, weights are FP8."""
    model, path = saved
    weight = np.asarray(model.mtp[0].eh_proj.kernel[...]).T
    fp8 = weight.astype(ml_dtypes.float8_e4m3fn)
    path = _variant(path, tmp_path / "ds", {
        MTP + "embed_tokens.weight": np.asarray(model.embed_tokens[...]),
        MTP + "shared_head.head.weight": np.asarray(model.lm_head.kernel[...]).T,
        MTP + "eh_proj.weight": fp8,
        MTP + "eh_proj.weight_scale_inv": np.ones((1, 2), np.float32)})
    loaded = hf.load(path)
    np.testing.assert_array_equal(loaded.mtp[0].eh_proj.kernel[...], fp8.astype(np.float32).T)


@pytest.mark.parametrize("extra", ["model.layers.1.mlp.experts.16.gate_proj.weight",
                                   "model.layers.5.input_layernorm.weight"])
def test_load_rejects_unused_tensors(saved, tmp_path, extra):
    """tiny has 16 experts and 4 + 1 (MTP) layers: one more expert or layer is no fit."""
    path = _variant(saved[1], tmp_path / "extra", {extra: np.ones((2, 2), np.float32)})
    with pytest.raises(hf.CheckpointMismatch,
                       match=rf"no place for 1 checkpoint tensor\(s\): '{extra}'$"):
        hf.load(path)


def test_zero_d_tensor_roundtrips(tmp_path):
    path = tmp_path / "s.safetensors"
    safetensors_io.write_safetensors(path, {"scalar": np.array(2.5, np.float32),
                                            "vector": np.arange(3, dtype=np.int32)})
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + header_len])
    assert header["scalar"]["shape"] == [] and header["scalar"]["data_offsets"] == [0, 4]
    tensors = safetensors_io.read_safetensors(path)
    assert tensors["scalar"].shape == () and tensors["scalar"] == 2.5
    np.testing.assert_array_equal(tensors["vector"], [0, 1, 2])


def test_failed_write_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "a.safetensors"
    safetensors_io.write_safetensors(path, {"x": np.ones(4, np.float32)})
    old = path.read_bytes()

    def fsync(fd: int) -> None:
        raise OSError("no sync")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="no sync"):
        safetensors_io.write_safetensors(path, {"x": np.zeros(8, np.float32)})
    assert path.read_bytes() == old
    assert os.listdir(tmp_path) == ["a.safetensors"]


def test_truncated_file_names_tensor_and_sizes(tmp_path):
    path = tmp_path / "cut.safetensors"
    safetensors_io.write_safetensors(path, {"a": np.ones(4, np.float32),
                                            "b": np.ones((2, 3), np.float32)})
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match=r"cut\.safetensors: tensor 'b' needs data bytes "
                                         r"\[16, 40\), the file has 35 data bytes"):
        safetensors_io.read_safetensors(path)


def test_inconsistent_offsets_name_tensor_and_sizes(tmp_path):
    path = tmp_path / "bad.safetensors"
    header = json.dumps({"w": {"dtype": "BF16", "shape": [3, 2], "data_offsets": [0, 8]}})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(12))
    with pytest.raises(ValueError, match=r"bad\.safetensors: tensor 'w' \(BF16 \[3, 2\]\) "
                                         r"needs 12 bytes, its data_offsets \[0, 8\] hold 8"):
        safetensors_io.read_safetensors(path)


@pytest.mark.parametrize("key, value, message", [
    ("attention_factor", 1.2, r"rope_scaling.attention_factor=1.2: only None \(or absent\)"),
    ("truncate", False, r"rope_scaling.truncate=False: only True \(or absent\)"),
    ("low_freq_factor", 1.0, r"rope_scaling.low_freq_factor=1.0: unknown to moejax's YaRN"),
])
def test_yarn_keys_moejax_would_ignore_are_refused(key, value, message):
    """A YaRN setting that changes the rotation must not load as a different model."""
    yarn = RopeScaling(factor=4.0, original_max_position_embeddings=256)
    values = hf.config_to_hf(get_model_preset("tiny").replace(rope_scaling=yarn))
    for harmless in ({"attention_factor": None}, {"truncate": True}):
        values["rope_parameters"].update(harmless)
        assert hf.config_from_hf(values).rope_scaling == yarn
    values["rope_parameters"][key] = value
    with pytest.raises(ConfigError, match=message):
        hf.config_from_hf(values)


def test_a_tensor_in_two_files_is_refused(saved, tmp_path):
    """Which copy would load depended on the files' order."""
    folder = tmp_path / "twice"
    shutil.copytree(saved[1], folder)
    name = next(iter(safetensors_io.read_safetensors(folder / "model.safetensors")))
    safetensors_io.write_safetensors(folder / "extra.safetensors",
                                     {name: np.zeros(3, np.float32)})
    with pytest.raises(hf.CheckpointMismatch, match=rf"tensor '{name}' is in both "
                                                    r"extra.safetensors and model.safetensors"):
        hf.load(folder)
