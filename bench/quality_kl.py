"""Teacher-forced quality of litekv bundles against the fp32 bundle: top-1 agreement and mean KL.

Top-1 agreement on one 200-token passage (the comparison's quality column) moves by several
points from rounding alone: with int8 activations, a change in the last bit of one sum flips
codes in the next layer. This script scores three passages (bench/peers/passage.json and
bench/quality_passages.json, 200 tokens each) and adds the mean KL divergence of each token's
next-token distribution from the fp32 bundle's, which moves smoothly with the error.

    python bench/quality_kl.py litert:int4:int8 litert:int4:int8:int4 onnx:int8 [PATH ...]

A spec is backend:weights[:kv cache[:LM head]]; anything else is taken as a bundle path.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from common import markdown_table, save, smollm2_bundle
from litekv.executor import open_executor
from litekv.tokenizer import Tokenizer

HERE = Path(__file__).parent
TOKENS = 200


def passages(tokenizer: Tokenizer) -> list[list[int]]:
    texts = [json.loads((HERE / "peers" / "passage.json").read_text())["text"]]
    texts += json.loads((HERE / "quality_passages.json").read_text())["texts"]
    return [tokenizer.encode(t)[:TOKENS] for t in texts]


def bundle_for(spec: str) -> Path:
    parts = spec.split(":")
    if len(parts) < 2 or parts[0] not in ("litert", "onnx"):
        return Path(spec)
    kv_cache = parts[2] if len(parts) > 2 else None  # the converter's default
    return smollm2_bundle(parts[0], parts[1], kv_cache=kv_cache, lm_head=parts[3] if len(parts) > 3 else None)


def teacher_forced_logits(bundle: Path, token_lists: list[list[int]]) -> list[np.ndarray]:
    """[tokens - 1, vocab] per passage: each position's logits after the true tokens before it."""
    executor = open_executor(bundle, threads=2)
    out = []
    for ids in token_lists:
        cache = executor.create_kv_cache()
        out.append(np.stack([np.asarray(executor.step([t], cache), np.float32).reshape(-1) for t in ids[:-1]]))
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+", help="backend:weights[:kv cache[:LM head]] or a bundle path")
    args = parser.parse_args()
    reference_bundle = smollm2_bundle("litert", "fp32")
    token_lists = passages(Tokenizer.load(reference_bundle))
    reference = [log_softmax(r) for r in teacher_forced_logits(reference_bundle, token_lists)]
    rows, result = [], {}
    for spec in args.bundles:
        got = [log_softmax(g) for g in teacher_forced_logits(bundle_for(spec), token_lists)]
        agreement = [float(np.mean(r.argmax(1) == g.argmax(1))) for r, g in zip(reference, got)]
        kl = [float(np.mean(np.sum(np.exp(r) * (r - g), axis=1))) for r, g in zip(reference, got)]
        result[spec] = dict(agreement=agreement, kl=kl)
        rows.append([spec, " / ".join(f"{100 * a:.1f}" for a in agreement), f"{100 * np.mean(agreement):.1f}",
                     " / ".join(f"{k:.4f}" for k in kl), f"{np.mean(kl):.4f}"])
    print(markdown_table(["bundle", "top-1 agreement per passage, %", "mean", "KL per passage, nats", "mean KL"],
                         rows))
    save("quality_kl", result)


if __name__ == "__main__":
    main()
