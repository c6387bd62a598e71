"""Load a checkpoint (GGUF file or Hugging Face directory) into canonical float32 weights.

`load_checkpoint` returns the typed config, canonical weights and tokenizer; architecture
specifics come from the spec's name tables and transforms, never from branches here.
"""
from __future__ import annotations

import json
import logging
import math
import mmap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import numpy as np

from litekv.errors import (CheckpointError, CheckpointNotFound, ConfigError, MissingDependency,
                           UnsupportedTensorType, UnsupportedTokenizerError, WeightShapeMismatch)
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
    return _gguf_config(reader, meta, path)[1]


# ---- canonical weights --------------------------------------------------------------------

def read_weights(spec: ArchitectureSpec, cfg: ModelConfig, plan: Mapping[str, str],
                 reads: Mapping[str, Callable[[], np.ndarray]], source: Path, gguf: bool,
                 progress: Progress | None = None) -> dict[str, np.ndarray]:
    """Read the tensors `_plan` chose (canonical -> checkpoint name) as canonical float32 weights."""
    weights: dict[str, np.ndarray] = {}
    for done, (canonical, name) in enumerate(plan.items(), 1):
        array = reads[name]().astype(np.float32)
        if not np.isfinite(array).all():
            raise CheckpointError(f"{source}: tensor {name} holds NaN or infinite values; the checkpoint is damaged "
                                  "(or overflows float32): download or export it again.")
        weights[canonical] = np.ascontiguousarray(spec.transform(canonical, array, cfg, gguf))
        if progress:
            progress(done, len(plan), name)
    return weights


def _plan(spec: ArchitectureSpec, cfg: ModelConfig, shapes: Iterable[tuple[str, tuple[int, ...]]],
          source: Path, gguf: bool) -> dict[str, str]:
    """Canonical name -> checkpoint name of every weight to read. Names and shapes are checked against
    the config and every required weight must be present before any tensor is read, so a checkpoint
    that cannot load fails before the heavy work of reading and dequantizing it."""
    table = spec.gguf_names if gguf else spec.hf_names
    expected = canonical_shapes(cfg)
    plan: dict[str, str] = {}
    for name, shape in shapes:
        canonical = spec.canonical_name(name, table)
        if canonical is None or canonical not in expected:
            log.warning("%s: ignoring tensor %s (not part of litekv's %s definition)", source, name, spec.name)
            continue
        if canonical in plan:
            raise CheckpointError(f"{source}: the checkpoint holds {canonical} twice (as {plan[canonical]} and "
                                  f"{name}, e.g. in two shards); it is damaged or mixes two models.")
        if tuple(shape) != expected[canonical]:
            raise WeightShapeMismatch(
                f"{source}: tensor {name} has shape {tuple(shape)} but the config implies "
                f"{expected[canonical]}; the config and the weights do not belong together."
            )
        plan[canonical] = name
    if not gguf and not cfg.tie_embeddings and "lm_head.weight" not in plan:  # a GGUF ties by leaving it out
        raise CheckpointError(f"{source}: config.json says the LM head is its own weight (tie_word_embeddings is "
                              "false) but the checkpoint has no lm_head.weight; export the full model again, or set "
                              "tie_word_embeddings to true if the model does share its embedding.")
    if cfg.tie_embeddings or "lm_head.weight" not in plan:
        plan.pop("lm_head.weight", None)
        expected.pop("lm_head.weight")
    missing = sorted(set(expected) - set(plan))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{source}: required weights are missing: {shown}.")
    return plan


def _check_layer_count(value: Any, tensors: int, where: str, key: str) -> None:
    """Refuse a layer count the weights cannot hold before a config is built from it: the config
    allocates per layer, so a crafted count of 10**9 would take gigabytes."""
    try:
        count = float(value)
    except (TypeError, ValueError):
        return  # not a number at all: the config parser names the field
    if count > tensors:
        raise CheckpointError(f"{where}: {key} is {value!r}, but the checkpoint holds only {tensors} tensors; the "
                              "config does not belong to these weights.")


def _build_config(build: Callable[[], ModelConfig], where: str) -> ModelConfig:
    """The spec's config parser, with every failure a ConfigError that names the file."""
    try:
        return build()
    except ConfigError as e:
        if where in str(e):
            raise
        raise ConfigError(f"{where}: {e}") from e
    except (TypeError, ValueError, ArithmeticError) as e:  # int("abc"), a head count of 0, ...
        raise ConfigError(f"{where}: a config value has the wrong type or an impossible value ({e}); fix the file "
                          "or re-export the checkpoint.") from e


def _tokenizer_class():
    from litekv.tokenizer import Tokenizer  # building one is costly; only when asked for

    return Tokenizer


# ---- Hugging Face directories ---------------------------------------------------------------

def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{path}: cannot be read as JSON ({e}).") from e
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(data).__name__}, not an object; the file is damaged.")
    return data


def _hf_config(path: Path) -> tuple[ArchitectureSpec, ModelConfig, list[SafetensorsFile]]:
    """The directory's spec and config, and its weight files with their headers checked."""
    config_path = path / "config.json"
    if not config_path.exists():
        raise CheckpointNotFound(f"{config_path}: missing; a Hugging Face model directory needs config.json.")
    raw = _read_json_object(config_path)
    if "model_type" not in raw:
        raise CheckpointError(f"{config_path}: has no model_type; it is not a transformers config.")
    spec = for_hf_model_type(str(raw["model_type"]), str(config_path))
    gen_path = path / "generation_config.json"
    if gen_path.exists() and raw.get("eos_token_id") is None:
        raw["eos_token_id"] = _read_json_object(gen_path).get("eos_token_id")
    files = _safetensors_files(path)
    tensors = sum(len(f.names()) for f in files)
    for section in (raw, raw.get("text_config")):
        if isinstance(section, dict):
            _check_layer_count(section.get("num_hidden_layers"), tensors, str(config_path), "num_hidden_layers")
    return spec, _build_config(lambda: spec.config_from_hf(raw, str(config_path)), str(config_path)), files


def _safetensors_files(path: Path) -> list[SafetensorsFile]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(n, str) and n for n in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names; the index is "
                                  "damaged.")
        names = sorted(set(weight_map.values()))
        outside = [n for n in names if Path(n).is_absolute() or ".." in Path(n).parts]
        if outside:
            raise CheckpointError(f"{index}: shards {', '.join(outside)} are outside the model directory; litekv "
                                  "reads only shards inside it.")
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
    spec, cfg, files = _hf_config(path)
    plan = _plan(spec, cfg, [(name, f.shape(name)) for f in files for name in f.names()], path, gguf=False)
    tokenizer = _tokenizer_class().from_hf_dir(path) if with_tokenizer else None
    reads = {name: (lambda f=f, n=name: f.read(n)) for f in files for name in f.names()}
    weights = read_weights(spec, cfg, plan, reads, path, gguf=False, progress=progress)
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
    _check_gguf_layout(path, gguf)
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


def _gguf_config(reader, meta: dict[str, Any], path: Path) -> tuple[ArchitectureSpec, ModelConfig]:
    arch = meta.get("general.architecture")
    if arch is None:
        raise CheckpointError(f"{path}: GGUF metadata has no general.architecture.")
    spec = for_gguf_architecture(str(arch), str(path))
    _check_layer_count(meta.get(f"{arch}.block_count"), len(reader.tensors), str(path), f"{arch}.block_count")
    names = {t.name for t in reader.tensors}
    return spec, _build_config(lambda: spec.config_from_gguf(meta, names, str(path)), str(path))


def _gguf_tokenizer(meta: dict[str, Any], path: Path):
    try:
        return _tokenizer_class().from_gguf_metadata(meta)
    except UnsupportedTokenizerError as e:
        raise UnsupportedTokenizerError(f"{path}: {e}") from e


def _load_gguf(path: Path, with_tokenizer: bool, progress: Progress | None) -> Checkpoint:
    reader = _open_gguf(path)
    meta = gguf_metadata(reader, path)
    spec, cfg = _gguf_config(reader, meta, path)
    reads = {t.name: _dequantizer(t, path) for t in reader.tensors}
    plan = _plan(spec, cfg, [(t.name, tuple(int(d) for d in reversed(t.shape))) for t in reader.tensors], path,
                 gguf=True)
    tokenizer = _gguf_tokenizer(meta, path) if with_tokenizer else None
    weights = read_weights(spec, cfg, plan, reads, path, gguf=True, progress=progress)
    return Checkpoint(path, spec, cfg, weights, tokenizer, "gguf")


# ---- GGUF layout: checked before the gguf package parses the file ------------------------------
# Its reader trusts every count: it loops once per declared array element, so a 100-byte file that
# declares 10**12 of them never finishes, and a truncated file fails in a numpy reshape.

_GGUF_VERSIONS = (2, 3)
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
_GGUF_MAX_NESTING = 8


def _check_gguf_layout(path: Path, gguf) -> None:
    """Walk the header with every length checked against the file, then every tensor's data range."""
    try:
        with open(path, "rb") as f:
            if path.stat().st_size < 24:
                raise CheckpointError(f"{path}: only {path.stat().st_size} bytes, too short for a GGUF file.")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _GGUFLayout(path, data, gguf).check()
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the file ({e.strerror or e}).") from e


class _GGUFLayout:
    def __init__(self, path: Path, data: mmap.mmap, gguf):
        self.path, self.data, self.gguf = path, data, gguf
        self.scalar_sizes = {int(t): np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()}
        self.tensor_types = {int(t): t for t in gguf.GGML_QUANT_SIZES}
        self.offset = 0
        self.byteorder = "little"

    def check(self) -> None:
        if self.data[:4] != b"GGUF":
            raise CheckpointError(f"{self.path}: not a readable GGUF file (it does not start with the GGUF magic).")
        self.offset = 4
        version = self.uint(4, "the version")
        if version & 0xFFFF == 0:  # written on a big-endian machine, as the gguf reader detects it
            self.byteorder, version = "big", int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in _GGUF_VERSIONS:
            raise CheckpointError(f"{self.path}: GGUF version {version} is not supported (litekv reads versions "
                                  f"{' and '.join(map(str, _GGUF_VERSIONS))}).")
        tensor_count, kv_count = self.uint(8, "the tensor count"), self.uint(8, "the metadata count")
        alignment = self.gguf.GGUF_DEFAULT_ALIGNMENT
        self.fits(kv_count, 12, "the metadata")
        for _ in range(kv_count):
            key = self.string("a metadata key")
            what = f"metadata field {key.decode('utf-8', 'replace')}"
            value_type = self.uint(4, what)
            if key == b"general.alignment" and value_type == 4:
                alignment = self.uint(4, what)
                if alignment == 0 or alignment & (alignment - 1):
                    raise CheckpointError(f"{self.path}: general.alignment {alignment} is not a power of two; "
                                          "the file is damaged.")
            else:
                self.skip(value_type, what, 0)
        self.fits(tensor_count, 24, "the tensor list")
        infos = [self.tensor_info() for _ in range(tensor_count)]
        data_start = -(-self.offset // alignment) * alignment
        spans = sorted(self.check_tensor(name, dims, qtype, data_start + offset) for name, dims, qtype, offset in infos)
        # Writers lay tensors end to end; shared bytes mean a crafted or damaged file, whose weights
        # would silently alias each other.
        for (start, end, name), (next_start, _, next_name) in zip(spans, spans[1:]):
            if next_start < end:
                raise CheckpointError(f"{self.path}: the data of tensors {name} and {next_name} overlap (bytes "
                                      f"{next_start}-{end}); the file is damaged: download it again.")

    def take(self, size: int, what: str) -> int:
        start = self.offset
        if size > len(self.data) - start:
            raise CheckpointError(f"{self.path}: the file ends inside {what} (at byte {start} of {len(self.data)}); "
                                  "it is truncated: download it again.")
        self.offset += size
        return start

    def fits(self, count: int, least: int, what: str) -> None:
        if count * least > len(self.data) - self.offset:
            raise CheckpointError(f"{self.path}: {what} declares {count} entries, more than the file can hold; "
                                  "the file is truncated or damaged.")

    def uint(self, size: int, what: str) -> int:
        start = self.take(size, what)
        return int.from_bytes(self.data[start:start + size], self.byteorder)

    def string(self, what: str) -> bytes:
        size = self.uint(8, what)
        start = self.take(size, what)
        return self.data[start:start + size]

    def skip(self, value_type: int, what: str, depth: int) -> None:
        if value_type in self.scalar_sizes:
            self.take(self.scalar_sizes[value_type], what)
        elif value_type == _GGUF_STRING:
            self.string(what)
        elif value_type == _GGUF_ARRAY and depth < _GGUF_MAX_NESTING:
            item_type, count = self.uint(4, what), self.uint(8, what)
            if item_type in self.scalar_sizes:
                self.fits(count, self.scalar_sizes[item_type], what)
                self.take(count * self.scalar_sizes[item_type], what)
                return
            self.fits(count, 8, what)  # a string takes at least its 8-byte length
            for _ in range(count):
                self.skip(item_type, what, depth + 1)
        else:
            raise CheckpointError(f"{self.path}: {what} has value type {value_type}, which GGUF does not define "
                                  "(or arrays nested too deep); the file is damaged.")

    def tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self.string("a tensor name").decode("utf-8", "replace")
        what = f"the entry of tensor {name}"
        n_dims = self.uint(4, what)
        if n_dims > _GGUF_MAX_DIMS:
            raise CheckpointError(f"{self.path}: tensor {name} has {n_dims} dimensions, more than GGUF's "
                                  f"{_GGUF_MAX_DIMS}; the file is damaged.")
        dims = [self.uint(8, what) for _ in range(n_dims)]
        return name, dims, self.uint(4, what), self.uint(8, what)

    def check_tensor(self, name: str, dims: list[int], qtype: int, start: int) -> tuple[int, int, str]:
        """The tensor's data range, checked against its type's blocks and the file's end."""
        if qtype not in self.tensor_types:
            raise UnsupportedTensorType(f"{self.path}: tensor {name} has GGUF type id {qtype}, which the gguf "
                                        "package does not know; the file is damaged or needs a newer gguf.")
        qtype_enum = self.tensor_types[qtype]
        block, block_bytes = self.gguf.GGML_QUANT_SIZES[qtype_enum]
        if dims and dims[0] % block:
            raise CheckpointError(f"{self.path}: tensor {name} has rows of {dims[0]} values, but its type "
                                  f"{qtype_enum.name} stores blocks of {block}; the file is damaged.")
        end = start + math.prod(dims) // block * block_bytes
        if end > len(self.data):
            raise CheckpointError(f"{self.path}: tensor {name}'s data ends at byte {end}, past the end of the file "
                                  f"({len(self.data)} bytes); the file is truncated: download it again.")
        return start, end, name
