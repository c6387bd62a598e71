"""Damaged or unusual PEFT adapter files: every defect is a LoraError naming the file and the field,
a failed load changes nothing, and PEFT's per-module rank_pattern / alpha_pattern are honoured."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from conformance import checkpoint_dir, relative_error
from litekv.converters.checkpoint import load_checkpoint
from litekv.errors import CheckpointError
from litekv.executor import LoraError, load_peft_adapter
from litekv.executor.lora import LORA_TARGETS_ALL
from litekv.executor.numpy_executor import NumpyExecutor
from litekv.safetensors_reader import SafetensorsFile

RANK = 2  # the adapters' r; the executor's LoRA inputs have rank 4
PROJ = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(checkpoint_dir("llama"), with_tokenizer=False)


@pytest.fixture
def ex(ckpt) -> NumpyExecutor:  # one per test: adapters loaded here must not leak into other tests
    return NumpyExecutor(ckpt.config, ckpt.weights, max_context=64, lora_rank=4)


def shapes(cfg, module: str, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out_dim, in_dim = {"q_proj": (q_out, cfg.hidden_size), "k_proj": (kv_out, cfg.hidden_size),
                       "v_proj": (kv_out, cfg.hidden_size), "o_proj": (cfg.hidden_size, q_out)}[module]
    return (rank, in_dim), (out_dim, rank)


def factors(cfg, seed: int = 0, ranks: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """PEFT-named A and B of every layer's q/k/v/o; `ranks` overrides RANK per module name."""
    rng, tensors = np.random.default_rng(seed), {}
    for layer in range(cfg.num_layers):
        for module in PROJ:
            name = f"model.layers.{layer}.self_attn.{module}"
            a_shape, b_shape = shapes(cfg, module, (ranks or {}).get(name, RANK))
            tensors[f"base_model.model.{name}.lora_A.weight"] = (0.3 * rng.standard_normal(a_shape)).astype(np.float32)
            tensors[f"base_model.model.{name}.lora_B.weight"] = (0.3 * rng.standard_normal(b_shape)).astype(np.float32)
    return tensors


def header_of(tensors: dict[str, np.ndarray]) -> tuple[dict, bytes]:
    header, data = {}, b""
    for name, array in tensors.items():
        dtype = {np.float32: "F32", np.int32: "I32"}[array.dtype.type]
        offsets = [len(data), len(data) + array.nbytes]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": offsets}
        data += array.tobytes()
    return header, data


def write_safetensors(path: Path, header: object, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def write_adapter(directory: Path, cfg, config: object = None, tensors: dict[str, np.ndarray] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"r": RANK, "lora_alpha": 4, "peft_type": "LORA"} if config is None else config
    (directory / "adapter_config.json").write_text(json.dumps(config))
    write_safetensors(directory / "adapter_model.safetensors", *header_of(factors(cfg) if tensors is None else tensors))
    return directory


def merged(ckpt, tensors: dict[str, np.ndarray], scales: dict[str, float]) -> NumpyExecutor:
    """The model with W + scale * B A folded into its weights, independent of the LoRA path."""
    weights = dict(ckpt.weights)
    for key, a in tensors.items():
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            layer, proj = module.split(".")[2], PROJ[module.split(".")[-1]]
            b = tensors[key.replace("lora_A", "lora_B")]
            name = f"layers.{layer}.{proj}.weight"
            weights[name] = weights[name] + scales[module] * (b @ a)
    return NumpyExecutor(ckpt.config, weights, max_context=64)


def logits(model: NumpyExecutor, lora_id: int | None = None) -> np.ndarray:
    cache = model.create_kv_cache()
    kwargs = {} if lora_id is None else {"lora_id": lora_id}
    model.prefill(np.arange(3, 12), cache, **kwargs)
    return model.step([5], cache, **kwargs)


# ---- adapter_config.json ---------------------------------------------------------------------------

BAD_CONFIGS = [
    ({"r": "abc"}, "r must be a positive integer, got 'abc'"),
    ({"r": None}, "r must be a positive integer, got None"),
    ({"r": 2.9, "lora_alpha": 4}, "r must be a positive integer, got 2.9"),
    ({"r": 0}, "r must be a positive integer, got 0"),
    ({"r": True}, "r must be a positive integer, got True"),
    ([], "holds a JSON list, not an object"),
    ("r=2", "holds a JSON str, not an object"),
    ({"r": 2, "lora_alpha": "x"}, "lora_alpha must be a finite number, got 'x'"),
    ({"r": 2, "lora_alpha": None}, "lora_alpha must be a finite number, got None"),
    ({"r": 2, "lora_alpha": float("nan")}, "lora_alpha must be a finite number, got nan"),
    ({"r": 2, "lora_alpha": float("inf")}, "lora_alpha must be a finite number, got inf"),
    ({"r": 2, "rank_pattern": ["q_proj"]}, "rank_pattern must be an object"),
    ({"r": 2, "rank_pattern": {"q_proj": "4"}}, r"rank_pattern\['q_proj'\] must be a positive integer"),
    ({"r": 2, "alpha_pattern": {"v_proj": [1]}}, r"alpha_pattern\['v_proj'\] must be a finite number"),
    ({"r": 2, "alpha_pattern": {"q_proj(": 4}}, r"alpha_pattern key 'q_proj\(' is not a valid regular expression"),
    ({"r": 2, "peft_type": "ADALORA"}, "peft_type is 'ADALORA'"),
    ({"r": 2, "use_dora": True}, "DoRA"),
    ({"r": 2, "use_rslora": "yes"}, "use_rslora must be true or false"),
]


@pytest.mark.parametrize("config, message", BAD_CONFIGS, ids=[json.dumps(c)[:40] for c, _ in BAD_CONFIGS])
def test_malformed_config_is_a_lora_error(ex, ckpt, tmp_path, config, message):
    adapter = write_adapter(tmp_path / "adapter", ckpt.config, config)
    with pytest.raises(LoraError, match=message) as caught:
        ex.load_lora(adapter)
    assert "adapter" in str(caught.value)  # names the adapter's directory or file


@pytest.mark.parametrize("raw", [b"{not json", b"\xff\xfe\x00bad utf-8"], ids=["bad-json", "bad-utf8"])
def test_unreadable_config_is_a_lora_error(ex, ckpt, tmp_path, raw):
    adapter = write_adapter(tmp_path / "adapter", ckpt.config)
    (adapter / "adapter_config.json").write_bytes(raw)
    with pytest.raises(LoraError, match="adapter_config.json cannot be read as JSON"):
        ex.load_lora(adapter)


# ---- adapter_model.safetensors -----------------------------------------------------------------------

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
Q_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


# Each edit takes the valid header of factors(cfg) and returns a damaged one.
BAD_HEADERS = {
    "header is a list": (lambda h: [1, 2], "safetensors header is a JSON list"),
    "entry is not an object": (lambda h: {**h, Q_A: 5}, "is malformed"),
    "entry lacks data_offsets": (lambda h: {**h, Q_A: {"dtype": "F32", "shape": [2, 64]}}, "is malformed"),
    "offsets are strings": (lambda h: {**h, Q_A: {**h[Q_A], "data_offsets": [str(x) for x in h[Q_A]["data_offsets"]]}},
                            "data_offsets .* is not two integers"),
    "three offsets": (lambda h: {**h, Q_A: {**h[Q_A], "data_offsets": [0, 256, 512]}}, "is not two integers"),
    "negative dims, positive product": (lambda h: {**h, Q_A: {**h[Q_A], "shape": [-2, -64]}},
                                         "shape .* is not a list of non-negative integers"),
    "float dims": (lambda h: {**h, Q_A: {**h[Q_A], "shape": [2.0, 64]}}, "is not a list of non-negative integers"),
    "shape is a string": (lambda h: {**h, Q_A: {**h[Q_A], "shape": "2,64"}}, "is not a list of non-negative integers"),
    "unknown dtype": (lambda h: {**h, Q_A: {**h[Q_A], "dtype": "Q4_K"}}, "dtype 'Q4_K', which litekv cannot read"),
    "dtype is not a string": (lambda h: {**h, Q_A: {**h[Q_A], "dtype": 7}}, "dtype 7, which litekv cannot read"),
    "offsets reversed": (lambda h: {**h, Q_A: {**h[Q_A], "data_offsets": h[Q_A]["data_offsets"][::-1]}},
                         "points outside the file or has the wrong size"),
    "offset past the end": (lambda h: {**h, Q_A: {**h[Q_A], "data_offsets": [10**12, 10**12 + 512]}},
                            "points outside the file"),
    "size disagrees with shape": (lambda h: {**h, Q_A: {**h[Q_A], "shape": [2, 63]}}, "has the wrong size"),
    "tensors overlap": (lambda h: {**h, Q_B: {**h[Q_B], "data_offsets": h[Q_A]["data_offsets"]}}, "share bytes"),
}


@pytest.mark.parametrize("change, message", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_malformed_safetensors_is_a_lora_error(ex, ckpt, tmp_path, change, message):
    adapter = write_adapter(tmp_path / "adapter", ckpt.config)
    header, data = header_of(factors(ckpt.config))
    weights = adapter / "adapter_model.safetensors"
    write_safetensors(weights, change(header), data)
    with pytest.raises(LoraError, match=message) as caught:
        ex.load_lora(adapter)
    assert str(weights) in str(caught.value)


@pytest.mark.parametrize("change, message", BAD_HEADERS.values(), ids=BAD_HEADERS.keys())
def test_malformed_safetensors_checkpoint_is_a_checkpoint_error(ckpt, tmp_path, change, message):
    """The same reader opens checkpoints: there the defects are CheckpointErrors."""
    header, data = header_of(factors(ckpt.config))
    path = tmp_path / "model.safetensors"
    write_safetensors(path, change(header), data)
    with pytest.raises(CheckpointError, match=message):
        SafetensorsFile(path)


@pytest.mark.parametrize("raw, message", [
    (b"\x01\x02\x03", "too short"),
    (struct.pack("<Q", 10**9) + b"{}", "header length 1000000000 is out of range"),
    (struct.pack("<Q", 9) + b"{\"a\": [1,", "not valid JSON"),
    (struct.pack("<Q", 4) + b"\xc3\x28{}", "not valid JSON"),
], ids=["too-short", "header-too-long", "truncated-json", "bad-utf8"])
def test_damaged_safetensors_framing_is_a_lora_error(ex, ckpt, tmp_path, raw, message):
    adapter = write_adapter(tmp_path / "adapter", ckpt.config)
    (adapter / "adapter_model.safetensors").write_bytes(raw)
    with pytest.raises(LoraError, match=message):
        ex.load_lora(adapter)


@pytest.mark.parametrize("case, message", [
    ("integer factor", "has integer or boolean values"),
    ("nan factor", "holds NaN or infinite values"),
    ("duplicate factor", "has more than one lora_A"),
])
def test_unusable_factor_values_are_a_lora_error(ex, ckpt, tmp_path, case, message):
    tensors = factors(ckpt.config)
    if case == "integer factor":
        tensors[Q_A] = tensors[Q_A].astype(np.int32)
    elif case == "nan factor":
        tensors[Q_B][3, 1] = np.nan
    else:
        tensors["other." + Q_A.removeprefix("base_model.model.")] = tensors[Q_A]
    adapter = write_adapter(tmp_path / "adapter", ckpt.config, tensors=tensors)
    with pytest.raises(LoraError, match=message):
        ex.load_lora(adapter)


# ---- loading what is valid, and nothing else ------------------------------------------------------------

def test_valid_adapter_loads_and_matches_merged_weights(ex, ckpt, tmp_path):
    tensors = factors(ckpt.config, seed=1)
    adapter = write_adapter(tmp_path / "adapter", ckpt.config, {"r": RANK, "lora_alpha": 6}, tensors)
    lora_id = ex.load_lora(adapter)
    scales = {k.removeprefix("base_model.model.").removesuffix(".lora_A.weight"): 6 / RANK
              for k in tensors if k.endswith("lora_A.weight")}
    assert relative_error(logits(ex, lora_id), logits(merged(ckpt, tensors, scales))) < 1e-5
    assert relative_error(logits(ex, lora_id), logits(ex)) > 1e-3  # the adapter does change the output


def test_failed_load_leaves_the_loaded_adapters_unchanged(ex, ckpt, tmp_path):
    good = ex.load_lora(write_adapter(tmp_path / "good", ckpt.config))
    before_ids, before_logits = dict(ex._adapters), logits(ex, good)
    header, data = header_of(factors(ckpt.config))
    bad = write_adapter(tmp_path / "bad", ckpt.config)
    write_safetensors(bad / "adapter_model.safetensors", {**header, Q_A: {**header[Q_A], "shape": [-2, -64]}}, data)
    with pytest.raises(LoraError):
        ex.load_lora(bad)
    with pytest.raises(LoraError):
        ex.load_lora(write_adapter(tmp_path / "bad_config", ckpt.config, {"r": "abc"}))
    assert ex._adapters == before_ids and set(ex._prepared) == set(before_ids)
    assert np.array_equal(logits(ex, good), before_logits)
    assert ex.load_lora(write_adapter(tmp_path / "next", ckpt.config)) == good + 1  # no id was spent


def test_rank_and_alpha_patterns_apply_per_module(ex, ckpt, tmp_path):
    """PEFT: the first key K of rank_pattern / alpha_pattern with re.match(rf"(.*\\.)?({K})$", module)
    replaces r / lora_alpha for that module; the scale is alpha / r of the module."""
    cfg = ckpt.config
    ranks = {f"model.layers.{layer}.self_attn.q_proj": 4 for layer in range(cfg.num_layers)}
    tensors = factors(cfg, seed=2, ranks=ranks)
    config = {"r": RANK, "lora_alpha": 4,
              "rank_pattern": {"q_proj": 4},
              "alpha_pattern": {"^model.layers.0.self_attn.k_proj": 16, "layers.1.self_attn.v_proj": 1,
                                "v_proj": 32}}
    adapter = write_adapter(tmp_path / "adapter", cfg, config, tensors)
    scales = {}
    for key in tensors:
        if key.endswith("lora_A.weight"):
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            scales[module] = 4 / 4 if module.endswith("q_proj") else 4 / RANK
    scales["model.layers.0.self_attn.k_proj"] = 16 / RANK
    scales["model.layers.1.self_attn.v_proj"] = 1 / RANK  # the first matching key wins
    scales["model.layers.0.self_attn.v_proj"] = 32 / RANK
    loaded = load_peft_adapter(adapter, cfg, 4, LORA_TARGETS_ALL)
    assert loaded.rank == 4
    b_q = tensors[Q_B]
    assert np.allclose(loaded.factors[(0, "q")][1], b_q * 1.0)
    b_v1 = tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert np.allclose(loaded.factors[(1, "v")][1][:, :RANK], b_v1 * 0.5)
    lora_id = ex.load_lora(adapter)
    assert relative_error(logits(ex, lora_id), logits(merged(ckpt, tensors, scales))) < 1e-5


def test_pattern_rank_above_the_models_is_refused(ex, ckpt, tmp_path):
    ranks = {"model.layers.1.self_attn.o_proj": 8}
    config = {"r": RANK, "lora_alpha": 4, "rank_pattern": {"layers.1.self_attn.o_proj": 8}}
    adapter = write_adapter(tmp_path / "adapter", ckpt.config, config, factors(ckpt.config, ranks=ranks))
    with pytest.raises(LoraError, match="adapter rank 8 is higher than the model's LoRA rank 4"):
        ex.load_lora(adapter)


def test_missing_lora_alpha_takes_peft_default(ckpt, tmp_path):
    """PEFT's LoraConfig defaults lora_alpha to 8, whatever r is."""
    tensors = factors(ckpt.config, seed=3)
    adapter = write_adapter(tmp_path / "adapter", ckpt.config, {"r": RANK}, tensors)
    loaded = load_peft_adapter(adapter, ckpt.config, 4, LORA_TARGETS_ALL)
    assert np.allclose(loaded.factors[(0, "q")][1][:, :RANK], tensors[Q_B] * (8 / RANK))
