"""Shared fixtures of the conformance suite: tiny bundles of every architecture for every backend."""
from __future__ import annotations

import atexit
from functools import lru_cache
from pathlib import Path
import shutil
import tempfile

import numpy as np

from litekv.converters.checkpoint import load_checkpoint
from litekv.converters.convert import ConvertOptions, convert
from litekv.executor import open_executor
from litekv.executor.numpy_executor import NumpyExecutor
from model_factory import make_checkpoint

BACKENDS = ("litert", "onnx")
MAX_CONTEXT = 64
PREFILL_LENGTHS = (4, 8)
KV_BUCKETS = (16, 32, 64)


def scratch_dir(prefix: str) -> Path:
    """A temporary directory for the bundles of one test session, removed when the session ends
    (each SmolLM2 session converts about 2.5 GB)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


_ROOT = scratch_dir("litekv-conformance-")


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


@lru_cache(maxsize=None)
def checkpoint_dir(arch: str) -> Path:
    return make_checkpoint(arch, _ROOT / f"ckpt-{arch}", seed=11)


def bundle(arch: str, backend: str, quantize: str = "fp32", lora_rank: int | None = None,
           max_context: int = MAX_CONTEXT, lm_head: str | None = None) -> Path:
    # One cache key however the arguments are spelled: a second conversion to the same path would
    # replace a model file that an executor has mapped.
    return _bundle(arch, backend, quantize, lora_rank, max_context, lm_head)


@lru_cache(maxsize=None)
def _bundle(arch: str, backend: str, quantize: str, lora_rank: int | None, max_context: int,
            lm_head: str | None) -> Path:
    buckets = tuple(b for b in (16, 32, 64, 128, 256, 512) if b < max_context) + (max_context,)
    options = ConvertOptions(backend=backend, quantize=quantize, max_context=max_context,
                             prefill_lengths=PREFILL_LENGTHS, lora_rank=lora_rank,
                             kv_buckets=buckets if backend == "litert" else None, lm_head=lm_head,
                             kv_cache="fp32")  # exact lowering; the float16 and int8 caches have their own tests
    name = f"{arch}-{backend}-{quantize}-{lora_rank}-{max_context}-{lm_head}"
    return convert(checkpoint_dir(arch), _ROOT / name, options)


def executor(arch: str, backend: str, quantize: str = "fp32", lora_rank: int | None = None,
             max_context: int = MAX_CONTEXT, lm_head: str | None = None):
    return _executor(arch, backend, quantize, lora_rank, max_context, lm_head)


@lru_cache(maxsize=None)
def _executor(arch: str, backend: str, quantize: str, lora_rank: int | None, max_context: int, lm_head: str | None):
    return open_executor(bundle(arch, backend, quantize, lora_rank, max_context, lm_head))


@lru_cache(maxsize=None)
def reference(arch: str, lora_rank: int | None = None) -> NumpyExecutor:
    ckpt = load_checkpoint(checkpoint_dir(arch), with_tokenizer=False)
    return NumpyExecutor(ckpt.config, ckpt.weights, max_context=MAX_CONTEXT, lora_rank=lora_rank)
