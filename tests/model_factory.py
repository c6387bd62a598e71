"""Tiny random-weight Hugging Face checkpoints of every supported architecture, made locally.

Each checkpoint is a directory with config.json, model.safetensors and a byte-level BPE
tokenizer trained on a built-in text, so tests need nothing from a model hub.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

VOCAB_SIZE = 320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. A small model runs on the device. "
    "Caches keep keys and values for every token; attention reads them back. 0123456789 "
    "Hello world! How are you today? I am fine, thank you. The capital of France is Paris. "
) * 20

_BASE = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
             rope_theta=10000.0)

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(_BASE, model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu"),
    "llama3": dict(_BASE, model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu",
                   tie_word_embeddings=True, rope_theta=500000.0,
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=64)),
    "qwen2": dict(_BASE, model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_act="silu",
                  num_key_value_heads=1, tie_word_embeddings=True),
    "qwen3": dict(_BASE, model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_act="silu",
                  head_dim=32),
    "gemma3": dict(_BASE, model_type="gemma3_text", architectures=["Gemma3ForCausalLM"],
                   hidden_activation="gelu_pytorch_tanh", num_hidden_layers=3, num_key_value_heads=1,
                   head_dim=32, query_pre_attn_scalar=24, sliding_window=4, tie_word_embeddings=True,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling=None,
                   final_logit_softcapping=None, attn_logit_softcapping=None, bos_token_id=1, pad_token_id=0),
}
ARCHITECTURES = tuple(CONFIGS)


def hf_weights(config: dict[str, Any], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Random weights under Hugging Face names, scaled so activations stay O(1)."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    nh, nkv = config["num_attention_heads"], config["num_key_value_heads"]
    gemma = config["model_type"].startswith("gemma")

    def dense(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:  # Gemma stores w with 1 + w applied at run time
        base = 0.0 if gemma else 1.0
        return (base + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((config["vocab_size"], h)).astype(np.float32),
         "model.norm.weight": norm(h)}
    if not config.get("tie_word_embeddings"):
        w["lm_head.weight"] = dense(config["vocab_size"], h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w.update({
            f"{p}.input_layernorm.weight": norm(h),
            f"{p}.post_attention_layernorm.weight": norm(h),
            f"{p}.self_attn.q_proj.weight": dense(nh * d, h),
            f"{p}.self_attn.k_proj.weight": dense(nkv * d, h),
            f"{p}.self_attn.v_proj.weight": dense(nkv * d, h),
            f"{p}.self_attn.o_proj.weight": dense(h, nh * d),
            f"{p}.mlp.gate_proj.weight": dense(inter, h),
            f"{p}.mlp.up_proj.weight": dense(inter, h),
            f"{p}.mlp.down_proj.weight": dense(h, inter),
        })
        if config["model_type"] == "qwen2":
            for name, width in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
                w[f"{p}.self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(width)).astype(np.float32)
        if config["model_type"] in ("qwen3", "gemma3_text"):
            w[f"{p}.self_attn.q_norm.weight"] = norm(d)
            w[f"{p}.self_attn.k_norm.weight"] = norm(d)
        if gemma:
            w[f"{p}.pre_feedforward_layernorm.weight"] = norm(h)
            w[f"{p}.post_feedforward_layernorm.weight"] = norm(h)
    return w


def build_tokenizer():
    """A byte-level BPE tokenizer with chat specials, trained on TRAINING_TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    return tok


def make_checkpoint(arch: str, directory: str | Path, seed: int = 0) -> Path:
    """Write a tiny random checkpoint of `arch` (a key of CONFIGS) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = CONFIGS[arch]
    rng = np.random.default_rng(seed)
    save_file(hf_weights(config, rng), str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    build_tokenizer().save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE, "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return directory


def permute_for_interleaved_rope(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (written independently of litekv's inverse)."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def make_gguf(hf_dir: str | Path, path: str | Path, architecture: str = "llama",
              tensor_type: str = "F32") -> Path:
    """Write the llama checkpoint in `hf_dir` as a GGUF file, the way llama.cpp lays it out."""
    import gguf

    from litekv.converters.checkpoint import load_checkpoint
    from litekv.models.base import architecture as spec_for

    ckpt = load_checkpoint(hf_dir, with_tokenizer=False)
    cfg = ckpt.config
    to_gguf = {canon: name for name, canon in spec_for(cfg.architecture).gguf_names.items()}
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope.theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    for canon, array in ckpt.weights.items():
        layer_name = canon.split(".", 2)
        if canon.startswith("layers."):
            pattern, i = f"layers.{{i}}.{layer_name[2]}", layer_name[1]
        else:
            pattern, i = canon, None
        name = to_gguf[pattern].format(i=i) if i is not None else to_gguf[pattern]
        if canon.endswith(".q.weight"):
            array = permute_for_interleaved_rope(array, cfg.num_heads)
        elif canon.endswith(".k.weight"):
            array = permute_for_interleaved_rope(array, cfg.num_kv_heads)
        if array.ndim == 2 and qtype not in gguf.quants._type_traits and qtype != gguf.GGMLQuantizationType.F32:
            # a type the gguf package cannot (de)quantize: raw zero blocks of the right size
            raw = np.zeros(gguf.quant_shape_to_byte_shape(array.shape, qtype), np.uint8)
            writer.add_tensor(name, raw, raw_dtype=qtype)
        elif array.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
