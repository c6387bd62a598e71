"""Writes a Hugging Face directory (config.json, fp32 safetensors, tokenizer) of SmolLM2-135M-Instruct
from the Q4_1 GGUF that litekv ships, for peers whose tool chains start from a Hugging Face
checkpoint (onnxruntime-genai's model builder, litert-torch).

transformers dequantizes the GGUF (`gguf_file=`), un-permutes q/k itself and saves in its own
layout, so the export is independent of litekv's checkpoint loader. Runs under the main python
(torch and transformers are test-only dependencies there):

    python bench/peers/export_hf.py [--out DIR] [--force]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path.home() / ".cache" / "litekv" / "peers" / "SmolLM2-135M-Instruct-hf"


def export(out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from litekv.catalog import checkpoint_path

    gguf = Path(checkpoint_path())
    tmp = out.with_name(out.name + ".tmp")
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # A GGUF-loaded model refuses save_pretrained; its weights are plain fp32 tensors by now, so
    # copy them into a fresh model built from the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        import shutil
        shutil.rmtree(out)
    tmp.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args()
    if args.out.exists() and not args.force:
        print(f"{args.out} exists (use --force to rewrite)", file=sys.stderr)
    else:
        start = time.perf_counter()
        export(args.out)
        print(f"exported in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    print(args.out)


if __name__ == "__main__":
    main()
