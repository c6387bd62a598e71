"""Checkpoint -> bundle: options, signature planning, emission, and an atomic bundle write.

    python -m litekv.converters.convert SOURCE -o OUT --backend litert --quantize int8
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from litekv import bundle_swap
from litekv.bundle import (ATTENTION_KINDS, BACKENDS, KV_CACHE_DTYPES, KV_CACHE_FORMATS, MANIFEST, SAMPLER_SIGNATURE,
                           Manifest, SignatureInfo)
from litekv.atomic_file import fsync_path, write_atomic
from litekv.durable import directory_in_use, exclusive_lock, hold_directory, replace_durably
from litekv.errors import ConfigError, LitekvError
from litekv.models.config import ModelConfig
from litekv.validation import is_int

from .checkpoint import load_checkpoint
from .graph_ops import LORA_TARGETS, LoraSpec, Signature
from .progress import ProgressBar
from .quantize import EMBEDDING_FORMATS, WEIGHT_FORMATS, QuantPlan

DEFAULT_PREFILL = (32, 128, 512)
SMALLEST_BUCKET = 256


def default_kv_cache(backend: str, quantize: str, attention: str = "kernel", lora: bool = False,
                     linears: str = "graph") -> str:
    """The KV cache format a bundle gets without --kv-cache.

    ONNX: int8 for int4 and int8 weights attending in litekv's ops (their Int8 forms), without
    LoRA inputs. Against a float32 cache an int4 SmolLM2 step grew 1.26-1.37x from 64 to 2,048
    tokens instead of 2.1x, decoded at 1.17 of onnxruntime-genai int4 instead of 1.09 in the same
    run, prefilled level, and scored a mean KL of 0.0096 (LiteRT's int4 default: 0.0098; float32
    cache 0.0050; seventeenth round); an int8-weight step grew 1.12x instead of 1.45x, as fast at
    64 tokens, for a mean KL of 0.0328 against 0.0289 at the same top-1 agreement (90.2 against
    90.4 %; eighteenth round). fp32 weights keep fp32 (their step grows 1.16x; an int8 cache
    would cost 3 points of agreement), as does a float16 cache, which only GroupQueryAttention
    reads, and computes in float16 on the CPU (slower). LiteRT: fp16,
    which litekv's kernels read at half the bytes with the quality of fp32; int8 with int4 weights
    and litekv's decode kernel. There it keeps the float16 cache's top-1 agreement (92.4 against
    92.1 %, SmolLM2, bench/quality_kl.py) for 12 % more mean KL (0.0275 against 0.0245), decodes
    faster and its step grows less with the context. Not with int8 weights (+29 % KL), nor with
    graph attention, which widens the whole cache to float32 every step, nor with LoRA inputs: the
    scales are calibrated without adapters, which may move K and V past them."""
    if backend == "onnx":
        return "int8" if quantize in ("int4", "int8") and attention == "kernel" and not lora else "fp32"
    if attention != "kernel" or lora:
        return "fp16"
    # int8 weights with litekv's linear kernels: their error drops enough (mean KL 0.0135 with an int8
    # cache against 0.0266 for XNNPACK's linears and a float16 one) that the int8 cache's smaller step
    # growth (1.19 against 1.51) wins
    return "int8" if quantize == "int4" or (quantize == "int8" and linears == "kernel") else "fp16"


def default_decode_linears(backend: str, quantize: str, attention: str = "kernel", lora: bool = False) -> str:
    """Where a bundle's decode steps run their quantized linears without --decode-linears.

    LiteRT with int4 or int8 weights and litekv's attention kernel: "kernel". Its activations are
    rounded per 32 (a third of the mean KL against fp32), XNNPACK's worker stays asleep through a
    step (the int4 step grows 1.15-1.22x from 64 to 2,048 tokens, not 1.26-1.33x), and decode is
    as fast on short contexts (bench/PERFORMANCE.md, fifteenth round). ONNX with int4 weights:
    "kernel" too, in a decode graph of its own (one node a projection instead of MatMulNBits and
    its offsets' three; sixteenth round). Not with LoRA inputs, whose matmuls stay in the runtime's
    own ops (on LiteRT they would wake XNNPACK's worker; ONNX has no LoRA decode graph)."""
    if lora:
        return "graph"
    if backend == "onnx":
        return "kernel" if quantize == "int4" else "graph"
    return "kernel" if quantize in ("int4", "int8") and attention == "kernel" else "graph"


def default_prefill_linears(decode_linears: str, lora: bool = False) -> str:
    """Where a bundle's prefill chunks run their int4 linears (ConvertOptions.prefill_linears_kind
    asks only for int4 weights) without --prefill-linears.

    "kernel" wherever the decode steps' linears are litekv's: on AVX2 XNNPACK's
    block-wise int4 GEMM ran a 256-token prefill at 420 tok/s, half its int8 rate, and litekv's tiles
    compute the same projections at about twice XNNPACK's rate (bench/PERFORMANCE.md, twentieth
    round). The kernel library is then needed anyway. ONNX int4 bundles too: LinearInt4's tiles
    prefilled 1.6x as fast as MatMulNBits. Not with LoRA inputs, as for the steps."""
    return "kernel" if decode_linears == "kernel" and not lora else "graph"


@dataclass(frozen=True)
class ConvertOptions:
    backend: str = "litert"
    quantize: str = "fp32"
    max_context: int = 4096
    # None: DEFAULT_PREFILL's lengths that fit max_context (see prefill_chunk_lengths)
    prefill_lengths: tuple[int, ...] | None = None
    lora_rank: int | None = None
    lora_targets: tuple[str, ...] = LORA_TARGETS
    kv_buckets: tuple[int, ...] | None = None  # TFLite capacity buckets; default doubles from 256
    decode_buckets: tuple[int, ...] | None = None  # TFLite one-token buckets; default: the prefill buckets refined
    lm_head: str | None = None
    embedding: str | None = None
    sampler: bool = True
    # "fp32", "fp16" (half the bytes) or "int8" (static per-channel scales calibrated at conversion).
    # None: default_kv_cache for the backend, weights, decode attention and LoRA inputs.
    kv_cache: str | None = None
    # LiteRT one-token attention: "kernel" (litekv's custom op; the runtime needs litekv's compiled kernel)
    # or "graph" (builtin ops only, for any LiteRT runtime). None: "kernel" for LiteRT.
    decode_attention: str | None = None
    # LiteRT prefill-chunk attention, the same choice. With the kernel a chunk reads only the slots its
    # rows see, so prefill needs no capacity buckets: one entry point per chunk length.
    prefill_attention: str | None = None
    # One-token steps' int4 / int8 linears: "kernel" (litekv's custom ops, on the threads of its attention
    # kernel; ONNX: int4 only, in a decode graph of its own) or "graph" (XNNPACK's FULLY_CONNECTED, ONNX
    # Runtime's MatMulNBits). None: default_decode_linears.
    decode_linears: str | None = None
    # Prefill chunks' int4 linears: "kernel" (litekv's custom op, tiles of 8 rows x 4 tokens) or "graph"
    # (XNNPACK's block-wise int4 FULLY_CONNECTED, MatMulNBits). None: default_prefill_linears.
    prefill_linears: str | None = None
    # A statically scaled int8 cache whose keys litekv's attention ops keep in blocks of 8 slots
    # (kv_layout BSHD_KB8 / BHSD_KB8). On x86-64 with AVX2 and no AVX-512 the decode kernel scores a
    # block without reduction trees: a 2,048-slot call in 0.87-0.97x the time, a 2,048-token int4 step
    # 2-3 % shorter. Every other CPU path reads the keys rewritten as rows, once per call: with the
    # portable path (ARM) a call took 1.22x as long, codes widened to floats 3.2x
    # (bench/PERFORMANCE.md, twenty-fourth round); so it is off by default.
    key_blocks: bool = False
    # An fp32 LM head in litekv's op gets an int8 screen (a quarter of its bytes) beside it: a step
    # that samples in the graph then reads the screen and the few hundred fp32 rows that can rank
    # among the sampler's 64 candidates, exactly as the whole head would give them; logits asked for
    # by the caller still come from every row. SmolLM2: 28 MB a step instead of 113.
    head_screen: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):  # lists and ranges from Python callers: stored as tuples (hashable, immutable)
            value = getattr(self, f.name)
            if isinstance(value, Sequence) and not isinstance(value, (str, tuple)):
                object.__setattr__(self, f.name, tuple(value))
        if self.backend not in BACKENDS:
            raise ConfigError(f"unknown backend {self.backend!r}; choose one of {', '.join(BACKENDS)}.")
        if self.quantize not in WEIGHT_FORMATS:
            raise ConfigError(f"unknown quantization {self.quantize!r}; choose one of {', '.join(WEIGHT_FORMATS)}.")
        if not is_int(self.max_context) or self.max_context <= 0:
            raise ConfigError(f"--max-context must be a positive whole number, got {self.max_context!r}.")
        self._check_prefill_lengths()
        if self.lora_rank is not None and self.lora_rank < 1:
            raise ConfigError(f"--lora-rank must be at least 1, got {self.lora_rank}; omit it for no LoRA inputs.")
        unknown = set(self.lora_targets) - set(LORA_TARGETS)
        if unknown:
            raise ConfigError(f"unknown LoRA targets {sorted(unknown)}; choose from {', '.join(LORA_TARGETS)}.")
        for flag, buckets in (("KV", self.kv_buckets), ("decode", self.decode_buckets)):
            if buckets is None:
                continue
            if self.backend == "onnx":
                raise ConfigError(f"{flag} buckets are a LiteRT option: ONNX Runtime's GroupQueryAttention reads "
                                  f"only the live tokens of one max-context cache. Drop --{flag.lower()}-buckets.")
            b = list(buckets)
            if not b or b != sorted(set(b)) or b[-1] != self.max_context or b[0] <= 0:
                raise ConfigError(f"{flag} buckets must increase and end at the max context {self.max_context}, "
                                  f"got {b}.")
        if self.kv_cache is not None and self.kv_cache not in KV_CACHE_FORMATS:
            raise ConfigError(f"unknown KV cache format {self.kv_cache!r}; choose one of {', '.join(KV_CACHE_FORMATS)}.")
        if self.kv_cache == "int8-row":
            if self.backend != "litert":
                raise ConfigError("--kv-cache int8-row is a LiteRT format: ONNX Runtime's GroupQueryAttention keeps "
                                  "its own int8 cache. Use --kv-cache int8 for ONNX.")
            if "graph" in (self.decode_attention, self.prefill_attention):
                raise ConfigError("--kv-cache int8-row is read by litekv's attention kernels only; drop "
                                  "--decode-attention graph / --prefill-attention graph, or use --kv-cache int8.")
            if self.kv_buckets is not None or self.decode_buckets is not None:
                raise ConfigError("--kv-cache int8-row bundles have one capacity, the max context: litekv's kernels "
                                  "read only the live slots. Drop --kv-buckets / --decode-buckets.")
        for flag, kind in (("decode", self.decode_attention), ("prefill", self.prefill_attention)):
            if kind is None:
                continue
            if kind not in ATTENTION_KINDS:
                raise ConfigError(f"unknown {flag} attention {kind!r}; choose one of {', '.join(ATTENTION_KINDS)}.")
            if self.backend == "onnx" and kind == "kernel" and not self._onnx_attention_kernel_fits:
                raise ConfigError(f"--{flag}-attention kernel on ONNX reads a float32 or int8 cache "
                                  f"(GroupQueryAttention keeps the float16 one). Drop --{flag}-attention or "
                                  "--kv-cache.")
        if self._onnx_one_graph and None not in (self.decode_attention, self.prefill_attention) \
                and self.decode_attention != self.prefill_attention:
            raise ConfigError("this ONNX bundle's steps and prefill chunks run one graph (its linears are ONNX "
                              "Runtime's), which attends one way: give --decode-attention and --prefill-attention "
                              "the same value, or only one of them.")
        if self.decode_linears is not None:
            if self.decode_linears not in ATTENTION_KINDS:
                raise ConfigError(f"unknown decode linears {self.decode_linears!r}; choose one of "
                                  f"{', '.join(ATTENTION_KINDS)}.")
            if self.backend == "onnx" and self.decode_linears == "kernel":
                if self.quantize != "int4":
                    raise ConfigError("--decode-linears kernel on ONNX is for int4 weights: int8 ones run in "
                                      "DynamicQuantizeMatMul, whose layout litekv's op does not read. Drop "
                                      "--decode-linears or use --quantize int4.")
                if self.lora_rank is not None:
                    raise ConfigError("--decode-linears kernel on ONNX has no LoRA graph; drop --decode-linears "
                                      "or --lora-rank.")
        if self.prefill_linears is not None:
            if self.prefill_linears not in ATTENTION_KINDS:
                raise ConfigError(f"unknown prefill linears {self.prefill_linears!r}; choose one of "
                                  f"{', '.join(ATTENTION_KINDS)}.")
        QuantPlan.named(self.quantize, self.lm_head, self.embedding)  # validates the head/table choices
        self._check_key_blocks()

    def _check_prefill_lengths(self) -> None:
        if self.prefill_lengths is None:  # the defaults are chosen to fit
            return
        if not self.prefill_lengths or not all(is_int(t) and t > 0 for t in self.prefill_lengths):
            raise ConfigError(f"prefill lengths must be positive integers, got {list(self.prefill_lengths)}.")
        too_long = [t for t in self.prefill_lengths if t > self.max_context]
        if too_long:
            raise ConfigError(f"prefill length {too_long[0]} is above the max context {self.max_context}; "
                              "lower it or raise --max-context.")

    @property
    def prefill_chunk_lengths(self) -> tuple[int, ...]:
        """The prefill entry points' lengths, increasing: prefill_lengths, else DEFAULT_PREFILL's that
        fit max_context, else (a context shorter than all of them) max_context itself."""
        if self.prefill_lengths is not None:
            return tuple(sorted(set(self.prefill_lengths)))
        return tuple(t for t in DEFAULT_PREFILL if t <= self.max_context) or (self.max_context,)

    @property
    def plan(self) -> QuantPlan:
        return QuantPlan.named(self.quantize, self.lm_head, self.embedding)

    @property
    def kv_format(self) -> str:
        """The KV cache's format, one of KV_CACHE_FORMATS (kv_cache, or the default for these weights)."""
        return self.kv_cache or default_kv_cache(self.backend, self.quantize, self.attention_kind,
                                                 self.lora_rank is not None, self.linears_kind)

    @property
    def kv_row_scales(self) -> bool:
        """An int8 cache whose scales are computed per row as it is written (Manifest.kv_row_scales)."""
        return self.kv_format == "int8-row"

    def _check_key_blocks(self) -> None:
        if self.key_blocks and not (self.kv_format == "int8" and self.attention_kind == "kernel"
                                    and self.prefill_attention_kind == "kernel"):
            raise ConfigError("--kv-key-blocks keeps an int8 cache's keys (--kv-cache int8) in blocks that only "
                              "litekv's attention kernels read: convert with kernel attention and an int8 cache.")
        if self.key_blocks and any(s % 8 for s in self.buckets()):
            raise ConfigError(f"--kv-key-blocks needs every KV capacity to be a multiple of 8, not "
                              f"{list(self.buckets())}: adjust --max-context or --kv-buckets.")

    @property
    def kv_dtype(self) -> str:
        """The cache tensors' dtype (Manifest.kv_dtype)."""
        return KV_CACHE_DTYPES[self.kv_format]

    @property
    def _onnx_attention_kernel_fits(self) -> bool:
        """litekv's ONNX attention ops read GroupQueryAttention's float32 and int8 caches, not its float16 one."""
        return (self.kv_cache or "fp32") in ("fp32", "int8")

    def _attention_kind(self, choice: str | None) -> str:
        """What the manifest records for one kind of entry point: "kernel" (litekv's attention op) by
        default, on ONNX too wherever the cache is float32 or int8. There a step's GroupQueryAttention
        took 52 us a layer at 320 tokens on one thread, litekv's kernel about 15 on two, and a 256-token
        int4 prefill 206 ms against 214 (seventeenth round, bench/PERFORMANCE.md). With the runtime's
        own linears the steps run the model graph, whose one-token calls take ONNX Runtime's pool
        (its worker spins between nodes, so litekv's helper thread would wait for that core)."""
        if self.backend != "onnx":
            return choice or "kernel"
        return choice or ("kernel" if self._onnx_attention_kernel_fits else "graph")

    @property
    def _onnx_one_graph(self) -> bool:
        """An ONNX bundle without a decode graph (its linears are the runtime's): steps and prefill
        chunks run one graph, so one attention choice serves both."""
        return self.backend == "onnx" and self.linears_kind != "kernel"

    @property
    def attention_kind(self) -> str:
        """The decode steps' attention."""
        one = self._onnx_one_graph and self.decode_attention is None
        return self._attention_kind(self.prefill_attention if one else self.decode_attention)

    @property
    def linears_kind(self) -> str:
        """The decode steps' quantized linears: "kernel" only where some weight is int4 or int8."""
        if self.decode_linears is None:
            # ONNX's default does not depend on the attention (whose default depends on the linears)
            attention = self.attention_kind if self.backend == "litert" else "graph"
            return default_decode_linears(self.backend, self.quantize, attention, self.lora_rank is not None)
        quantized = {self.plan.weights, self.plan.lm_head} & {"int4", "int8"}
        return "kernel" if quantized and self.decode_linears == "kernel" else "graph"

    @property
    def prefill_linears_kind(self) -> str:
        """The prefill chunks' int4 linears: "kernel" only where the projections are int4."""
        if self.plan.weights != "int4":
            return "graph"
        if self.prefill_linears is None:
            return default_prefill_linears(self.linears_kind, self.lora_rank is not None)
        return self.prefill_linears

    @property
    def prefill_attention_kind(self) -> str:
        """The prefill chunks' attention."""
        one = self._onnx_one_graph and self.prefill_attention is None
        return self._attention_kind(self.decode_attention if one else self.prefill_attention)

    @property
    def lora(self) -> LoraSpec | None:
        return None if self.lora_rank is None else LoraSpec(self.lora_rank, tuple(self.lora_targets))

    def buckets(self) -> tuple[int, ...]:
        """Every capacity some entry point is compiled for."""
        return tuple(sorted({*self.prefill_buckets(), *self.one_token_buckets()}))

    def prefill_buckets(self) -> tuple[int, ...]:
        """Capacities of the prefill entry points. The attention kernel reads only the slots a chunk's
        rows see (a 256-token chunk at the start of a 4,096-slot cache reads its causal triangle), so
        by default a kernel bundle prefills at max context alone: 4 entry points instead of 19 for
        SmolLM2, about 100 MB less memory (LiteRT's copy of each entry point's graph and XNNPACK's
        objects for it) and a load in 0.5 s rather than 1.7 s."""
        if self.backend == "onnx":  # GroupQueryAttention reads only the valid length
            return (self.max_context,)
        if self.kv_buckets is not None:
            return self.kv_buckets
        if self.prefill_attention_kind == "kernel":
            return (self.max_context,)
        return self._doubling_buckets()

    def _doubling_buckets(self) -> tuple[int, ...]:
        out, size = [], SMALLEST_BUCKET
        while size < self.max_context:
            out.append(size)
            size *= 2
        return (*out, self.max_context)

    def one_token_buckets(self) -> tuple[int, ...]:
        """Capacities of the decode and sampling entry points.

        litekv's attention kernel reads only the live slots, so by default a kernel bundle has one
        decode entry point, at max context: a step at 64 live tokens costs there what it costs in a
        128-slot bucket (5.18 against 5.31 ms, int4), and each entry point costs about 6 MB.
        Builtin-op attention reads the whole bucket, about a third of an int8 step at 512 slots, so
        for it these are finer than the prefill buckets: half a bucket is inserted between
        doublings and 128 below the smallest (a decode at 300 tokens runs in a 384-slot bucket,
        not 512)."""
        if self.backend == "onnx":
            return (self.max_context,)
        if self.decode_buckets is not None:
            return self.decode_buckets
        if self.kv_buckets is not None:
            return self.kv_buckets
        if self.attention_kind == "kernel":
            return (self.max_context,)
        coarse = self._doubling_buckets()
        finer = set(coarse) | {SMALLEST_BUCKET // 2}
        finer |= {a + (b - a) // 2 for a, b in zip(coarse, coarse[1:]) if b == 2 * a}
        return tuple(sorted(b for b in finer if b <= self.max_context))


OPTION_NAMES = tuple(f.name for f in fields(ConvertOptions))


def convert_options(base: ConvertOptions | None = None, **changes: Any) -> ConvertOptions:
    """`base` (default: every default) with `changes`, keyword names of ConvertOptions fields. The one
    way litekv.convert's keywords and the command line's flags become options."""
    if base is not None and not isinstance(base, ConvertOptions):
        raise ConfigError(f"options must be a ConvertOptions, got {type(base).__name__}; or pass its fields as "
                          "keywords.")
    unknown = sorted(set(changes) - set(OPTION_NAMES))
    if unknown:
        raise ConfigError(f"unknown conversion option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                          f"the options are {', '.join(OPTION_NAMES)}.")
    return replace(base, **changes) if base is not None else ConvertOptions(**changes)


def tflite_signatures(opts: ConvertOptions) -> list[Signature]:
    """Prefill and decode entry points for every capacity bucket (suffix-free at max), and one sampler.

    The sampler takes a decode's logits: a per-bucket decode-and-sample entry point would cost
    each process about 6 MB (LiteRT's in-memory copy of a one-token graph) for one call saved.

    A LoRA-ready model gets each entry point twice, plain and with a `_lora` suffix, so running
    without an adapter costs exactly what a model converted without LoRA costs.
    """
    sigs = []
    prefill, one_token = opts.prefill_buckets(), opts.one_token_buckets()
    for lora in (False, True) if opts.lora_rank is not None else (False,):
        tail = "_lora" if lora else ""
        for capacity in opts.buckets():
            suffix = ("" if capacity == opts.max_context else f"_s{capacity}") + tail
            if capacity in prefill:
                for tokens in opts.prefill_chunk_lengths:
                    if tokens <= capacity:
                        sigs.append(Signature(f"prefill_{tokens}{suffix}", tokens, capacity, lora, logits=False))
            if capacity in one_token:
                sigs.append(Signature(f"decode{suffix}", 1, capacity, lora))
    if opts.sampler:  # one small entry point fed from any decode's logits buffer
        sigs.append(Signature(SAMPLER_SIGNATURE, 1, 0, sampler=True))
    return sigs


def fingerprint(cfg: ModelConfig, weights: Mapping[str, np.ndarray], plan: QuantPlan,
                kv_scales: tuple[np.ndarray, np.ndarray] | None = None) -> str:
    """Identifies the model (weights, config, quantization) independently of the backend, and with an
    int8 KV cache its scales: a saved session's codes mean something only with the scales that wrote
    them, so a bundle calibrated differently must refuse it."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    digest.update(json.dumps(plan.to_dict(), sort_keys=True).encode())
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(weights[name], np.float32).tobytes())
    if kv_scales is not None:
        digest.update(b"int8 KV scales")
        for scales in kv_scales:  # keys', then values' [layers, KV heads, head_dim]
            digest.update(np.ascontiguousarray(scales, np.float32).tobytes())
    return digest.hexdigest()


def _writable_parent(output: Path) -> Path:
    parent = output.resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"cannot write {output}: the directory {parent} does not exist.")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"cannot write {output}: {parent} is not writable; choose another output directory.")
    if output.exists() and not output.is_dir():
        raise ConfigError(f"{output} exists and is not a directory; refusing to overwrite it: choose another "
                          "output path.")
    if output.exists() and not (output / MANIFEST).exists() and any(output.iterdir()):
        raise ConfigError(f"{output} exists and is not a litekv bundle; refusing to overwrite it.")
    return parent


def convert(source: str | Path, output: str | Path, options: ConvertOptions = ConvertOptions(),
            show_progress: bool = False) -> Path:
    """Convert a GGUF file or Hugging Face directory into a bundle directory at `output`.

    The bundle is assembled in a temporary directory beside `output`, flushed to disk and moved into
    place only when complete, so a failure never leaves a half-written bundle, and an existing bundle
    at `output` stays until the new one has replaced it. What a killed conversion to `output` left is
    recovered first (see _staging) and tidied once the new bundle is in place.
    """
    output = Path(output)
    parent = _writable_parent(output)
    started = time.perf_counter()
    bar = ProgressBar(enabled=show_progress)
    with _staging(output, parent) as staging:
        ckpt = load_checkpoint(source, progress=bar.stage("loading weights"))
        _check_fits(ckpt.config, options)
        manifest = _emit(ckpt, options, staging, bar)
        ckpt.tokenizer.save(staging)
        elapsed = time.perf_counter() - started
        manifest = _finish_manifest(manifest, staging, {"path": str(source), "format": ckpt.format,
                                                        "convert_seconds": round(elapsed, 2)})
        write_atomic(staging / MANIFEST, manifest.to_json())
        _fsync_tree(staging)
        _publish(staging, output, parent)
    bar.done(f"wrote {output} in {time.perf_counter() - started:.1f}s")
    return output


def _check_fits(cfg: ModelConfig, options: ConvertOptions) -> None:
    if options.key_blocks and cfg.head_dim % 2:
        raise ConfigError(f"--kv-key-blocks moves keys a dimension pair at a time; {cfg.architecture}'s head_dim "
                          f"{cfg.head_dim} is odd: convert without it.")
    if options.max_context > cfg.max_position:
        raise ConfigError(f"--max-context {options.max_context} exceeds what {cfg.architecture} was trained for "
                          f"({cfg.max_position}).")


@contextmanager
def _staging(output: Path, parent: Path) -> Iterator[Path]:
    """A new directory beside `output` to assemble the bundle in, removed on failure. It is held
    (see directory_in_use) while this conversion runs, so another one to `output` does not take it
    for a killed run's. A bundle a killed conversion left aside is put back at `output` first."""
    with exclusive_lock(bundle_swap.lock_file(output)):
        _restore_previous(output, parent)
        staging = Path(tempfile.mkdtemp(dir=parent, prefix=bundle_swap.prefix(output, bundle_swap.STAGING)))
        held = hold_directory(staging)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        os.close(held)


def _restore_previous(output: Path, parent: Path) -> None:
    """Killed between _swap_into_place's two renames, a conversion left no bundle at `output` and the
    previous one aside: put it back, so it is there whether or not this conversion succeeds."""
    previous = bundle_swap.previous_bundle(output)
    if previous is None:
        return
    try:
        replace_durably(previous, output)
    except OSError as e:
        raise ConfigError(f"an interrupted conversion left the previous bundle of {output} at {previous}, and "
                          f"moving it back failed ({e.strerror or e}). Check the permissions of {parent} "
                          "and convert again.") from e


def _fsync_tree(directory: Path) -> None:
    """Flush every file under `directory`, then the directories, whichever writer made them
    (onnx.save_model does not fsync), so the rename that publishes the bundle publishes data."""
    for root, _dirs, files in os.walk(directory, topdown=False):
        for name in files:
            fsync_path(os.path.join(root, name))
        fsync_path(root)


def _publish(staging: Path, output: Path, parent: Path) -> None:
    """Move the finished bundle into place, then remove what killed conversions to `output` left,
    one conversion at a time."""
    with exclusive_lock(bundle_swap.lock_file(output)):
        _swap_into_place(staging, output, parent)
        fsync_path(parent)
        _remove_stale(output)


def _remove_stale(output: Path) -> None:
    """With the new bundle in place, every aside copy is stale, and so is every staging directory
    no live conversion holds."""
    stale = bundle_swap.copies(output, bundle_swap.ASIDE)
    stale += [p for p in bundle_swap.copies(output, bundle_swap.STAGING) if not directory_in_use(p)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)


def _swap_into_place(staging: Path, output: Path, parent: Path) -> None:
    """Move the finished bundle `staging` to `output`. An existing bundle is renamed aside first and
    put back if the second rename fails: a crash leaves one of them, never neither (between the two
    renames, the old one under its aside name .<name>.old-*, which the next conversion puts back)."""
    aside = _move_aside(output, parent) if output.exists() else None
    try:
        os.replace(staging, output)
    except BaseException as e:
        if aside is not None:
            try:
                os.replace(aside, output)
            except OSError as restore:
                raise ConfigError(f"could not move the new bundle into {output} ({e}), nor the previous one back "
                                  f"({restore.strerror}); the previous one is intact at {aside}: rename it to "
                                  f"{output.name}.") from e
        if isinstance(e, OSError):
            kept = "the previous bundle there is unchanged" if aside is not None else "nothing was written"
            raise ConfigError(f"could not move the new bundle into {output} ({e.strerror or e}); {kept}. Check "
                              f"the permissions and free space of {parent} and convert again.") from e
        raise


def _move_aside(output: Path, parent: Path) -> Path:
    aside = Path(tempfile.mkdtemp(dir=parent, prefix=bundle_swap.prefix(output, bundle_swap.ASIDE)))
    try:
        os.replace(output, aside)  # onto the empty directory that reserved the name
    except OSError as e:
        aside.rmdir()
        raise ConfigError(f"could not replace {output}: renaming it aside failed ({e.strerror or e}); it is "
                          f"unchanged. Check the permissions of {parent} and convert again.") from e
    return aside


def _emit(ckpt, options: ConvertOptions, staging: Path, bar: ProgressBar) -> Manifest:
    cfg, plan = ckpt.config, options.plan
    kv_scales = None
    if options.kv_format == "int8":  # static scales; "int8-row" computes its scales as rows are written
        from .kv_calibration import int8_kv_scales

        kv_scales = int8_kv_scales(cfg, ckpt.weights, ckpt.tokenizer, progress=bar.stage("calibrating int8 KV"))
    if options.backend == "litert":
        from .emit_tflite import LORA_LAYOUT as TFLITE_LORA_LAYOUT
        from .emit_tflite import emit_tflite, float_head_in_kernel

        sigs = tflite_signatures(options)
        tick = bar.stage("tracing signatures")
        writer, groups = emit_tflite(cfg, ckpt.weights, plan, sigs, options.lora, options.max_context,
                             progress=lambda name, n=iter(range(1, len(sigs) + 1)): tick(next(n), len(sigs), name),
                             decode_attention=options.attention_kind,
                             prefill_attention=options.prefill_attention_kind, kv_scales=kv_scales,
                             kv_dtype=options.kv_dtype, kv_row_scales=options.kv_row_scales,
                             decode_linears=options.linears_kind, prefill_linears=options.prefill_linears_kind,
                             key_blocks=options.key_blocks, screened_head=options.head_screen and options.sampler)
        writer.write(staging / "model.tflite")
        bar.stage("writing model.tflite")(1, 1, f"{writer.data_bytes / 1e6:.0f} MB of weights")
        infos = tuple(SignatureInfo(s.name, "sampler" if s.sampler else ("decode" if s.tokens == 1 and s.logits
                                                                         else "prefill"),
                                    s.tokens, s.capacity, s.lora, tuple(sg.inputs), tuple(sg.outputs))
                      for s, sg in zip(sigs, writer.subgraphs))
        model_file, sampler_file, lora_layout = "model.tflite", None, TFLITE_LORA_LAYOUT
        layout = "BSHD_KB8" if options.key_blocks else "BSHD"
        decode_model_file = None
        lm_head_kernel = float_head_in_kernel(plan.lm_head, options.attention_kind)
    else:
        import onnx

        from .emit_onnx import LORA_LAYOUT as ONNX_LORA_LAYOUT
        from .emit_onnx import emit_onnx, emit_onnx_sampler, share_external_data

        # The plain graph always; a LoRA-ready bundle adds a LoRA graph over the same weight file, so
        # running without an adapter costs exactly what a model converted without LoRA costs.
        linears = options.linears_kind
        attention = dict(decode_attention=options.attention_kind, prefill_attention=options.prefill_attention_kind,
                         key_blocks=options.key_blocks, screened_head=options.head_screen and options.sampler)
        model, _ = emit_onnx(cfg, ckpt.weights, plan, None, options.max_context, kv_scales=kv_scales,
                             kv_dtype=options.kv_dtype, decode_linears=linears,
                             prefill_linears=options.prefill_linears_kind, **attention)
        bar.stage("tracing graph")(1, 1, f"{len(model.graph.node)} nodes")
        onnx.save_model(model, str(staging / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
        graphs = [("model", model, False)]
        decode_model_file, lm_head_kernel = None, False
        if linears == "kernel":  # decode steps get a graph of their own (one thread, litekv's), same weights
            step_model, _ = emit_onnx(cfg, ckpt.weights, plan, None, options.max_context, kv_scales=kv_scales,
                                      kv_dtype=options.kv_dtype, decode_linears=linears, step_graph=True, **attention)
            share_external_data(step_model, str(staging / "model.onnx"))
            decode_model_file = "model_decode.onnx"
            onnx.save_model(step_model, str(staging / decode_model_file))
            graphs.append(("decode", step_model, False))
        groups = {}
        if options.lora is not None:
            lora_model, groups = emit_onnx(cfg, ckpt.weights, plan, options.lora, options.max_context,
                                           kv_scales=kv_scales, kv_dtype=options.kv_dtype, **attention)
            share_external_data(lora_model, str(staging / "model.onnx"))
            onnx.save_model(lora_model, str(staging / "model_lora.onnx"))
            graphs.append(("model_lora", lora_model, True))
        sampler_file = None
        if options.sampler:
            onnx.save_model(emit_onnx_sampler(cfg), str(staging / "sampler.onnx"))
            sampler_file = "sampler.onnx"
        bar.stage("writing model.onnx")(1, 1, "")
        infos = tuple(SignatureInfo(name, "decode" if name == "decode" else "step", 1 if name == "decode" else -1,
                                    options.max_context, lora, tuple(i.name for i in g.graph.input),
                                    tuple(o.name for o in g.graph.output))
                      for name, g, lora in graphs)
        model_file, lora_layout = "model.onnx", ONNX_LORA_LAYOUT
        layout = "BHSD_KB8" if options.key_blocks else "BHSD"
    tok = ckpt.tokenizer
    return Manifest(
        backend=options.backend, model_file=model_file, config=cfg, max_context=options.max_context,
        prefill_lengths=options.prefill_chunk_lengths, kv_buckets=options.buckets(),
        kv_layout=layout, kv_dtype=options.kv_dtype, kv_row_scales=options.kv_row_scales,
        quantization=plan.to_dict(), lora_rank=options.lora_rank,
        lora_targets=tuple(options.lora_targets) if options.lora_rank else (), signatures=infos,
        fingerprint=fingerprint(cfg, ckpt.weights, plan, kv_scales), chat_template=tok.chat_template,
        bos_token_id=tok.bos_token_id, eos_token_ids=tuple(tok.eos_token_ids), sampler_file=sampler_file,
        lora_groups={name: [list(parts), list(targets)] for name, (parts, targets) in groups.items()},
        lora_layout=lora_layout, decode_attention=options.attention_kind,
        prefill_attention=options.prefill_attention_kind,
        decode_linears=options.linears_kind, prefill_linears=options.prefill_linears_kind,
        decode_model_file=decode_model_file,
        lm_head_kernel=lm_head_kernel,
        sampler_refuses_non_finite=options.sampler,
    )


def _finish_manifest(manifest: Manifest, staging: Path, source: dict) -> Manifest:
    sizes = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
    return Manifest(**{**manifest.__dict__, "file_sizes": sizes, "source": source})


# ---- command line --------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The converter's flags. Each option's dest is a ConvertOptions field and its default is absent,
    so options_from_args passes only what was given and the defaults live in ConvertOptions alone."""
    parser.add_argument("source", help="GGUF file or Hugging Face model directory")
    parser.add_argument("-o", "--output", required=True, help="bundle directory to write")
    group = parser.add_argument_group("conversion options", argument_default=argparse.SUPPRESS)
    group.add_argument("--backend", choices=BACKENDS, help="runtime of the bundle (default: litert)")
    group.add_argument("--quantize", choices=WEIGHT_FORMATS, help="weight precision (default: fp32)")
    group.add_argument("--lm-head", choices=WEIGHT_FORMATS, help="LM head precision (default: int8 if quantized)")
    group.add_argument("--embedding", choices=EMBEDDING_FORMATS, help="embedding table precision")
    group.add_argument("--max-context", type=int, help="tokens a session can hold (default: 4096)")
    group.add_argument("--prefill-lengths", type=_ints, help="comma-separated prefill signature lengths (default: "
                       f"those of {','.join(map(str, DEFAULT_PREFILL))} up to --max-context)")
    group.add_argument("--kv-buckets", type=_ints,
                       help="comma-separated KV capacities (TFLite), ending at --max-context")
    group.add_argument("--decode-buckets", type=_ints, help="comma-separated KV capacities of the one-token entry "
                       "points (TFLite; default: --kv-buckets, else the max context alone with the attention "
                       "kernel, finer than the prefill buckets with --decode-attention graph)")
    group.add_argument("--lora-rank", type=int, help="add LoRA inputs of this rank (on --lora-targets)")
    group.add_argument("--lora-targets", type=_names,
                       help=f"comma-separated projections that take LoRA inputs (default: {','.join(LORA_TARGETS)})")
    group.add_argument("--no-sampler", dest="sampler", action="store_false",
                       help="omit the in-graph sampling entry points")
    group.add_argument("--no-head-screen", dest="head_screen", action="store_false",
                       help="no int8 screen beside an fp32 LM head: in-graph sampling then reads the whole head")
    group.add_argument("--kv-key-blocks", dest="key_blocks", action="store_true",
                       help="keep an int8 cache's keys in blocks of 8 slots, which litekv's decode kernel scores "
                       "without reduction trees on x86-64 CPUs with AVX2 and no AVX-512 (a 2,048-token int4 step "
                       "2-3 %% shorter there); other CPUs read them rewritten as rows, slower")
    group.add_argument("--kv-cache", choices=KV_CACHE_FORMATS,
                       help="KV cache precision: fp16 reads half the bytes per step, int8 a quarter (default: "
                       "fp32 for ONNX; for LiteRT int8 with --quantize int4, or int8 with litekv's linear kernels, "
                       "with the decode kernel and without --lora-rank, else fp16); int8-row (LiteRT, litekv's "
                       "kernels): int8 codes with a scale per token and KV head, computed as each row is written, "
                       "so nothing is calibrated")
    group.add_argument("--decode-attention", choices=ATTENTION_KINDS,
                       help="one-token attention: kernel (default; litekv's compiled custom op, which reads the "
                       "cache once; on ONNX for a float32 cache without --lora-rank) or graph (the runtime's own "
                       "ops: builtins on LiteRT, GroupQueryAttention on ONNX)")
    group.add_argument("--prefill-attention", choices=ATTENTION_KINDS,
                       help="prefill-chunk attention: kernel (default; litekv's custom op, which reads only the "
                       "slots a chunk sees, so on LiteRT one entry point per chunk length serves every context; on "
                       "ONNX as for --decode-attention) or graph (LiteRT builtins, one entry point per chunk length "
                       "and capacity; ONNX GroupQueryAttention)")
    group.add_argument("--decode-linears", choices=ATTENTION_KINDS,
                       help="one-token steps' quantized linears: kernel (litekv's custom ops, on the threads of its "
                       "attention kernel, with activations rounded per 32; prefill keeps the runtime's matmuls (int4 "
                       "ones: see --prefill-linears) and the weights are stored once; default on LiteRT with int4 or "
                       "int8 weights and the attention kernel, on ONNX with int4 weights, in a decode graph of its "
                       "own; never with --lora-rank) or graph (XNNPACK's FULLY_CONNECTED, ONNX Runtime's MatMulNBits)")
    group.add_argument("--prefill-linears", choices=ATTENTION_KINDS,
                       help="prefill chunks' int4 linears: kernel (litekv's custom op, over the weights the steps "
                       "read; default where the steps' linears are litekv's and the weights int4) or graph "
                       "(XNNPACK's block-wise int4 FULLY_CONNECTED, ONNX Runtime's MatMulNBits)")


def _ints(text: str) -> tuple[int, ...]:
    """An argparse type: comma-separated whole numbers (argparse reports the message and exits with 2)."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def options_from_args(args: argparse.Namespace) -> ConvertOptions:
    """The given flags as options, through the path litekv.convert's keywords take."""
    return convert_options(**{name: getattr(args, name) for name in OPTION_NAMES if hasattr(args, name)})


def run_from_args(args: argparse.Namespace) -> int:
    path = convert(args.source, args.output, options_from_args(args), show_progress=True)
    manifest = json.loads((path / MANIFEST).read_text())
    for name, size in manifest["file_sizes"].items():
        print(f"  {name:<24} {size / 1e6:10.1f} MB")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="litekv-convert", description="Convert a checkpoint into a litekv bundle.")
    add_arguments(parser)
    try:
        return run_from_args(parser.parse_args(argv))
    except LitekvError as e:
        print(f"litekv-convert: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
