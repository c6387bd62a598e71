"""What a KV cache format would cost in quality, before any kernel is written for it.

The numpy reference model (litekv.reference) runs SmolLM2 with a float32 cache, except that each
new K and V row is quantized and dequantized as it is written, in the format under test. Its
teacher-forced next-token distributions on the benchmark's three 200-token passages (as in
bench/quality_kl.py) are compared with an unquantized run: mean KL and top-1 agreement. The
weights stay float32, so the figures are the cache's error alone.

Formats: litekv's int8 cache (one static scale per KV head and channel, from the converter's
calibration), scales per row (each token's head vector gets its own, computed as it is written),
per group of 32 channels of a row, and 4-bit codes of each. The first row checks the simulation
against the LiteRT bundle with fp32 weights and an int8 cache (twelfth round of
bench/PERFORMANCE.md: mean KL 0.0041, 96.3 % agreement).

    python bench/kv_format_quality.py
"""
from __future__ import annotations

import argparse
from typing import Callable

import numpy as np

from common import markdown_table, save
from litekv import reference
from litekv.catalog import checkpoint_path
from litekv.converters.checkpoint import load_checkpoint
from litekv.converters.kv_calibration import int8_kv_scales
from quality_kl import log_softmax, passages

Quantizer = Callable[[np.ndarray, int], np.ndarray]  # (rows [B, T, KVH, D], layer) -> dequantized rows


def static(scales: np.ndarray, levels: int) -> Quantizer:
    """One scale per (layer, KV head, channel): scales [layers, KVH, D], codes in [-levels, levels]."""
    return lambda x, layer: np.clip(np.rint(x / scales[layer]), -levels, levels) * scales[layer]


def per_row(levels: int, group: int | None = None) -> Quantizer:
    """One scale per row of a head (or per `group` channels of it): its largest |x| maps to `levels`."""
    def quantize(x: np.ndarray, layer: int) -> np.ndarray:
        grouped = x.reshape(*x.shape[:-1], -1, group or x.shape[-1])
        scale = np.maximum(np.abs(grouped).max(axis=-1, keepdims=True), np.float32(1e-12)) / np.float32(levels)
        return (np.rint(grouped / scale) * scale).reshape(x.shape)
    return quantize


def formats(key_scales: np.ndarray, value_scales: np.ndarray) -> dict[str, tuple[float, Quantizer, Quantizer]]:
    """name -> (bits per K and V element, averaged, scales included at float16; keys; values)."""
    int4_keys, int4_values = key_scales * (127 / 7), value_scales * (127 / 7)  # the calibrated range in 4 bits
    row = 16 / 64  # a float16 scale per 64-channel row, in bits per element
    return {
        "int8, static scales per channel (litekv's)": (8, static(key_scales, 127), static(value_scales, 127)),
        "int8 keys static, int8 values per row": (8 + row / 2, static(key_scales, 127), per_row(127)),
        "int8 per row": (8 + row, per_row(127), per_row(127)),
        "int8 keys static, int4 values per row": (6 + row / 2, static(key_scales, 127), per_row(7)),
        "int8 keys static, int4 values per 32 channels": (6 + row, static(key_scales, 127), per_row(7, 32)),
        "int4, static scales per channel": (4, static(int4_keys, 7), static(int4_values, 7)),
        "int4 per row": (4 + row, per_row(7), per_row(7)),
        "int4 per 32 channels": (4 + 2 * row, per_row(7, 32), per_row(7, 32)),
    }


def teacher_forced(model: reference.ReferenceModel, token_lists: list[list[int]],
                   keys: Quantizer | None = None, values: Quantizer | None = None) -> list[np.ndarray]:
    """Log-probabilities [T, vocab] per passage, the cache rows passed through the quantizers."""
    write_and_attend = reference.NumpyOps.attention

    def attention(ops, q, k, v, layer, window, scale):
        if keys is not None:
            k, v = keys(k, layer).astype(np.float32), values(v, layer).astype(np.float32)
        return write_and_attend(ops, q, k, v, layer, window, scale)

    reference.NumpyOps.attention = attention
    try:
        return [log_softmax(model.forward(np.asarray(ids), model.new_cache(len(ids)))[0].astype(np.float64))
                for ids in token_lists]
    finally:
        reference.NumpyOps.attention = write_and_attend


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    checkpoint = load_checkpoint(checkpoint_path())
    model = reference.ReferenceModel(checkpoint.config, checkpoint.weights)
    token_lists = passages(checkpoint.tokenizer)
    key_scales, value_scales = int8_kv_scales(checkpoint.config, checkpoint.weights, checkpoint.tokenizer)
    exact = teacher_forced(model, token_lists)
    rows, result = [], {}
    for name, (bits, keys, values) in formats(key_scales, value_scales).items():
        got = teacher_forced(model, token_lists, keys, values)
        kl = [float(np.mean(np.sum(np.exp(r) * (r - g), axis=1))) for r, g in zip(exact, got)]
        agreement = [float(np.mean(r.argmax(1) == g.argmax(1))) for r, g in zip(exact, got)]
        result[name] = dict(bits=bits, kl=kl, agreement=agreement)
        rows.append([name, f"{bits:.2f}", f"{np.mean(kl):.4f}", f"{100 * np.mean(agreement):.1f}"])
        print(f"{name}: mean KL {np.mean(kl):.4f}", flush=True)
    print(markdown_table(["KV cache format (SmolLM2, fp32 weights)", "bits per element", "mean KL, nats",
                          "top-1 agreement, %"], rows))
    save("kv_format_quality", result)


if __name__ == "__main__":
    main()
