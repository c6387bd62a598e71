"""LoRA adapters and model configs as apps and model engineers meet them: what PEFT writes loads and
matches the merged weights, what does not fit is refused before anything changes, and every
config.json field is read with its type and its transformers meaning (or refused)."""
from __future__ import annotations

import copy
import json
import math
import struct
from pathlib import Path

import numpy as np
import pytest

from conformance import checkpoint_dir, relative_error
from litekv.converters.checkpoint import load_checkpoint
from litekv.engine import Engine
from litekv.errors import ConfigError, ContextFull
from litekv.executor import LoraError
from litekv.executor.lora import adapter_rank
from litekv.executor.numpy_executor import NumpyExecutor
from litekv.models.base import for_hf_model_type
from model_factory import CONFIGS
from test_adapter_file_validation import RANK, factors, logits, merged

# ---- LoRA -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(checkpoint_dir("llama"), with_tokenizer=False)


@pytest.fixture
def ex(ckpt) -> NumpyExecutor:
    return NumpyExecutor(ckpt.config, ckpt.weights, max_context=64, lora_rank=4)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_adapter(directory: Path, config: dict, tensors: dict[str, np.ndarray], dtype: str = "F32") -> Path:
    """A PEFT adapter directory; dtype F32, F16 or BF16 for every factor."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **config}))
    header, data = {}, b""
    for name, array in tensors.items():
        raw = {"F32": lambda a: a.astype(np.float32), "F16": lambda a: a.astype(np.float16),
               "BF16": bf16_bits}[dtype](array).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    (directory / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + data)
    return directory


def as_stored(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    """The float32 values a reader gets back from tensors stored as `dtype`."""
    if dtype == "F16":
        return {k: v.astype(np.float16).astype(np.float32) for k, v in tensors.items()}
    if dtype == "BF16":
        return {k: (bf16_bits(v).astype(np.uint32) << 16).view(np.float32) for k, v in tensors.items()}
    return tensors


def only(tensors: dict[str, np.ndarray], keep) -> dict[str, np.ndarray]:
    return {k: v for k, v in tensors.items() if keep(k)}


# (adapter_config.json, which factors the file holds, stored dtype)
SUPPORTED = {
    "fp16 factors": ({"r": RANK, "lora_alpha": 6}, lambda k: True, "F16"),
    "bf16 factors": ({"r": RANK, "lora_alpha": 6}, lambda k: True, "BF16"),
    # PEFT turns fan_in_fan_out off for nn.Linear targets, so the factors are stored as usual
    "fan_in_fan_out on Linear": ({"r": RANK, "lora_alpha": 6, "fan_in_fan_out": True}, lambda k: True, "F32"),
    "layers_to_transform": ({"r": RANK, "lora_alpha": 6, "layers_to_transform": [1], "layers_pattern": "layers",
                             "bias": "none", "modules_to_save": None}, lambda k: ".layers.1." in k, "F32"),
    "q and v only": ({"r": RANK, "lora_alpha": 6, "target_modules": ["q_proj", "v_proj"]},
                     lambda k: "q_proj" in k or "v_proj" in k, "F32"),
}


def test_an_rslora_adapter_matches_the_merged_weights_at_alpha_over_the_root_of_its_rank(ex, ckpt, tmp_path):
    """PEFT's use_rslora scales B A by alpha / sqrt(r), per module with rank_pattern."""
    ranks = {"model.layers.1.self_attn.o_proj": 3}
    tensors = factors(ckpt.config, seed=6, ranks=ranks)
    config = {"r": RANK, "lora_alpha": 6, "use_rslora": True, "rank_pattern": {"layers.1.self_attn.o_proj": 3}}
    lora_id = ex.load_lora(write_adapter(tmp_path / "a", config, tensors))
    modules = [k.removeprefix("base_model.model.").removesuffix(".lora_A.weight") for k in tensors
               if k.endswith("lora_A.weight")]
    scales = {m: 6 / math.sqrt(ranks.get(m, RANK)) for m in modules}
    assert relative_error(logits(ex, lora_id), logits(merged(ckpt, tensors, scales))) < 1e-5
    plain = {m: 6 / ranks.get(m, RANK) for m in modules}  # what the adapter would give without rsLoRA
    assert relative_error(logits(ex, lora_id), logits(merged(ckpt, tensors, plain))) > 1e-3


@pytest.mark.parametrize("config, keep, dtype", SUPPORTED.values(), ids=SUPPORTED.keys())
def test_supported_adapters_match_the_merged_weights(ex, ckpt, tmp_path, config, keep, dtype):
    tensors = only(factors(ckpt.config, seed=4), keep)
    lora_id = ex.load_lora(write_adapter(tmp_path / "a", config, tensors, dtype))
    stored = as_stored(tensors, dtype)
    scales = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight"): 6 / RANK
              for k in stored if k.endswith("lora_A.weight")}
    assert relative_error(logits(ex, lora_id), logits(merged(ckpt, stored, scales))) < 1e-5
    assert relative_error(logits(ex, lora_id), logits(ex)) > 1e-3


def test_an_alpha_that_overflows_float32_is_refused_before_loading(ex, ckpt, tmp_path):
    """alpha / r is folded into B as float32: 1e300 / 2 became inf there, and every logit NaN."""
    adapter = write_adapter(tmp_path / "a", {"r": RANK, "lora_alpha": 1e300}, factors(ckpt.config))
    with np.errstate(all="ignore"):
        with pytest.raises(LoraError, match="lora_alpha in adapter_config.json is out of range"):
            ex.load_lora(adapter)
    assert ex._adapters == {} and np.isfinite(logits(ex)).all()


def test_the_reference_engine_pads_an_adapter_only_to_the_ranks_it_uses(ckpt, tmp_path):
    """A rank_pattern entry that matches none of the adapter's modules (here the MLP's, which it
    does not target) gave the reference backend that rank: a 10**7 one padded every factor to
    gigabytes of zeros."""
    config = {"r": RANK, "lora_alpha": 4, "rank_pattern": {"mlp.down_proj": 64}}
    adapter = write_adapter(tmp_path / "a", config, factors(ckpt.config, seed=5))
    assert adapter_rank(adapter) == RANK
    engine = Engine(checkpoint_dir("llama"), backend="reference")
    engine.load_lora(adapter, "a")
    loaded = engine.executor._adapters[engine.lora_id("a")]
    assert loaded.rank == RANK and loaded.factors[(0, "q")][0].shape == (RANK, ckpt.config.hidden_size)


def test_adapter_rank_reads_ranks_of_modules_in_the_file(ckpt, tmp_path):
    ranks = {"model.layers.1.self_attn.o_proj": 3}
    config = {"r": RANK, "lora_alpha": 4, "rank_pattern": {"layers.1.self_attn.o_proj": 3}}
    assert adapter_rank(write_adapter(tmp_path / "a", config, factors(ckpt.config, ranks=ranks))) == 3


def bigger_model_factors(cfg) -> dict[str, np.ndarray]:
    tensors = factors(cfg)
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors[f"{name}.lora_A.weight"] = np.zeros((RANK, 2 * cfg.hidden_size), np.float32)
    return tensors


Q = "base_model.model.model.layers.0.self_attn.q_proj"
REFUSED = {
    "modules_to_save lm_head": ({"modules_to_save": ["lm_head"]},
                                lambda t, c: {**t, "base_model.model.lm_head.weight": np.zeros((4, 4), np.float32)},
                                "not a LoRA factor"),
    "lora_B bias": ({"lora_bias": True}, lambda t, c: {**t, f"{Q}.lora_B.bias": np.zeros(64, np.float32)},
                    "not a LoRA factor"),
    "mlp target": ({}, lambda t, c: {**t, "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight":
                                     np.zeros((RANK, 64), np.float32)}, "not a LoRA factor"),
    "bigger model": ({}, lambda t, c: bigger_model_factors(c), "expected A"),
    "deeper model": ({}, lambda t, c: {**t, Q.replace("layers.0", "layers.7") + ".lora_A.weight":
                                       t[f"{Q}.lora_A.weight"]}, "layer 7 does not exist"),
    "rank above the bundle's": ({"r": 8}, lambda t, c: {
        k: np.zeros((8, v.shape[1]) if "lora_A" in k else (v.shape[0], 8), np.float32) for k, v in t.items()},
        "adapter rank 8 is higher than the model's LoRA rank 4"),
    "DoRA": ({"use_dora": True}, lambda t, c: t, "DoRA"),
    "vision tower": ({}, lambda t, c: {**t, f"base_model.model.model.vision_tower.vision_model.encoder.layers.0"
                                           f".self_attn.q_proj.lora_A.weight": t[f"{Q}.lora_A.weight"]},
                     "adapts the model's vision_(tower|model), which litekv does not run"),
    "inf factor": ({}, lambda t, c: {**t, f"{Q}.lora_B.weight": np.full_like(t[f"{Q}.lora_B.weight"], np.inf)},
                   "NaN or infinite"),
}


@pytest.mark.parametrize("config, change, message", REFUSED.values(), ids=REFUSED.keys())
def test_adapters_that_do_not_fit_are_refused_and_change_nothing(ex, ckpt, tmp_path, config, change, message):
    good = ex.load_lora(write_adapter(tmp_path / "good", {"r": RANK, "lora_alpha": 4}, factors(ckpt.config)))
    before = logits(ex, good)
    bad = write_adapter(tmp_path / "bad", {"r": RANK, "lora_alpha": 4, **config}, change(factors(ckpt.config),
                                                                                          ckpt.config))
    with pytest.raises(LoraError, match=message):
        ex.load_lora(bad)
    assert list(ex._adapters) == [good] and np.array_equal(logits(ex, good), before)


# ---- model configs ----------------------------------------------------------------------------------

def parse(arch: str, **edits):
    """litekv's config of the tiny `arch` checkpoint's config.json with `edits` (None removes a key)."""
    c = {k: v for k, v in {**CONFIGS[arch], **edits}.items() if v is not None}
    return for_hf_model_type(c["model_type"], "cfg").config_from_hf(c, "/models/x/config.json")


def transformers_config(arch: str, **edits):
    import transformers

    c = {k: v for k, v in copy.deepcopy({**CONFIGS[arch], **edits}).items() if v is not None}  # it edits dicts
    c.pop("architectures")
    return transformers.AutoConfig.for_model(**c)


WRONGLY_TYPED = [
    ("llama", {"hidden_size": 64.5}, "hidden_size must be an integer"),  # was truncated to 64
    ("llama", {"num_key_value_heads": 1.5}, "num_key_value_heads must be an integer"),  # was 1
    ("qwen2", {"intermediate_size": "96"}, "intermediate_size must be an integer"),
    ("qwen3", {"head_dim": [32]}, "head_dim must be an integer"),  # was a TypeError
    ("llama", {"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a finite number"),  # was a ValueError
    ("llama", {"rope_theta": "10000"}, "rope_theta must be a finite number"),
    ("llama", {"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),  # was True
    ("llama", {"bos_token_id": "1"}, "bos_token_id must be an integer"),
    ("llama", {"eos_token_id": ["2", 3]}, "eos_token_id must be a token id"),
    ("llama", {"rope_scaling": "linear"}, "rope_scaling must be an object"),
    ("gemma3", {"query_pre_attn_scalar": "24"}, "query_pre_attn_scalar must be a finite number"),
    ("gemma3", {"sliding_window": 4.5}, "sliding_window must be an integer"),
]


@pytest.mark.parametrize("arch, edits, message", WRONGLY_TYPED, ids=[str(e) for _, e, _ in WRONGLY_TYPED])
def test_wrongly_typed_fields_are_config_errors_naming_the_file(arch, edits, message):
    with pytest.raises(ConfigError, match=message) as caught:
        parse(arch, **edits)
    assert "/models/x/config.json" in str(caught.value)


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "linear"}, "missing the required field 'factor'"),  # was factor 1.0: no scaling at all
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}, "'low_freq_factor'"),
    ({"rope_type": None, "type": "yarn", "factor": 4.0}, "'yarn' is not supported"),  # was the default RoPE
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported"),
    ({"rope_type": "longrope", "factor": 2.0}, "'longrope' is not supported"),
], ids=["linear-no-factor", "llama3-partial", "legacy-type-key", "dynamic", "longrope"])
def test_rope_scaling_is_exact_or_refused(scaling, message):
    with pytest.raises(ConfigError, match=message):
        parse("llama", rope_scaling=scaling)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},  # no original_max_...
    {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
     "original_max_position_embeddings": 128},
    {"type": "linear", "factor": 4.0},
], ids=["llama3-default-original", "llama3", "linear-legacy-key"])
def test_supported_rope_scaling_gives_transformers_frequencies(scaling):
    """transformers 5 takes llama3's missing original_max_position_embeddings from
    max_position_embeddings; litekv used 8192."""
    import torch  # noqa: F401  (transformers' RoPE functions need it)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers_config("llama", rope_scaling=scaling)
    theirs, _ = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu")
    cfg = parse("llama", rope_scaling=scaling)
    assert np.allclose(cfg.rope.inverse_frequencies(cfg.head_dim), theirs.numpy(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("arch, edits", [
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),  # was all full
    ("qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}),
    ("gemma3", {"layer_types": None, "sliding_window_pattern": 2}),  # was every sixth layer global
    ("gemma3", {"layer_types": None}),
], ids=["qwen2-max-window-layers", "qwen3-all-sliding", "qwen2-window-off", "gemma3-pattern", "gemma3-default"])
def test_layer_types_and_windows_follow_transformers(arch, edits):
    hf = transformers_config(arch, **edits)
    cfg = parse(arch, **edits)
    kinds = tuple("sliding" if k == "sliding_attention" else "full" for k in hf.layer_types)
    assert cfg.layer_types == kinds
    if "sliding" in kinds:
        assert cfg.sliding_window == hf.sliding_window


def test_gemma3_query_pre_attn_scalar_defaults_like_transformers():
    """Gemma3TextConfig defaults query_pre_attn_scalar to 256 whatever head_dim is; litekv used head_dim."""
    hf = transformers_config("gemma3", query_pre_attn_scalar=None)
    assert parse("gemma3", query_pre_attn_scalar=None).attn_scale == pytest.approx(hf.query_pre_attn_scalar ** -0.5)


@pytest.mark.parametrize("arch, edits, message", [
    ("qwen2", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
     "use_sliding_window is not true"),  # was sliding with no window in transformers
    ("gemma3", {"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     "layer_types must be a list of full_attention / sliding_attention"),  # was a full layer
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),  # was SiLU
    ("qwen3", {"hidden_act": "relu"}, "hidden_act='relu' is not supported"),
    ("gemma3", {"hidden_activation": "gelu"}, "hidden_activation='gelu' is not supported"),  # was tanh GELU
], ids=["qwen2-sliding-without-window", "gemma3-unknown-kind", "qwen2-gelu", "qwen3-relu", "gemma3-exact-gelu"])
def test_what_litekv_cannot_run_is_refused_not_ignored(arch, edits, message):
    with pytest.raises(ConfigError, match=message):
        parse(arch, **edits)


def test_real_configs_still_parse_as_before():
    for arch in CONFIGS:
        cfg = parse(arch)
        assert cfg.num_layers == CONFIGS[arch]["num_hidden_layers"]
    assert parse("gemma3").layer_types == ("sliding", "full", "sliding")
    assert parse("qwen2", use_sliding_window=False, sliding_window=32768, max_window_layers=21).layer_types == (
        "full", "full")
    assert parse("llama", num_key_value_heads=None, head_dim=None).num_kv_heads == 4


# ---- prefill at the context limit ---------------------------------------------------------------------

def test_a_prompt_of_exactly_max_context_fills_the_cache_and_one_more_is_refused(ckpt):
    ex = NumpyExecutor(ckpt.config, ckpt.weights, max_context=40)
    cache = ex.create_kv_cache()
    ex.prefill([], cache)
    assert cache.num_tokens == 0
    ex.prefill(np.arange(3, 43), cache)
    assert cache.num_tokens == 40
    with pytest.raises(ContextFull):
        ex.step([5], cache)
    with pytest.raises(ContextFull):
        ex.prefill([5], cache)
    assert cache.num_tokens == 40
