"""LoRA adapters in Hugging Face PEFT format, prepared as the converted model's LoRA inputs.

An adapter directory holds `adapter_config.json` (r, lora_alpha, rank_pattern, alpha_pattern) and
`adapter_model.safetensors`. Each (layer, target) becomes A [rank, in] and B [out, rank] at the
model's converted rank: lower ranks are zero-padded and the module's alpha / r is folded into B.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from litekv.errors import CheckpointError, LitekvError
from litekv.models.config import ModelConfig
from litekv.safetensors_reader import SafetensorsFile
from litekv.validation import is_int

# PEFT module names -> our canonical projection names.
_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o"}
_KEY = re.compile(r".*layers\.(\d+)\.self_attn\.(q_proj|k_proj|v_proj|o_proj)\.lora_([AB])\.weight")
# Module-path components of the parts of a multimodal model that litekv does not convert: their encoders'
# layers.N.self_attn.*_proj keys would otherwise read as the language model's.
_NOT_TEXT = frozenset({"vision_tower", "vision_model", "visual", "vision_encoder", "multi_modal_projector",
                       "audio_tower", "audio_model", "embed_vision", "embed_audio"})


class LoraError(LitekvError):
    """A LoRA adapter is unreadable or does not fit the converted model."""


@dataclass(frozen=True)
class LoraAdapter:
    name: str
    rank: int  # the adapter's own rank (<= the model's)
    # (layer, target) -> (A [model_rank, in], B [out, model_rank] with alpha / r applied), float32
    factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def projection_shape(cfg: ModelConfig, target: str) -> tuple[int, int]:
    """(out, in) of a projection."""
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q": (q_out, cfg.hidden_size), "k": (kv_out, cfg.hidden_size), "v": (kv_out, cfg.hidden_size),
            "o": (cfg.hidden_size, q_out)}[target]


def check_adapter(adapter: LoraAdapter, cfg: ModelConfig, model_rank: int, model_targets: tuple[str, ...]) -> None:
    """LoraError unless a prepared adapter (one built in code, not read by load_peft_adapter) fits the
    model: its factors on existing layers and the model's LoRA targets, shaped for its rank, finite."""
    where = f"adapter {adapter.name!r}"
    if not isinstance(adapter.name, str) or not is_int(adapter.rank) or not 0 < adapter.rank <= model_rank:
        raise LoraError(f"{where}: name must be a str and rank an int in 1..{model_rank} (the model's LoRA rank), "
                        f"got rank {adapter.rank!r}.")
    if not isinstance(adapter.factors, dict):  # empty: every factor 0, a no-op adapter
        raise LoraError(f"{where}: factors must be a dict mapping (layer, target) to (A, B).")
    for key, pair in adapter.factors.items():
        if not (isinstance(key, tuple) and len(key) == 2 and is_int(key[0]) and 0 <= key[0] < cfg.num_layers
                and key[1] in model_targets):
            raise LoraError(f"{where}: factor key {key!r} is not (layer in 0..{cfg.num_layers - 1}, one of "
                            f"{', '.join(model_targets)}).")
        out_dim, in_dim = projection_shape(cfg, key[1])
        a, b = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
        rank = a.shape[0] if isinstance(a, np.ndarray) and a.ndim == 2 else 0
        expected = ((rank, in_dim), (out_dim, rank))
        if not (0 < rank <= model_rank and all(isinstance(m, np.ndarray) and m.dtype == np.float32 and m.shape == shape
                                               for m, shape in zip((a, b), expected))):
            raise LoraError(f"{where}: layer {key[0]} {key[1]} needs float32 A [r, {in_dim}] and B [{out_dim}, r] "
                            f"with r in 1..{model_rank} (alpha / r folded into B).")
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            raise LoraError(f"{where}: layer {key[0]} {key[1]} holds NaN or infinite values.")


def load_peft_adapter(path: str | Path, cfg: ModelConfig, model_rank: int, model_targets: tuple[str, ...],
                      name: str | None = None) -> LoraAdapter:
    """Read and validate a PEFT adapter directory; nothing is kept from an adapter that fails."""
    path = Path(path)
    config = _read_config(path / "adapter_config.json")
    weights_path = path / "adapter_model.safetensors"
    if not weights_path.exists():
        raise LoraError(f"{weights_path} is missing; save the adapter with safe_serialization=True.")
    factors, ranks = {}, []
    for (layer, target), (module, pair) in _read_factors(path, weights_path, cfg, model_targets).items():
        rank, scale = config.rank_and_scale(module)
        if rank > model_rank:
            raise LoraError(f"{path}: adapter rank {rank} is higher than the model's LoRA rank {model_rank}; "
                            f"reconvert the model with --lora-rank {rank} or more.")
        if set(pair) != {"A", "B"}:
            raise LoraError(f"{path}: layer {layer} {target} has only lora_{''.join(pair)}.")
        out_dim, in_dim = projection_shape(cfg, target)
        a, b = pair["A"], pair["B"]
        if a.shape != (rank, in_dim) or b.shape != (out_dim, rank):
            raise LoraError(f"{path}: layer {layer} {target} has A {a.shape} and B {b.shape}; expected "
                            f"A {(rank, in_dim)} and B {(out_dim, rank)} (rank {rank} from {config.path.name}).")
        with np.errstate(over="ignore", invalid="ignore"):  # checked just below
            scaled_b = b * np.float32(scale)
        if not np.isfinite(scaled_b).all():
            raise LoraError(f"{path}: layer {layer} {target}'s lora_B times its scale alpha / r = {scale:g} is not a "
                            f"finite float32; lora_alpha in {config.path.name} is out of range.")
        padded_a = np.zeros((model_rank, in_dim), np.float32)
        padded_b = np.zeros((out_dim, model_rank), np.float32)
        padded_a[:rank], padded_b[:, :rank] = a, scaled_b
        factors[(layer, target)] = (padded_a, padded_b)
        ranks.append(rank)
    if not factors:
        raise LoraError(f"{weights_path}: no LoRA factors found.")
    return LoraAdapter(name or path.name, max(ranks), factors)


# PEFT's LoraConfig defaults, which apply when adapter_config.json leaves a field out.
_PEFT_DEFAULT_R, _PEFT_DEFAULT_ALPHA = 8, 8
_PEFT_PREFIX = "base_model.model."  # PeftModel's prefix on the base model's module names


@dataclass(frozen=True)
class _PeftConfig:
    """What adapter_config.json says about each module's rank and scale."""
    path: Path
    r: int
    alpha: float
    rank_pattern: tuple[tuple[re.Pattern, int], ...]
    alpha_pattern: tuple[tuple[re.Pattern, float], ...]

    rslora: bool = False  # rank-stabilized LoRA: alpha / sqrt(rank), as PEFT's use_rslora

    def rank_and_scale(self, module: str) -> tuple[int, float]:
        """(rank, alpha / rank, or alpha / sqrt(rank) for rsLoRA) of a module such as
        "model.layers.0.self_attn.q_proj"."""
        rank = _first_match(self.rank_pattern, module, self.r)
        return rank, _first_match(self.alpha_pattern, module, self.alpha) / (math.sqrt(rank) if self.rslora else rank)


def _first_match(patterns, module: str, default):
    # PEFT (LoraModel._create_and_replace, utils.other.get_pattern_key): the first key K, in the
    # file's order, for which re.match(rf"(.*\.)?({K})$", module) succeeds overrides the default.
    return next((value for regex, value in patterns if regex.match(module)), default)


def adapter_rank(path: str | Path) -> int:
    """The highest rank the PEFT adapter at `path` gives a module it holds factors for (the reference
    backend runs adapters at their own rank, unpadded). Reads the config and the weights' header only."""
    path = Path(path)
    config = _read_config(path / "adapter_config.json")
    weights_path = path / "adapter_model.safetensors"
    if not weights_path.exists():
        return config.r  # load_peft_adapter says what is missing
    try:
        names = SafetensorsFile(weights_path).names()
    except CheckpointError as e:
        raise LoraError(f"{e} Save the adapter again with PEFT (safe_serialization=True).") from e
    # A rank_pattern entry that matches none of them pads nothing: it can name any rank.
    return max((config.rank_and_scale(_module(key))[0] for key in names if _KEY.fullmatch(key)), default=config.r)


def _module(key: str) -> str:
    """The PEFT module name of a factor, as rank_pattern keys match it: "model.layers.0.self_attn.q_proj"."""
    return key[:-len(".lora_A.weight")].removeprefix(_PEFT_PREFIX)


def _read_config(config_path: Path) -> _PeftConfig:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise LoraError(f"{config_path} is missing; a PEFT adapter directory needs adapter_config.json.") from e
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON or bad UTF-8
        raise LoraError(f"{config_path} cannot be read as JSON ({e}).") from e
    if not isinstance(config, dict):
        raise LoraError(f"{config_path} holds a JSON {type(config).__name__}, not an object; "
                        "save the adapter with PEFT's save_pretrained.")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"{config_path}: peft_type is {peft_type!r}; litekv loads only LORA adapters.")
    if config.get("use_dora"):
        raise LoraError(f"{config_path.parent}: DoRA adapters are not supported; train a plain LoRA adapter "
                        "(use_dora false).")
    rslora = config.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise LoraError(f"{config_path}: use_rslora must be true or false, got {rslora!r}; fix the file or save the "
                        "adapter again with PEFT.")
    return _PeftConfig(config_path, _rank(config_path, "r", config.get("r", _PEFT_DEFAULT_R)),
                       _alpha(config_path, "lora_alpha", config.get("lora_alpha", _PEFT_DEFAULT_ALPHA)),
                       _patterns(config_path, "rank_pattern", config.get("rank_pattern"), _rank),
                       _patterns(config_path, "alpha_pattern", config.get("alpha_pattern"), _alpha), rslora)


def _rank(config_path: Path, field: str, value: object) -> int:
    if not is_int(value) or value < 1:
        raise LoraError(f"{config_path}: {field} must be a positive integer, got {value!r}; "
                        "fix the file or save the adapter again with PEFT.")
    return value


def _alpha(config_path: Path, field: str, value: object) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise LoraError(f"{config_path}: {field} must be a finite number, got {value!r}; "
                        "fix the file or save the adapter again with PEFT.")
    return float(value)


def _patterns(config_path: Path, field: str, patterns: object, check) -> tuple:
    if patterns is None:
        return ()
    if not isinstance(patterns, dict):
        raise LoraError(f"{config_path}: {field} must be an object mapping module-name patterns to values, "
                        f"got {patterns!r}.")
    compiled = []
    for key, value in patterns.items():
        try:
            regex = re.compile(rf"(.*\.)?({key})$")
        except re.error as e:
            raise LoraError(f"{config_path}: {field} key {key!r} is not a valid regular expression ({e}).") from e
        compiled.append((regex, check(config_path, f"{field}[{key!r}]", value)))
    return tuple(compiled)


def _read_factors(path: Path, weights_path: Path, cfg: ModelConfig, model_targets: tuple[str, ...]
                  ) -> dict[tuple[int, str], tuple[str, dict[str, np.ndarray]]]:
    """(layer, target) -> (PEFT module name, {"A": A, "B": B}) as stored, float32."""
    try:
        tensors = SafetensorsFile(weights_path)
        found: dict[tuple[int, str], tuple[str, dict[str, np.ndarray]]] = {}
        for key in tensors.names():
            other = sorted(_NOT_TEXT.intersection(key.split(".")))
            if other:
                raise LoraError(f"{weights_path}: tensor {key} adapts the model's {other[0]}, which litekv does not "
                                "run: it converts the language model only. Train or save the adapter with PEFT "
                                "target_modules limited to the language model's q/k/v/o projections.")
            m = _KEY.fullmatch(key)
            if not m:
                raise LoraError(f"{weights_path}: tensor {key} is not a LoRA factor of q/k/v/o projections; "
                                f"this model's LoRA inputs cover {', '.join(model_targets)}.")
            layer, target, which = int(m.group(1)), _MODULES[m.group(2)], m.group(3)
            if target not in model_targets:
                raise LoraError(f"{path}: the adapter targets {m.group(2)}, but the model was converted with LoRA "
                                f"inputs only on {', '.join(model_targets)}.")
            if layer >= cfg.num_layers:
                raise LoraError(f"{path}: layer {layer} does not exist (the model has {cfg.num_layers}).")
            pair = found.setdefault((layer, target), (_module(key), {}))[1]
            if which in pair:
                raise LoraError(f"{weights_path}: layer {layer} {target} has more than one lora_{which} ({key}).")
            pair[which] = _factor(weights_path, key, tensors)
    except CheckpointError as e:
        raise LoraError(f"{e} Save the adapter again with PEFT (safe_serialization=True).") from e
    return found


def _factor(weights_path: Path, key: str, tensors: SafetensorsFile) -> np.ndarray:
    array = tensors.read(key)
    if array.dtype != np.float32:  # the reader widens every float dtype to float32
        raise LoraError(f"{weights_path}: tensor {key} has integer or boolean values; LoRA factors are floats.")
    if not np.isfinite(array).all():
        raise LoraError(f"{weights_path}: tensor {key} holds NaN or infinite values; the adapter is damaged.")
    return array


LORA_TARGETS_ALL = tuple(_MODULES.values())


def group_factors(adapter: LoraAdapter | None, cfg: ModelConfig, layer: int, parts: list[str], targets: list[str],
                  rank: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """The stacked LoRA inputs of one fused projection (see converters.graph_ops._with_lora).

    A [len(targets) * rank, in] stacks each target's A; B [sum(out of parts), len(targets) * rank]
    holds each target's (scaled) B in its own rows and columns and zeros elsewhere. With
    layout "in_out" both come transposed. No adapter (or a target it lacks) gives zeros.
    """
    outs = [projection_shape(cfg, p)[0] for p in parts]
    in_dim = projection_shape(cfg, parts[0])[1]
    a = np.zeros((len(targets) * rank, in_dim), np.float32)
    b = np.zeros((sum(outs), len(targets) * rank), np.float32)
    for j, target in enumerate(targets):
        factors = adapter.factors.get((layer, target)) if adapter else None
        if factors is None:
            continue
        row, own = sum(outs[:parts.index(target)]), factors[0].shape[0]  # own rank <= rank: zeros pad the rest
        a[j * rank:j * rank + own] = factors[0]
        b[row:row + outs[parts.index(target)], j * rank:j * rank + own] = factors[1]
    if layout == "in_out":
        return np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)
    return a, b


def lora_inputs(adapter: LoraAdapter | None, cfg: ModelConfig, groups: dict[str, list[list[str]]], rank: int,
                layout: str) -> dict[str, np.ndarray]:
    """Every LoRA input of a converted model, by input name."""
    arrays = {}
    for layer in range(cfg.num_layers):
        for group, (parts, targets) in groups.items():
            a, b = group_factors(adapter, cfg, layer, parts, targets, rank, layout)
            arrays[f"lora_a_{layer}_{group}"], arrays[f"lora_b_{layer}_{group}"] = a, b
    return arrays
