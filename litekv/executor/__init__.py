"""Executors: the model runners behind the base, external-sampler and internal-sampler interfaces."""
from __future__ import annotations

from pathlib import Path

from litekv.bundle import read_manifest

from .base import ExecutorBase, ExternalSamplerExecutor, InternalSamplerExecutor, LoraInUse, SamplerParams
from .lora import LoraAdapter, LoraError, load_peft_adapter
from .prefill_plan import Chunk, plan_prefill


def open_executor(bundle: str | Path, accelerator: str | list = "cpu", threads: int | None = None):
    """The executor for a converted bundle: LiteRT for .tflite bundles, ONNX Runtime for .onnx ones."""
    manifest = read_manifest(bundle)
    if manifest.backend == "litert":
        from .litert_executor import LiteRTExecutor

        return LiteRTExecutor(bundle, manifest, accelerator=accelerator, threads=threads)
    from .onnx_executor import OnnxExecutor

    return OnnxExecutor(bundle, manifest, accelerator=accelerator, threads=threads)


__all__ = ["ExecutorBase", "ExternalSamplerExecutor", "InternalSamplerExecutor", "SamplerParams", "LoraAdapter",
           "LoraError", "LoraInUse", "load_peft_adapter", "open_executor", "plan_prefill", "Chunk"]
