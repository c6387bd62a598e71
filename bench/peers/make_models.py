"""Writes an F32 GGUF of SmolLM2-135M-Instruct from the Q4_1 GGUF that litekv ships.

Every tensor is dequantized with the `gguf` package (tensors that are already F32 are copied) and
written under the same name, in llama.cpp's own layout (nothing is un-permuted); every metadata
key is copied except `general.file_type`, which becomes ALL_F32. The result then loads in
llama-cpp-python and is checked to answer "What is the capital of France?" with Paris.

Run it with the peer venv's python (it has gguf, numpy and llama-cpp-python):

    bench/peers/.venv/bin/python bench/peers/make_models.py [--src Q4_1.gguf] [--out F32.gguf] [--force]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize

OUT_DIR = Path.home() / ".cache" / "litekv" / "peers"
DEFAULT_OUT = OUT_DIR / "SmolLM2-135M-Instruct.F32.gguf"
# Keys that GGUFWriter writes by itself (header counts, architecture) or that we change.
SKIP_KEYS = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}


def shipped_checkpoint() -> Path:
    """litekv's Q4_1 GGUF: imported directly if litekv is on this interpreter, else asked of the main python."""
    try:
        from litekv.catalog import checkpoint_path
        return Path(checkpoint_path())
    except ImportError:
        python = os.environ.get("LITEKV_PYTHON", "python3")
        out = subprocess.run([python, "-c", "from litekv.catalog import checkpoint_path; print(checkpoint_path())"],
                             check=True, capture_output=True, text=True)
        return Path(out.stdout.strip().splitlines()[-1])


def field_value(field):
    """A reader field's value in the form GGUFWriter.add_key_value takes."""
    main = field.types[0]
    if main == GGUFValueType.ARRAY:
        return field.contents(), main, field.types[-1]
    return field.contents(), main, None


def write_f32(src: Path, out: Path) -> None:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    tmp = out.with_suffix(".tmp")
    writer = GGUFWriter(tmp, arch=arch)
    for key, field in reader.fields.items():
        if key in SKIP_KEYS:
            continue
        value, vtype, sub_type = field_value(field)
        writer.add_key_value(key, value, vtype, sub_type)
    writer.add_file_type(LlamaFileType.ALL_F32)

    total = 0
    for tensor in reader.tensors:
        if tensor.tensor_type == GGMLQuantizationType.F32:
            data = np.array(tensor.data, dtype=np.float32)
        else:
            data = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        # GGUF lists dims fastest-first; numpy's shape is the reverse.
        expected = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        data = data.reshape(expected)
        writer.add_tensor(tensor.name, data, raw_dtype=GGMLQuantizationType.F32)
        total += data.size
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    print(f"wrote {out}: {len(reader.tensors)} tensors, {total / 1e6:.1f} M params, "
          f"{out.stat().st_size / 1e6:.0f} MB", file=sys.stderr)


def check(path: Path, require_paris: bool = True) -> str:
    """Loads the file in llama-cpp-python and asks it a question whose answer is known."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False)
    reply = llm.create_chat_completion(messages=[{"role": "user", "content": "What is the capital of France?"}],
                                       max_tokens=32, temperature=0.0)
    text = reply["choices"][0]["message"]["content"]
    print(f"{path.name}: {text!r}", file=sys.stderr)
    if require_paris and "paris" not in text.lower():
        raise SystemExit(f"{path.name} did not answer Paris: {text!r}")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=None, help="Q4_1 GGUF (default: the one litekv ships)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--force", action="store_true", help="rewrite the F32 file even if it exists")
    parser.add_argument("--no-check", action="store_true", help="skip the llama-cpp-python check")
    args = parser.parse_args()
    src = args.src or shipped_checkpoint()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.force or not args.out.exists():
        start = time.perf_counter()
        write_f32(src, args.out)
        print(f"converted in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    else:
        print(f"{args.out} exists (use --force to rewrite)", file=sys.stderr)
    if not args.no_check:
        # The Q4_1 answer is shown for comparison only: llama.cpp's Q4_1 matmuls quantize activations to
        # Q8_1, and on this 135M model that is enough to change the greedy answer (perplexity stays within 1%).
        check(src, require_paris=False)
        check(args.out)
    print(f"Q4_1: {src}")
    print(f"F32:  {args.out}")


if __name__ == "__main__":
    main()
