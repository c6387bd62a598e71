"""Weight quantization choices and the numpy quantizers both emitters share."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from litekv.errors import ConfigError

WEIGHT_FORMATS = ("fp32", "int8", "int4")
EMBEDDING_FORMATS = ("fp32", "fp16")


@dataclass(frozen=True)
class QuantPlan:
    """How each kind of weight is stored.

    weights: the transformer blocks' projections. lm_head: the output projection (tied models
    still get their own quantized copy; the embedding table is read by row, so it is kept in
    `embedding` precision and never pays for a matmul-friendly layout).
    """

    weights: str = "fp32"
    lm_head: str = "fp32"
    embedding: str = "fp32"
    block_size: int = 32

    def __post_init__(self) -> None:
        for field, allowed in (("weights", WEIGHT_FORMATS), ("lm_head", WEIGHT_FORMATS),
                               ("embedding", EMBEDDING_FORMATS)):
            if getattr(self, field) not in allowed:
                raise ConfigError(f"unknown {field} quantization {getattr(self, field)!r}; choose one of {allowed}.")
        if self.block_size <= 0 or self.block_size % 2:
            raise ConfigError(f"int4 block size must be a positive even number, got {self.block_size}.")

    @classmethod
    def named(cls, quantize: str, lm_head: str | None = None, embedding: str | None = None) -> "QuantPlan":
        """The defaults for `--quantize`: the head follows the weights down to int8, the table goes fp16."""
        if quantize not in WEIGHT_FORMATS:
            raise ConfigError(f"unknown quantization {quantize!r}; choose one of {', '.join(WEIGHT_FORMATS)}.")
        default_head = "fp32" if quantize == "fp32" else "int8"
        default_table = "fp32" if quantize == "fp32" else "fp16"
        return cls(weights=quantize, lm_head=lm_head or default_head, embedding=embedding or default_table)

    def format_for(self, weight: str) -> str:
        return self.lm_head if weight.startswith("lm_head") else self.weights

    def to_dict(self) -> dict:
        return dict(weights=self.weights, lm_head=self.lm_head, embedding=self.embedding, block_size=self.block_size)


def int8_per_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output row: returns (q int8 [out, in], scales float32 [out])."""
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=1)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scales[:, None]), -127, 127).astype(np.int8)
    return q, scales


def head_screen(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An fp32 LM head's int8 screen for litekv's screened head op (kernels/screened_head.c).

    Returns (codes int8 [out, in], row scales float32 [out], bounds float32 [out]) such that for any
    x, |(W x)[r] - s[r] (codes[r] . x)| <= bounds[r] * |x|_2 as both sides come out of float32
    arithmetic: the codes' rounding by Cauchy-Schwarz, |W[r] - s[r] codes[r]|_2, plus each float sum's
    rounding, at most in * 2^-24 * |row|_2 * |x|_2 for either side, doubled for margin.
    """
    w = np.asarray(w, np.float32)
    if not np.isfinite(w).all():
        raise ConfigError("the LM head holds NaN or infinite weights; check the checkpoint, or convert with "
                          "--no-head-screen.")
    codes, scales = int8_per_channel(w)
    wide = w.astype(np.float64)
    screen = codes.astype(np.float64) * scales.astype(np.float64)[:, None]
    error = np.linalg.norm(wide - screen, axis=1)
    rounding = 2 * w.shape[1] * 2.0 ** -24 * (np.linalg.norm(wide, axis=1) + np.linalg.norm(screen, axis=1))
    bounds = np.nextafter((error + rounding).astype(np.float32), np.float32(np.inf))  # rounded up
    return codes, scales, bounds


def int4_blockwise_asymmetric(w: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Min/max int4 per block: W ~= q * scale + offset with q in [-8, 7].

    Returns (q int8 [out, in], scales fp16 [out, in/block], offsets fp32 [out, in/block]). The
    16 levels span each block's own range, so weights that came from an asymmetric 4-bit format
    (GGUF Q4_0/Q4_1/Q4_K) are reproduced almost exactly, which a symmetric grid cannot do.
    """
    w = np.asarray(w, np.float32)
    out_dim, in_dim = w.shape
    if in_dim % block_size:
        raise ConfigError(f"input size {in_dim} is not a multiple of the int4 block size {block_size}.")
    blocks = w.reshape(out_dim, in_dim // block_size, block_size)
    lo, hi = blocks.min(axis=2), blocks.max(axis=2)
    scales16 = np.clip((hi - lo) / 15.0, 2.0 ** -14, 65504.0).astype(np.float16)  # XNNPACK: normal positive
    scales = scales16.astype(np.float32)
    levels = np.clip(np.rint((blocks - lo[..., None]) / scales[..., None]), 0, 15)
    offsets = (lo + 8.0 * scales).astype(np.float32)
    return (levels - 8).astype(np.int8).reshape(out_dim, in_dim), scales16, offsets

