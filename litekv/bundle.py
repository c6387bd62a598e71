"""A converted model bundle: the model file, its tokenizer and the `litekv.json` manifest.

The manifest is the contract between the converter and the executors: signatures with their
token count and KV capacity, the KV layout, quantization, LoRA inputs and the model fingerprint.
"""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from litekv.errors import LitekvError
from litekv.models.config import ModelConfig

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
VERSION = 18
READABLE_VERSIONS = (3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18)
ATTENTION_KINDS = ("kernel", "graph")
SAMPLER_SIGNATURE = "sampler"
# The sampler graph's scalar inputs, each of shape [1], in order: (name, dtype).
SAMPLER_INPUTS = (("temperature", "float32"), ("top_k", "int32"), ("top_p", "float32"), ("seed", "int32"))
# int32 [1] input of a graph whose fp32 head is screened: 0 computes every logit; k > 0 only the rows
# that can rank among the k largest exactly, the rest the lowest float (the in-graph sampler passes
# its candidates' count, litekv.sampling.CANDIDATES).
HEAD_KEEP_INPUT = "head_keep"
BACKENDS = ("litert", "onnx")
# --kv-cache format -> the cache tensors' dtype (Manifest.kv_dtype). "int8-row": int8 codes with a
# float32 scale per token and KV head beside them (Manifest.kv_row_scales), LiteRT with litekv's kernels.
KV_CACHE_DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8", "int8-row": "int8"}
KV_CACHE_FORMATS = tuple(KV_CACHE_DTYPES)


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
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise BundleError(f"{where}: the manifest is not valid JSON ({e}); reconvert the model.") from e
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise BundleError(f"{where}: not a litekv bundle manifest.")
        if data.get("version") not in READABLE_VERSIONS:
            raise BundleError(f"{where}: bundle format version {data.get('version')} is not supported by this "
                              f"litekv (it reads versions {', '.join(map(str, READABLE_VERSIONS))}); reconvert the "
                              "model or upgrade litekv.")
        if data["version"] >= 6 and "prefill_attention" not in data:  # only older versions default it
            raise BundleError(f"{where}: the manifest is incomplete (no prefill_attention); reconvert the model.")
        if data["version"] < 16:  # no LM head in litekv's op before it
            data.pop("lm_head_kernel", None)
        try:
            data.pop("format"), data.pop("version")
            data["config"] = ModelConfig.from_dict(data["config"])
            data["signatures"] = tuple(SignatureInfo(**{**s, "inputs": tuple(s["inputs"]),
                                                        "outputs": tuple(s["outputs"])}) for s in data["signatures"])
            for key in ("prefill_lengths", "kv_buckets", "lora_targets", "eos_token_ids"):
                data[key] = tuple(data[key])
            manifest = cls(**data)
        except (KeyError, TypeError) as e:
            raise BundleError(f"{where}: the manifest is incomplete ({e}); reconvert the model.") from e
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
        rows = {"litert": "BSHD", "onnx": "BHSD"}.get(manifest.backend)  # the backend's layout, keys as rows
        if rows is None or manifest.kv_layout not in (rows, rows + "_KB8"):
            raise BundleError(f"{where}: KV layout {manifest.kv_layout!r} is not one of the {manifest.backend!r} "
                              "backend's; reconvert the model.")
        if manifest.kv_layout.endswith("_KB8") and (manifest.kv_dtype != "int8" or manifest.kv_row_scales
                                                    or manifest.decode_attention != "kernel"
                                                    or manifest.prefill_attention != "kernel"
                                                    or manifest.config.head_dim % 2
                                                    or any(s % 8 for s in (manifest.max_context,
                                                                           *manifest.kv_buckets))):
            raise BundleError(f"{where}: keys in blocks ({manifest.kv_layout}) need a statically scaled int8 cache "
                              "that only litekv's attention ops read, an even head_dim and capacities in whole "
                              "blocks of 8; reconvert the model.")
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
        return manifest


def read_manifest(bundle: str | Path) -> Manifest:
    path = Path(bundle) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError as e:
        raise BundleError(f"{bundle}: no {MANIFEST}; pass a directory made by `litekv convert`.") from e
    except OSError as e:
        raise BundleError(f"{path}: cannot be read ({e.strerror}).") from e
    manifest = Manifest.from_json(text, str(path))
    for name in filter(None, (manifest.model_file, manifest.decode_model_file)):
        if not (Path(bundle) / name).exists():
            raise BundleError(f"{bundle}: the model file {name} is missing; reconvert the model.")
    return manifest


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write a file so readers see the old or the new content, never a torn one."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
