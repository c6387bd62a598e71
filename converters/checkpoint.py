"""Load a checkpoint (GGUF file or Hugging Face directory) into canonical float32 weights.

`load_checkpoint` returns the typed config, canonical weights and tokenizer; architecture
specifics come from the spec's name tables and transforms, never from branches here.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from litekv.errors import (CheckpointError, CheckpointNotFound, MissingDependency, UnsupportedTensorType,
                           WeightShapeMismatch)
from litekv.models.base import ArchitectureSpec, canonical_shapes, for_gguf_architecture, for_hf_model_type
from litekv.models.config import ModelConfig

from litekv.safetensors_reader import SafetensorsFile

log = logging.getLogger("litekv.checkpoint")

# Called as progress(done, total, what) while tensors load.
Progress = Callable[[int, int, str], None]


@dataclass
class Checkpoint:
    source: Path
    spec: ArchitectureSpec
    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: Any  # litekv.tokenizer.Tokenizer, or None when not requested
    format: str  # "gguf" | "hf"


def load_checkpoint(path: str | Path, with_tokenizer: bool = True, progress: Progress | None = None) -> Checkpoint:
    """Read a GGUF file or a Hugging Face directory (single or sharded safetensors)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFound(f"{path}: no such file or directory; pass a .gguf file or a Hugging Face "
                                 "model directory with config.json and safetensors weights.")
    started = time.perf_counter()
    if path.is_dir():
        ckpt = _load_hf(path, with_tokenizer, progress)
    else:
        ckpt = _load_gguf(path, with_tokenizer, progress)
    log.info("loaded %s (%s, %d tensors) in %.1fs", path, ckpt.config.architecture, len(ckpt.weights),
             time.perf_counter() - started)
    return ckpt


def read_config(path: str | Path) -> ModelConfig:
    """Only the typed config of a checkpoint, without reading weights."""
    path = Path(path)
    if path.is_dir():
        return _hf_config(path)[1]
    if not path.exists():
        raise CheckpointNotFound(f"{path}: no such file.")
    reader = _open_gguf(path)
    meta = gguf_metadata(reader, path)
    spec = for_gguf_architecture(str(meta.get("general.architecture")), str(path))
    return spec.config_from_gguf(meta, {t.name for t in reader.tensors}, str(path))


# ---- canonical weights --------------------------------------------------------------------

def canonicalize(spec: ArchitectureSpec, cfg: ModelConfig, tensors: Iterable[tuple[str, np.ndarray]],
                 source: Path, gguf: bool) -> dict[str, np.ndarray]:
    """Rename, fix up and shape-check checkpoint tensors; every required weight must be present."""
    table = spec.gguf_names if gguf else spec.hf_names
    expected = canonical_shapes(cfg)
    weights: dict[str, np.ndarray] = {}
    for name, array in tensors:
        canonical = spec.canonical_name(name, table)
        if canonical is None or canonical not in expected:
            log.warning("%s: ignoring tensor %s (not part of litekv's %s definition)", source, name, spec.name)
            continue
        if tuple(array.shape) != expected[canonical]:
            raise WeightShapeMismatch(
                f"{source}: tensor {name} has shape {tuple(array.shape)} but the config implies "
                f"{expected[canonical]}; the config and the weights do not belong together."
            )
        weights[canonical] = np.ascontiguousarray(spec.transform(canonical, array.astype(np.float32), cfg, gguf))
    if cfg.tie_embeddings or "lm_head.weight" not in weights:
        weights.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(weights))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{source}: required weights are missing: {shown}.")
    return weights


def _tokenizer_class():
    from litekv.tokenizer import Tokenizer  # building one is costly; only when asked for

    return Tokenizer


def _with_progress(items: list[tuple[str, Callable[[], np.ndarray]]], progress: Progress | None
                   ) -> Iterator[tuple[str, np.ndarray]]:
    for done, (name, read) in enumerate(items, 1):
        yield name, read()
        if progress:
            progress(done, len(items), name)


# ---- Hugging Face directories ---------------------------------------------------------------

def _hf_config(path: Path) -> tuple[ArchitectureSpec, ModelConfig, dict[str, Any]]:
    config_path = path / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError as e:
        raise CheckpointNotFound(f"{config_path}: missing; a Hugging Face model directory needs config.json.") from e
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{config_path}: cannot be read as JSON ({e}).") from e
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise CheckpointError(f"{config_path}: has no model_type; it is not a transformers config.")
    spec = for_hf_model_type(str(raw["model_type"]), str(config_path))
    gen_path = path / "generation_config.json"
    if gen_path.exists() and raw.get("eos_token_id") is None:
        raw["eos_token_id"] = json.loads(gen_path.read_text()).get("eos_token_id")
    return spec, spec.config_from_hf(raw, str(config_path)), raw


def _safetensors_files(path: Path) -> list[SafetensorsFile]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e}).") from e
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise CheckpointNotFound(f"{path}: shards listed in {index.name} are missing: {', '.join(missing)}.")
        return [SafetensorsFile(path / n) for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFound(f"{path}: no *.safetensors weights found (pytorch .bin files are not read, "
                                 "because loading them needs pickle).")
    return [SafetensorsFile(f) for f in files]


def _load_hf(path: Path, with_tokenizer: bool, progress: Progress | None) -> Checkpoint:
    spec, cfg, _ = _hf_config(path)
    files = _safetensors_files(path)
    items = [(name, (lambda f=f, n=name: f.read(n))) for f in files for name in f.names()]
    weights = canonicalize(spec, cfg, _with_progress(items, progress), path, gguf=False)
    tokenizer = _tokenizer_class().from_hf_dir(path) if with_tokenizer else None
    return Checkpoint(path, spec, cfg, weights, tokenizer, "hf")


# ---- GGUF -----------------------------------------------------------------------------------

def _gguf_module():
    try:
        import gguf
    except ImportError as e:
        raise MissingDependency("reading GGUF files needs the `gguf` package: pip install 'litekv[convert]'.") from e
    return gguf


def _open_gguf(path: Path):
    gguf = _gguf_module()
    try:
        return gguf.GGUFReader(path, "r")
    except PermissionError as e:
        raise CheckpointError(f"{path}: cannot read the file (permission denied).") from e
    except Exception as e:  # the gguf package raises ValueError/struct/IndexError on damaged files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}).") from e


def gguf_metadata(reader, path: Path) -> dict[str, Any]:
    """GGUF key/value metadata as plain Python values."""
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            meta[key] = field.contents()
        except Exception as e:
            raise CheckpointError(f"{path}: metadata field {key} is damaged ({e}).") from e
    return meta


def _dequantizer(reader_tensor, path: Path) -> Callable[[], np.ndarray]:
    gguf = _gguf_module()
    qtype = reader_tensor.tensor_type
    supported = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
                 *gguf.quants._type_traits.keys()}
    if qtype not in supported:
        raise UnsupportedTensorType(
            f"{path}: tensor {reader_tensor.name} has GGUF type {qtype.name}, which litekv cannot dequantize; "
            f"supported types: {', '.join(sorted(t.name for t in supported))}."
        )
    shape = tuple(int(d) for d in reversed(reader_tensor.shape))

    def read() -> np.ndarray:
        return gguf.quants.dequantize(reader_tensor.data, qtype).reshape(shape)

    return read


def _load_gguf(path: Path, with_tokenizer: bool, progress: Progress | None) -> Checkpoint:
    reader = _open_gguf(path)
    meta = gguf_metadata(reader, path)
    arch = meta.get("general.architecture")
    if arch is None:
        raise CheckpointError(f"{path}: GGUF metadata has no general.architecture.")
    spec = for_gguf_architecture(str(arch), str(path))
    cfg = spec.config_from_gguf(meta, {t.name for t in reader.tensors}, str(path))
    items = [(t.name, _dequantizer(t, path)) for t in reader.tensors]
    weights = canonicalize(spec, cfg, _with_progress(items, progress), path, gguf=True)
    tokenizer = _tokenizer_class().from_gguf_metadata(meta) if with_tokenizer else None
    return Checkpoint(path, spec, cfg, weights, tokenizer, "gguf")
