"""Checkpoint loading: GGUF layout conversions, sharded safetensors, and one test per bad input."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from litekv.converters.checkpoint import load_checkpoint, read_config
from litekv.errors import (CheckpointError, CheckpointNotFound, ConfigError, UnsupportedArchitecture,
                           UnsupportedTensorType, WeightShapeMismatch)
from litekv.reference import ReferenceModel
from model_factory import make_checkpoint, make_gguf


@pytest.fixture
def llama_dir(tmp_path):
    return make_checkpoint("llama", tmp_path / "llama", seed=5)


def logits_of(ckpt, tokens):
    ref = ReferenceModel(ckpt.config, ckpt.weights)
    return ref.forward(np.array(tokens), ref.new_cache(32))


def test_gguf_llama_is_unpermuted_to_the_same_model(llama_dir, tmp_path):
    hf = load_checkpoint(llama_dir, with_tokenizer=False)
    gg = load_checkpoint(make_gguf(llama_dir, tmp_path / "m.gguf"), with_tokenizer=False)
    assert gg.format == "gguf" and gg.config.num_kv_heads == hf.config.num_kv_heads
    np.testing.assert_array_equal(gg.weights["layers.1.q.weight"], hf.weights["layers.1.q.weight"])
    np.testing.assert_array_equal(logits_of(gg, [5, 9, 17, 33]), logits_of(hf, [5, 9, 17, 33]))


def test_gguf_quantized_tensors_are_dequantized(llama_dir, tmp_path):
    hf = load_checkpoint(llama_dir, with_tokenizer=False)
    gg = load_checkpoint(make_gguf(llama_dir, tmp_path / "q8.gguf", tensor_type="Q8_0"), with_tokenizer=False)
    w, ref = gg.weights["layers.0.gate.weight"], hf.weights["layers.0.gate.weight"]
    assert w.dtype == np.float32
    assert 0 < np.max(np.abs(w - ref)) < 0.02 * np.max(np.abs(ref))


def test_sharded_safetensors_directory(llama_dir, tmp_path):
    from safetensors.numpy import load_file, save_file

    sharded = tmp_path / "sharded"
    shutil.copytree(llama_dir, sharded)
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(sharded / file))
    weight_map = {n: f for f, part in halves.items() for n in part}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    np.testing.assert_array_equal(logits_of(load_checkpoint(sharded, with_tokenizer=False), [3, 4, 5]),
                                  logits_of(load_checkpoint(llama_dir, with_tokenizer=False), [3, 4, 5]))


# ---- bad input: one test per case -------------------------------------------------------------

def test_missing_path(tmp_path):
    with pytest.raises(CheckpointNotFound, match="no such file"):
        load_checkpoint(tmp_path / "absent.gguf")


def test_directory_without_weights(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointNotFound, match="no \\*.safetensors"):
        load_checkpoint(llama_dir)


def test_missing_shard(llama_dir):
    (llama_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(CheckpointNotFound, match="gone.safetensors"):
        load_checkpoint(llama_dir)


def test_unreadable_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_checkpoint(bad)


def test_truncated_safetensors(llama_dir):
    weights = llama_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(llama_dir)


def test_unsupported_hf_architecture(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(UnsupportedArchitecture, match="'gpt2' is not supported"):
        load_checkpoint(llama_dir)


def test_unsupported_gguf_architecture(llama_dir, tmp_path):
    path = make_gguf(llama_dir, tmp_path / "falcon.gguf", architecture="falcon")
    with pytest.raises(UnsupportedArchitecture, match="'falcon'"):
        load_checkpoint(path)


def test_unsupported_gguf_tensor_type(llama_dir, tmp_path):
    path = make_gguf(llama_dir, tmp_path / "q81.gguf", tensor_type="Q8_1")
    with pytest.raises(UnsupportedTensorType, match="GGUF type Q8_1"):
        load_checkpoint(path)


def test_mismatched_tensor_shape(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    (llama_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": 100}))
    with pytest.raises(WeightShapeMismatch, match=r"mlp\.\w+_proj\.weight has shape \(\d+, \d+\) but the config implies"):
        load_checkpoint(llama_dir)


def test_config_missing_required_field(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    del config["hidden_size"]
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="'hidden_size'"):
        read_config(llama_dir)


def test_missing_weight(llama_dir):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(llama_dir / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(llama_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.up.weight"):
        load_checkpoint(llama_dir)
