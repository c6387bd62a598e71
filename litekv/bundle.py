"""A converted model bundle: the model file, its tokenizer and the `litekv.json` manifest.

The manifest is the contract between the converter and the executors: signatures with their
token count and KV capacity, the KV layout, quantization, LoRA inputs and the model fingerprint.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import MISSING, InitVar, asdict, dataclass, field, fields
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from litekv.errors import ConfigError, LitekvError
from litekv.models.config import ACTIVATIONS, LAYER_KINDS, ModelConfig, RopeConfig
from litekv.onnx_external_data import external_tensors
from litekv.tokenizer import META_FILE, TOKENIZER_FILE
from litekv.validation import is_int

MANIFEST = "litekv.json"
FORMAT = "litekv-bundle"
# 2: TFLite KV cache tensors are [1,S,KVH*D]; 3: one TFLite sampler entry point fed with logits;
# 4: `decode_attention` (TFLite one-token attention may be litekv's custom op). Version 3 reads as "graph".
# 5: a TFLite bundle may hold an int8 KV cache (`kv_dtype`), read by the kernel's int8 form.
# 6: `prefill_attention` (TFLite prefill chunks may attend in litekv's custom op, at one capacity).
# Versions before 6 read as "graph".
# 7: the KV cache may be float16 (`kv_dtype`), read by the kernels' f16 forms (ONNX: GroupQueryAttention in float16).
# 8: a TFLite int8 KV cache may have a scale per row (`kv_row_scales`), read by the kernels' int8_rows forms.
# 9: TFLite one-token steps may run their quantized linears in litekv's custom ops (`decode_linears`).
# 10: ONNX int4 bundles may run decode steps in a graph of their own (`decode_model_file`) whose int4
# projections are litekv's ops; their block scales are float16 and their offsets int8 in every ONNX int4 bundle.
# 11: ONNX bundles may attend in litekv's ops (`decode_attention`, `prefill_attention` "kernel"; a float32
# or int8 cache), the decode graph then being theirs whatever the linears.
# 12: ONNX bundles attending in litekv's ops over ONNX Runtime's own linears have no decode graph: their
# one-token steps run the model graph, on its session's pool.
# 13: ONNX int8 weights are uint8 codes with a zero point of 128 (exact in MLAS without AVX-512 VNNI; int8
# codes saturated there). Older ONNX int8 bundles still load; reconvert them (`litekv pull` does).
# 14: prefill chunks may run their int4 linears in litekv's custom ops (`prefill_linears`).
# 15: an int8 cache may hold its keys in blocks of slots (kv_layout "BSHD_KB8" or "BHSD_KB8"), which
# litekv's attention ops write and read.
# 16: TFLite one-token steps over a float cache may attend in litekv's rope forms, which apply RoPE and
# write the step's rows themselves (the cache tensors are then that entry point's inputs only); an fp32
# LM head may run in litekv's linear op over the model file's table (`lm_head_kernel`).
# 17: the rope form over an int8 cache with static scales (litekv.decode_attention_rope_int8), which
# quantizes and writes the step's rows and scales the output itself.
# 18: an fp32 LM head in litekv's op may carry an int8 screen (litekv.linear_f32_screened, ONNX
# LinearF32Screened); the graphs that compute it take HEAD_KEEP_INPUT.
VERSION = 19
READABLE_VERSIONS = (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19)
ATTENTION_KINDS = ("kernel", "graph")
SAMPLER_SIGNATURE = "sampler"
# The sampler graph's scalar inputs, each of shape [1], in order: (name, dtype).
SAMPLER_INPUTS = (("temperature", "float32"), ("top_k", "int32"), ("top_p", "float32"), ("seed", "int32"))
# The sampler graph's `next_token` when the logits it is fed hold a NaN or an infinity (bundles whose
# manifest says sampler_refuses_non_finite; the executors check older bundles' logits on the host).
SAMPLER_NON_FINITE = -1
# int32 [1] input of a graph whose fp32 head is screened: 0 computes every logit; k > 0 only the rows
# that can rank among the k largest exactly, the rest the lowest float (the in-graph sampler passes
# its candidates' count, litekv.sampling.CANDIDATES).
HEAD_KEEP_INPUT = "head_keep"
BACKENDS = ("litert", "onnx")
# --kv-cache format -> the cache tensors' dtype (Manifest.kv_dtype). "int8-row": int8 codes with a
# float32 scale per token and KV head beside them (Manifest.kv_row_scales), LiteRT with litekv's kernels.
KV_CACHE_DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8", "int8-row": "int8"}
KV_CACHE_FORMATS = tuple(KV_CACHE_DTYPES)
# The entry points' kinds each backend's converter writes (SignatureInfo.kind).
SIGNATURE_KINDS = {"litert": ("prefill", "decode", "sampler"), "onnx": ("step", "decode")}
# Manifest.quantization: each key's formats (None: the int4 block size, a positive even integer). The
# converter's QuantPlan writes it (converters.quantize WEIGHT_FORMATS, EMBEDDING_FORMATS; a test keeps them equal).
QUANTIZATION_FORMATS = {"weights": ("fp32", "int8", "int4"), "lm_head": ("fp32", "int8", "int4"),
                        "embedding": ("fp32", "fp16"), "block_size": None}
LORA_TARGETS = ("q", "k", "v", "o")
LORA_LAYOUTS = ("out_in", "in_out")
ROPE_KINDS = ("default", "linear", "llama3")  # RopeConfig.kind
_ALL_SIGNATURE_KINDS = tuple(dict.fromkeys(k for kinds in SIGNATURE_KINDS.values() for k in kinds))
# An ONNX LoRA-ready bundle's LoRA graph, over the model file's weights.
ONNX_LORA_FILE = "model_lora.onnx"


class BundleError(LitekvError):
    """A bundle directory is missing, incomplete or from an incompatible litekv version."""


@dataclass(frozen=True)
class SignatureInfo:
    name: str
    kind: str  # prefill | decode | sampler (TFLite); step (ONNX)
    tokens: int  # new tokens per call; -1 = dynamic (ONNX)
    capacity: int  # KV slots the signature sees
    lora: bool
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class Manifest:
    backend: str
    model_file: str
    config: ModelConfig
    max_context: int
    prefill_lengths: tuple[int, ...]
    kv_buckets: tuple[int, ...]
    kv_layout: str  # "BSHD": [batch, slot, kv_head, dim] (TFLite); "BHSD" (ONNX GQA); "_KB8": keys in blocks
    kv_dtype: str
    quantization: dict[str, Any]
    lora_rank: int | None
    lora_targets: tuple[str, ...]
    signatures: tuple[SignatureInfo, ...]
    fingerprint: str
    chat_template: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    file_sizes: dict[str, int] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    sampler_file: str | None = None
    # LoRA input groups per layer: name -> [projection parts of the fused matmul, LoRA targets among them];
    # inputs lora_a_<layer>_<name> / lora_b_<layer>_<name> in `lora_layout` ("out_in" or "in_out").
    lora_groups: dict[str, list[list[str]]] = field(default_factory=dict)
    lora_layout: str = "out_in"
    # TFLite attention of one-token steps and of prefill chunks: "kernel" (litekv.native_attention's
    # custom ops) or "graph" (builtin ops)
    decode_attention: str = "graph"
    prefill_attention: str = "graph"
    # int8 cache codes with a scale per token and KV head (tensors kv_scale_<k|v>_<layer>, [1, KVH, S])
    kv_row_scales: bool = False
    # One-token steps' int4 and int8 linears: "kernel" (litekv's ops, reading the weights prefill's
    # FULLY_CONNECTED or MatMulNBits ops use) or "graph" (FULLY_CONNECTED in XNNPACK, MatMulNBits)
    decode_linears: str = "graph"
    # Prefill chunks' int4 linears: "kernel" (litekv's ops, over the same weights) or "graph"
    prefill_linears: str = "graph"
    # TFLite: the LM head's row in litekv's float linear op, reading the model file's table every step
    # (so the executor keeps those pages resident instead of giving them back after each prefill)
    lm_head_kernel: bool = False
    # ONNX: the graph decode steps run, beside `model_file` and over its weight file (decode_linears "kernel")
    decode_model_file: str | None = None
    # The sampler graph returns SAMPLER_NON_FINITE for logits holding a NaN or an infinity (bundles
    # from version 19); older sampler graphs draw some id from them, so the executors check such
    # bundles' logits on the host before their sampler runs.
    sampler_refuses_non_finite: bool = False
    # Names the manifest in errors: its path (from_json); None: built in code.
    where: InitVar[str | None] = None

    def __post_init__(self, where: str | None) -> None:
        # However it is made (read from a bundle or built in code), every manifest passes the same checks;
        # each field's check also normalizes it (lists to tuples, JSON objects to SignatureInfo, ModelConfig).
        where = where or "a Manifest built in code"
        for key, check in _FIELD_CHECKS.items():
            object.__setattr__(self, key, check(where, key, getattr(self, key)))
        _check_kinds(self, where)
        _check_sizes(self, where)
        _check_signatures(self, where)
        _check_lora(self, where)

    @property
    def uses_attention_kernel(self) -> bool:
        """Whether the model calls litekv's kernel library: its attention, or its linears."""
        return "kernel" in (self.decode_attention, self.prefill_attention, self.decode_linears, self.prefill_linears)

    def signature(self, name: str) -> SignatureInfo:
        for sig in self.signatures:
            if sig.name == name:
                return sig
        raise BundleError(f"the bundle has no signature {name!r}; it has {', '.join(s.name for s in self.signatures)}.")

    def to_json(self) -> str:
        data = asdict(self)
        data["config"] = self.config.to_dict()
        return json.dumps({"format": FORMAT, "version": VERSION, **data}, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> "Manifest":
        """Parse and validate a manifest (`where`, its path, names it in errors): every field's type and
        range, known values only, file names inside the bundle, and the fields' agreement with each other."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise BundleError(f"{where}: the manifest is not valid JSON ({e}); reconvert the model.") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BundleError(f"{where}: not a litekv bundle manifest.")
        version = _version(data.get("version"), where)
        if version >= 6 and "prefill_attention" not in data:  # only older versions default it
            raise BundleError(f"{where}: the manifest is incomplete (no prefill_attention); reconvert the model.")
        if version < 16:  # no LM head in litekv's op before it
            data.pop("lm_head_kernel", None)
        data.pop("format"), data.pop("version")
        _keys(where, "the manifest", data, _required(cls), _FIELD_CHECKS)
        return cls(**data, where=where)  # __post_init__ checks the fields


def read_manifest(bundle: str | Path) -> Manifest:
    """A bundle's manifest, validated (see Manifest.from_json), every file it names a file inside the bundle
    directory: absolute names, `..` and symlinks that lead out of it are refused."""
    path = Path(bundle) / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        from litekv.bundle_swap import interrupted_conversion_hint  # it reads manifests: imported here
        raise BundleError(f"{bundle}: no {MANIFEST}; pass a directory made by `litekv convert`."
                          + interrupted_conversion_hint(Path(bundle))) from e
    except OSError as e:
        raise BundleError(f"{path}: cannot be read ({e.strerror}).") from e
    except UnicodeDecodeError as e:
        raise BundleError(f"{path}: the manifest is not UTF-8 text ({e.reason}); reconvert the model.") from e
    manifest = Manifest.from_json(text, str(path))
    root = Path(bundle)
    for name in filter(None, (manifest.model_file, manifest.decode_model_file)):
        _bundle_file(root, name, "model file")
    if manifest.sampler_file:
        _bundle_file(root, manifest.sampler_file, "sampler graph")
    if manifest.backend == "onnx":  # the files ONNX Runtime opens beside the model file
        _bundle_file(root, manifest.model_file + ".data", "weight file", required=False)
        if manifest.lora_rank is not None:
            _bundle_file(root, ONNX_LORA_FILE, "LoRA graph")
    # Engine reads these (Tokenizer.load, which says if they are missing); executors run without them.
    _bundle_file(root, TOKENIZER_FILE, "tokenizer", required=False)
    _bundle_file(root, META_FILE, "tokenizer metadata", required=False)
    return manifest


def check_onnx_graph(bundle: str | Path, name: str, what: str) -> Path:
    """The path of the bundle's ONNX graph `name` (its `what`), once it and every external data file its tensors
    name are found inside the bundle directory: ONNX Runtime opens those wherever their locations lead."""
    root = Path(bundle)
    _bundle_file(root, name, what)
    path = root / name
    try:
        tensors = external_tensors(path)
    except (OSError, ValueError) as e:
        raise BundleError(f"{path}: the {what} is not a readable ONNX model ({e}); reconvert the model.") from e
    checked = set()
    for tensor, location in tensors:
        if location not in checked:  # one file holds many tensors
            _file_name(str(path), f"the external data location of tensor {tensor!r}", location)
            _bundle_file(root, str(PurePosixPath(name).parent / location),
                         f"external data file of {name}'s tensor {tensor!r}:")
            checked.add(location)
    return path


def _bundle_file(bundle: Path, name: str, what: str, required: bool = True) -> None:
    """Refuse a file the bundle names that resolves outside its directory, or is missing (if required)."""
    path = bundle / name
    try:
        resolved, root = path.resolve(), bundle.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop: RuntimeError before Python 3.13
        raise BundleError(f"{bundle}: the {what} {name} cannot be resolved ({e}); reconvert the model.") from e
    if not resolved.is_relative_to(root):
        raise BundleError(f"{bundle}: the {what} {name} leads outside the bundle directory (to {resolved}); "
                          "a bundle's files must be inside it: reconvert the model.")
    if not resolved.exists():
        if required:
            raise BundleError(f"{bundle}: the {what} {name} is missing; reconvert the model.")
    elif not resolved.is_file():
        raise BundleError(f"{bundle}: the {what} {name} is not a regular file; reconvert the model.")


def _check_kinds(manifest: Manifest, where: str) -> None:
    """The attention, linears, KV cache and LM head choices go together."""
    for key in ("decode_attention", "prefill_attention", "decode_linears", "prefill_linears"):
        if getattr(manifest, key) not in ATTENTION_KINDS:
            raise BundleError(f"{where}: unknown {key} {getattr(manifest, key)!r}; reconvert the model.")
    if manifest.kv_dtype not in KV_CACHE_DTYPES.values():
        raise BundleError(f"{where}: unknown KV cache dtype {manifest.kv_dtype!r}; reconvert the model.")
    if manifest.kv_row_scales and (manifest.kv_dtype != "int8" or manifest.backend != "litert"
                                   or manifest.decode_attention != "kernel"
                                   or manifest.prefill_attention != "kernel"
                                   or manifest.kv_buckets != (manifest.max_context,)):
        raise BundleError(f"{where}: a KV cache with row scales must be int8 on LiteRT with litekv's attention "
                          "kernels, at one capacity; reconvert the model.")
    if manifest.lm_head_kernel and (manifest.backend != "litert" or manifest.decode_attention != "kernel"):
        raise BundleError(f"{where}: an LM head in litekv's linear op needs a LiteRT bundle that attends in "
                          "litekv's kernel; reconvert the model.")
    rows = {"litert": "BSHD", "onnx": "BHSD"}[manifest.backend]  # the backend's layout, keys as rows
    if manifest.kv_layout not in (rows, rows + "_KB8"):
        raise BundleError(f"{where}: KV layout {manifest.kv_layout!r} is not one of the {manifest.backend!r} "
                          "backend's; reconvert the model.")
    # (keys move a dimension pair at a time: ModelConfig refuses an odd head_dim)
    if manifest.kv_layout.endswith("_KB8") and (manifest.kv_dtype != "int8" or manifest.kv_row_scales
                                                or manifest.decode_attention != "kernel"
                                                or manifest.prefill_attention != "kernel"
                                                or any(s % 8 for s in (manifest.max_context,
                                                                       *manifest.kv_buckets))):
        raise BundleError(f"{where}: keys in blocks ({manifest.kv_layout}) need a statically scaled int8 cache "
                          "that only litekv's attention ops read and capacities in whole blocks of 8; "
                          "reconvert the model.")
    step_kernels = "kernel" in (manifest.decode_linears, manifest.decode_attention)
    if manifest.decode_linears == "kernel" and manifest.backend != "litert" and not manifest.decode_model_file:
        raise BundleError(f"{where}: an ONNX bundle whose decode steps run litekv's linears needs its decode "
                          "graph, and the manifest names none; reconvert the model.")
    if manifest.decode_model_file and (manifest.backend != "onnx" or not step_kernels):
        raise BundleError(f"{where}: a separate decode graph is for ONNX bundles whose decode steps run litekv's "
                          "kernels; reconvert the model.")
    if (manifest.backend == "onnx" and manifest.kv_dtype not in ("float32", "int8")
            and "kernel" in (manifest.decode_attention, manifest.prefill_attention)):
        raise BundleError(f"{where}: litekv's ONNX attention ops read a float32 or int8 cache, and this one is "
                          f"{manifest.kv_dtype}; reconvert the model.")


def _check_sizes(manifest: Manifest, where: str) -> None:
    """The max context fits the model, prompt lengths and capacities the max context, token ids the vocabulary."""
    m = manifest
    if m.max_context > m.config.max_position:
        raise BundleError(f"{where}: max_context {m.max_context} is above config.max_position "
                          f"{m.config.max_position}, the positions the model was trained for; reconvert the model.")
    if m.prefill_lengths[-1] > m.max_context:
        raise BundleError(f"{where}: prefill_lengths {list(m.prefill_lengths)} go past max_context {m.max_context}; "
                          "reconvert the model.")
    if m.kv_buckets[-1] != m.max_context:
        raise BundleError(f"{where}: kv_buckets {list(m.kv_buckets)} must end at max_context {m.max_context}; "
                          "reconvert the model.")
    if m.bos_token_id is not None and m.bos_token_id >= m.config.vocab_size:
        raise BundleError(f"{where}: bos_token_id {m.bos_token_id} is not below the vocab_size "
                          f"{m.config.vocab_size}; reconvert the model.")


def _check_signatures(manifest: Manifest, where: str) -> None:
    """Each entry point is of a kind its backend has, at one of the capacities."""
    m = manifest
    kinds = SIGNATURE_KINDS[m.backend]
    for sig in m.signatures:
        if sig.kind not in kinds:
            raise BundleError(f"{where}: signature {sig.name!r} is of kind {sig.kind!r}, which {m.backend} bundles "
                              f"do not have (they have {', '.join(kinds)}); reconvert the model.")
        if sig.kind != "sampler" and sig.capacity not in m.kv_buckets:
            raise BundleError(f"{where}: signature {sig.name!r} has capacity {sig.capacity}, which is not one of "
                              f"kv_buckets {list(m.kv_buckets)}; reconvert the model.")
    if m.backend == "litert":
        _check_litert_entry_points(m, where)


def _check_lora(manifest: Manifest, where: str) -> None:
    """A LoRA-ready bundle lists its targets and their input groups; any other lists none."""
    m = manifest
    grouped = {t for _, targets in m.lora_groups.values() for t in targets}
    if m.lora_rank is None:
        if m.lora_targets or m.lora_groups or any(s.lora for s in m.signatures):
            raise BundleError(f"{where}: lora_rank is null, yet the manifest has LoRA targets, groups or entry "
                              "points; reconvert the model.")
    elif not m.lora_targets or grouped != set(m.lora_targets):
        raise BundleError(f"{where}: lora_targets {list(m.lora_targets)} and the targets of lora_groups "
                          f"{sorted(grouped)} must be the same, and not empty; reconvert the model.")


def _check_litert_entry_points(manifest: Manifest, where: str) -> None:
    """The names the LiteRT executor derives (prefill_<tokens>[_s<capacity>][_lora], decode..., sampler)
    are the entry points the model has, at max context for every prefill length."""
    m = manifest
    names = {s.name for s in m.signatures}
    for sig in m.signatures:
        if sig.kind == "sampler":
            expected = SAMPLER_SIGNATURE if (sig.tokens, sig.capacity, sig.lora) == (1, 0, False) else None
        else:
            base = f"prefill_{sig.tokens}" if sig.kind == "prefill" else ("decode" if sig.tokens == 1 else None)
            suffix = ("" if sig.capacity == m.max_context else f"_s{sig.capacity}") + ("_lora" if sig.lora else "")
            expected = base and base + suffix
        if sig.name != expected:
            raise BundleError(f"{where}: signature {sig.name!r} ({sig.kind}, {sig.tokens} tokens, capacity "
                              f"{sig.capacity}, lora {str(sig.lora).lower()}) does not match its name; reconvert "
                              "the model.")
        if m.lora_rank is not None and not sig.lora and sig.kind != "sampler" and sig.name + "_lora" not in names:
            raise BundleError(f"{where}: the LoRA-ready bundle has no {sig.name}_lora entry point beside "
                              f"{sig.name}; reconvert the model.")
    needed = ["decode", *(f"prefill_{n}" for n in m.prefill_lengths if n > 1)]
    missing = [n for n in needed if n not in names]
    if missing:
        raise BundleError(f"{where}: the bundle has no {', '.join(missing)} entry point at max_context "
                          f"{m.max_context}; reconvert the model.")


# ---- field by field ---------------------------------------------------------------------------------

def _version(value: Any, where: str) -> int:
    if not is_int(value):
        raise BundleError(f"{where}: the manifest's version must be an integer, got {value!r}; reconvert the "
                          "model.")
    if value not in READABLE_VERSIONS:
        readable = ", ".join(map(str, READABLE_VERSIONS))
        todo = ("it was written by a newer litekv: upgrade litekv" if value > VERSION
                else "reconvert the model with this litekv")
        raise BundleError(f"{where}: bundle format version {value} is not supported by this litekv (it reads "
                          f"versions {readable}); {todo}.")
    return value


def _bad(where: str, name: str, wanted: str, value: Any) -> BundleError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return BundleError(f"{where}: {name} must be {wanted}, got {shown}; reconvert the model.")


def _int(where: str, name: str, value: Any, minimum: int = 1) -> int:
    if not is_int(value) or value < minimum:
        wanted = {1: "a positive integer", 0: "a non-negative integer"}.get(minimum, f"an integer >= {minimum}")
        raise _bad(where, name, wanted, value)
    return value


def _number(where: str, name: str, value: Any, zero_allowed: bool = False) -> float:
    """A finite float (JSON may write a whole one as an int), positive or, if allowed, zero."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < 0 or (value == 0 and not zero_allowed)):
        raise _bad(where, name, "a finite number >= 0" if zero_allowed else "a finite positive number", value)
    return float(value)


def _bool(where: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _bad(where, name, "true or false", value)
    return value


def _str(where: str, name: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(where, name, "a non-empty string", value)
    return value


def _of_type(kind: type | tuple[type, ...], what: str):
    """A check that the value is a `kind` (described to the user as `what`)."""
    def check(where: str, name: str, value: Any):
        if not isinstance(value, kind):
            raise _bad(where, name, what, value)
        return value
    return check


_text = _of_type(str, "a string")


def _choice(where: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise _bad(where, name, f"one of {', '.join(map(repr, choices))}", value)
    return value


def _optional(check):
    """The check, or None for a JSON null."""
    return lambda where, name, value: None if value is None else check(where, name, value)


_dict = _of_type(dict, "a JSON object")
_list = _of_type((list, tuple), "a JSON list")  # tuples: a Manifest built in code


def _required(cls: type) -> list[str]:
    """A dataclass's fields without a default."""
    return [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]


def _keys(where: str, name: str, data: dict, required: Any, allowed: Any) -> None:
    missing = [k for k in required if k not in data]
    unknown = sorted(set(data) - set(allowed))
    if missing:
        raise BundleError(f"{where}: {name} is incomplete (no {', '.join(missing)}); reconvert the model.")
    if unknown:
        raise BundleError(f"{where}: {name} has unknown fields {', '.join(unknown)}; reconvert the model.")


def _lengths(where: str, name: str, value: Any) -> tuple[int, ...]:
    """A non-empty, strictly increasing list of positive integers (token counts, capacities)."""
    items = tuple(_int(where, f"{name}[{i}]", v) for i, v in enumerate(_list(where, name, value)))
    if not items or any(a >= b for a, b in zip(items, items[1:])):
        raise _bad(where, name, "a non-empty list of increasing positive integers", value)
    return items


def _token_ids(where: str, name: str, value: Any) -> tuple[int, ...]:
    return tuple(_int(where, f"{name}[{i}]", v, 0) for i, v in enumerate(_list(where, name, value)))


def _strings(where: str, name: str, value: Any, choices: tuple[str, ...] | None = None,
             unique: bool = True) -> tuple[str, ...]:
    """A list of non-empty strings (of `choices`, if given), without repeats if `unique`."""
    items = _list(where, name, value)
    check = _str if choices is None else partial(_choice, choices=choices)
    out = tuple(check(where, f"{name}[{i}]", v) for i, v in enumerate(items))
    if unique and len(set(out)) != len(out):
        raise _bad(where, name, "a list without repeats", value)
    return out


def _file_sizes(where: str, name: str, value: Any) -> dict[str, int]:
    sizes = _dict(where, name, value)
    for key, size in sizes.items():
        _int(where, f"{name}[{key!r}]", size, 0)
    return sizes


def _file_name(where: str, name: str, value: Any) -> str:
    """A path relative to the bundle directory that stays inside it (symlinks: see read_manifest)."""
    path = PurePosixPath(_str(where, name, value))
    if path.is_absolute() or ".." in path.parts or str(path) == "." or any(c in value for c in "\\\0"):
        raise _bad(where, name, "a file name inside the bundle directory", value)
    return value


def _fingerprint(where: str, name: str, value: Any) -> str:
    # It names cache files (the XNNPACK weight cache): hex digits only.
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-f]{8,128}", value):
        raise _bad(where, name, "a hex digest", value)
    return value


def _quantization(where: str, name: str, value: Any) -> dict[str, Any]:
    data = _dict(where, name, value)
    _keys(where, name, data, QUANTIZATION_FORMATS, QUANTIZATION_FORMATS)
    for key, formats in QUANTIZATION_FORMATS.items():
        if formats is None:
            if _int(where, f"{name}.{key}", data[key]) % 2:
                raise _bad(where, f"{name}.{key}", "a positive even integer", data[key])
        else:
            _choice(where, f"{name}.{key}", data[key], formats)
    return data


def _lora_groups(where: str, name: str, value: Any) -> dict[str, list[list[str]]]:
    """group name -> [projections fused in one matmul, the LoRA targets among them]"""
    groups = _dict(where, name, value)
    for group, pair in groups.items():
        if not re.fullmatch(r"[a-z]+", group):  # part of the graphs' input names
            raise _bad(where, f"{name} key", "lower-case letters", group)
        where_pair = f"{name}.{group}"
        if len(_list(where, where_pair, pair)) != 2:
            raise _bad(where, where_pair, "[projections, targets]", pair)
        parts = _strings(where, f"{where_pair}[0]", pair[0], LORA_TARGETS)
        targets = _strings(where, f"{where_pair}[1]", pair[1], LORA_TARGETS)
        if not targets or not set(targets) <= set(parts):
            raise _bad(where, f"{where_pair}[1]", f"some of its projections {list(parts)}", pair[1])
    return groups


def _signatures(where: str, name: str, value: Any) -> tuple[SignatureInfo, ...]:
    sigs = tuple(_signature(where, f"{name}[{i}]", s) for i, s in enumerate(_list(where, name, value)))
    names = [s.name for s in sigs]
    if not sigs or len(set(names)) != len(names):
        raise _bad(where, name, "a non-empty list of entry points with distinct names", names)
    return sigs


def _signature(where: str, name: str, value: Any) -> SignatureInfo:
    data = asdict(value) if isinstance(value, SignatureInfo) else _dict(where, name, value)
    allowed = [f.name for f in fields(SignatureInfo)]
    _keys(where, name, data, allowed, allowed)
    tokens = data["tokens"]
    if not is_int(tokens) or (tokens < 1 and tokens != -1):
        raise _bad(where, f"{name}.tokens", "a positive integer, or -1 for any number", tokens)
    kind = _choice(where, f"{name}.kind", data["kind"], _ALL_SIGNATURE_KINDS)
    return SignatureInfo(name=_str(where, f"{name}.name", data["name"]), kind=kind, tokens=tokens,
                         capacity=_int(where, f"{name}.capacity", data["capacity"], 0 if kind == "sampler" else 1),
                         lora=_bool(where, f"{name}.lora", data["lora"]),
                         inputs=_strings(where, f"{name}.inputs", data["inputs"]),
                         outputs=_strings(where, f"{name}.outputs", data["outputs"]))


def _rope(where: str, name: str, value: Any) -> dict[str, Any]:
    data = _dict(where, name, value)
    allowed = [f.name for f in fields(RopeConfig)]
    _keys(where, name, data, ("theta",), allowed)
    for key in ("theta", "factor", "low_freq_factor", "high_freq_factor"):
        if key in data:
            _number(where, f"{name}.{key}", data[key])
    if "kind" in data:
        _choice(where, f"{name}.kind", data["kind"], ROPE_KINDS)
    if "original_max_position" in data:
        _int(where, f"{name}.original_max_position", data["original_max_position"])
    if data.get("kind") == "llama3" and data.get("high_freq_factor", 4.0) <= data.get("low_freq_factor", 1.0):
        raise _bad(where, f"{name}.high_freq_factor", "above low_freq_factor for llama3 scaling",
                   data.get("high_freq_factor"))
    return data


_CONFIG_CHECKS = {
    **{key: _int for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                             "num_kv_heads", "head_dim", "max_position")},
    **{key: _bool for key in ("tie_embeddings", "attention_bias", "qk_norm", "sandwich_norms")},
    "architecture": _str,
    "norm_eps": _number,
    "embed_scale": _number,
    "attn_scale": partial(_number, zero_allowed=True),  # 0: head_dim ** -0.5
    "rope": _rope,
    "local_rope": _optional(_rope),
    "activation": partial(_choice, choices=ACTIVATIONS),
    "sliding_window": _optional(_int),
    "layer_types": partial(_strings, choices=LAYER_KINDS, unique=False),
    "bos_token_id": _optional(partial(_int, minimum=0)),
    "eos_token_ids": _token_ids,
}


def _config(where: str, name: str, value: Any) -> ModelConfig:
    """The config, checked in its JSON form, also one built in code (whose own checks leave the types to its
    builder), then built again from that form, as reading the manifest would."""
    data = value.to_dict() if isinstance(value, ModelConfig) else _dict(where, name, value)
    _keys(where, name, data, _required(ModelConfig), data)  # unknown keys: ModelConfig.from_dict logs them
    for key, check in _CONFIG_CHECKS.items():
        if key in data:
            check(where, f"{name}.{key}", data[key])
    try:
        return ModelConfig.from_dict(data)
    except ConfigError as e:  # the fields' agreement: head_dim, heads, layer types, sliding window, BOS
        raise BundleError(f"{where}: {name} is inconsistent ({str(e).rstrip('.')}); reconvert the model.") from e


# Every manifest field: its check, which returns the value the dataclass holds.
_FIELD_CHECKS = {
    "backend": partial(_choice, choices=BACKENDS),
    "model_file": _file_name,
    "config": _config,
    "max_context": _int,
    "prefill_lengths": _lengths,
    "kv_buckets": _lengths,
    "kv_layout": _str,  # checked against the backend's layouts once the manifest is whole
    "kv_dtype": _str,
    "quantization": _quantization,
    "lora_rank": _optional(_int),
    "lora_targets": partial(_strings, choices=LORA_TARGETS),
    "signatures": _signatures,
    "fingerprint": _fingerprint,
    "chat_template": _optional(_text),
    "bos_token_id": _optional(partial(_int, minimum=0)),
    "eos_token_ids": _token_ids,
    "file_sizes": _file_sizes,
    "source": _dict,
    "sampler_file": _optional(_file_name),
    "lora_groups": _lora_groups,
    "lora_layout": partial(_choice, choices=LORA_LAYOUTS),
    "decode_attention": _str,
    "prefill_attention": _str,
    "kv_row_scales": _bool,
    "decode_linears": _str,
    "prefill_linears": _str,
    "lm_head_kernel": _bool,
    "decode_model_file": _optional(_file_name),
    "sampler_refuses_non_finite": _bool,
}
