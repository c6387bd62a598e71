"""Executors: the model runners behind the base, external-sampler and internal-sampler interfaces."""
from __future__ import annotations

from pathlib import Path

from litekv.bundle import read_manifest

from .base import (ACCELERATORS, ExecutorBase, ExternalSamplerExecutor, InternalSamplerExecutor, LoraInUse,
                   SamplerParams, check_accelerator, check_threads)
from .lora import LoraAdapter, LoraError, load_peft_adapter
from .prefill_plan import Chunk, plan_prefill


def open_executor(bundle: str | Path, accelerator: str | list = "cpu", threads: int | None = None):
    """The executor for a converted bundle: LiteRT for .tflite bundles, ONNX Runtime for .onnx ones.

    accelerator: one of ACCELERATORS ("auto": the first of gpu, npu, cpu that works), or for ONNX
    bundles a list of execution providers; threads: a positive int, None for the default (2)."""
    threads = check_threads(threads)
    manifest = read_manifest(bundle)
    check_accelerator(manifest.backend, accelerator, provider_lists=manifest.backend == "onnx")
    if manifest.backend == "litert":
        from .litert_executor import LiteRTExecutor

        return LiteRTExecutor(bundle, manifest, accelerator=accelerator, threads=threads)
    from .onnx_executor import OnnxExecutor

    return OnnxExecutor(bundle, manifest, accelerator=accelerator, threads=threads)


__all__ = ["ACCELERATORS", "ExecutorBase", "ExternalSamplerExecutor", "InternalSamplerExecutor", "SamplerParams",
           "LoraAdapter", "LoraError", "LoraInUse", "load_peft_adapter", "open_executor", "plan_prefill", "Chunk"]
