"""How many of a decode step's softmax numerators round to 0 in litekv's integer value pass.

The AVX2 and VNNI int8 paths round each numerator to 15 bits, e^(score - top) x 32,767, so a slot more
than ln(65,534) = 11.09 below its head's top score adds nothing to the weighted values. This runs
SmolLM2 in transformers (the GGUF dequantized to float32, eager attention, an independent reference)
on a few 2,048-token inputs and counts, for the last query row of every layer:
- the (slot, head) numerators that are 0;
- the pairs of slots that are 0 for a head (one vpmaddwd takes a pair of slots for one head);
- the pairs that are 0 for all the query heads of a KV head (one weigh_pair3 takes those).

    python bench/zero_numerators.py [--tokens 2048]

Writes bench/results/zero_numerators.json. The prose input is this repository's PERFORMANCE.md, so its
figures move a little as that file does.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from common import markdown_table, save
from litekv.catalog import checkpoint_path

ROOT = Path(__file__).resolve().parent.parent
INPUTS = {"prose (bench/PERFORMANCE.md)": ROOT / "bench" / "PERFORMANCE.md",
          "code (converters/emit_tflite.py)": ROOT / "converters" / "emit_tflite.py",
          "the benchmark's tokens (100, 101, ...)": None}


def zero_shares(probabilities: np.ndarray, kv_heads: int) -> tuple[float, float, float]:
    """probabilities [H, T] of one query row -> the shares of zero numerators, zero pairs for a head
    and zero pairs for every head of a KV head."""
    heads, slots = probabilities.shape
    zero = probabilities / probabilities.max(axis=1, keepdims=True) * 32767 < 0.5
    pairs = zero[:, : slots // 2 * 2].reshape(heads, slots // 2, 2).all(axis=2)
    group_pairs = pairs.reshape(kv_heads, heads // kv_heads, -1).all(axis=1)
    return float(zero.mean()), float(pairs.mean()), float(group_pairs.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = checkpoint_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager")
    kv_heads = model.config.num_key_value_heads
    rows, results = [], []
    for name, path in INPUTS.items():
        if path is None:
            ids = (torch.arange(args.tokens) % 40000 + 100)[None]
        else:
            ids = tokenizer(path.read_text(), return_tensors="pt").input_ids[:, : args.tokens]
        with torch.no_grad():
            attentions = model(ids, output_attentions=True).attentions
        shares = np.array([zero_shares(layer[0, :, -1, :].numpy(), kv_heads) for layer in attentions])
        means, by_layer = shares.mean(axis=0), shares[:, 2]
        results.append({"input": name, "tokens": int(ids.shape[1]), "numerators_zero": float(means[0]),
                        "pairs_zero_for_a_head": float(means[1]), "pairs_zero_for_a_kv_head": float(means[2]),
                        "by_layer": by_layer.tolist()})
        rows.append([name, ids.shape[1], *(f"{100 * m:.1f} %" for m in means),
                     f"{100 * by_layer.min():.0f}–{100 * by_layer.max():.0f} %"])
    print(markdown_table(["input", "tokens", "numerators 0", "pairs 0 for a head", "pairs 0 for a KV head's heads",
                          "the last, by layer"], rows))
    print(f"wrote {save('zero_numerators', {'inputs': results})}")


if __name__ == "__main__":
    main()
