"""onnxruntime-genai models of SmolLM2-135M-Instruct (fp32 and int4, CPU) from the Hugging Face export.

Run with the ortgenai venv's interpreter (bash bench/peers/setup_ortgenai.sh creates it) after
`python bench/peers/export_hf.py` has written the Hugging Face directory:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE bench/peers/.venv-ortgenai/bin/python bench/peers/make_ortgenai_models.py

For each precision this runs onnxruntime-genai's own model builder,

    python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32|int4 -e cpu -c TMP_CACHE

with no --extra_options, so int4 gets the builder's CPU defaults: every MatMul (lm_head included) becomes
MatMulNBits with 4-bit symmetric RTN weights, block_size 32, accuracy_level 4 (activations quantized to
int8 inside the matmul), and the token embedding becomes a 4-bit GatherBlockQuantized (block 32).
The builder reads rope_theta from config.json's `rope_parameters` itself (it folds that section into the
config), so the transformers-5 export is used as it is. Output goes to a temporary sibling directory and is
renamed into place; an existing model is kept unless --force. Afterwards every model is loaded with
onnxruntime-genai and answers "What is the capital of France?" (chat template, greedy, 32 new tokens).
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEERS = Path.home() / ".cache" / "litekv" / "peers"
DEFAULT_HF = PEERS / "SmolLM2-135M-Instruct-hf"
PRECISIONS = ("fp32", "int4")
QUESTION = "What is the capital of France?"


def out_dir(precision: str) -> Path:
    return PEERS / f"ortgenai-{precision}"


def is_built(out: Path) -> bool:
    return (out / "genai_config.json").is_file() and (out / "model.onnx").is_file()


def build(hf_dir: Path, precision: str, out: Path) -> None:
    """Runs the model builder into OUT.tmp, keeps its log there as builder.log, then renames to OUT."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="ortgenai-cache-") as cache, open(tmp / "builder.log", "w") as log:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp),
               "-p", precision, "-e", "cpu", "-c", cache]
        print("running", " ".join(cmd), flush=True)
        start = time.perf_counter()
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        sys.exit(f"model builder failed ({done.returncode}); see {tmp / 'builder.log'}")
    print(f"built {precision} in {time.perf_counter() - start:.1f} s", flush=True)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def describe(out: Path) -> str:
    """Op counts and the quantization attributes of the graph (weights are not loaded)."""
    import onnx

    graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
    counts: dict[str, int] = {}
    quant: set[str] = set()
    for node in graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
        if node.op_type in ("MatMulNBits", "GatherBlockQuantized"):
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute
                     if a.name in ("bits", "block_size", "accuracy_level")}
            quant.add(f"{node.op_type}{sorted(attrs.items())}")
    size_mb = sum(f.stat().st_size for f in out.iterdir() if f.name.startswith("model.onnx")) / 2**20
    main_ops = {op: n for op, n in counts.items() if op in ("MatMul", "MatMulNBits", "Gather", "GatherBlockQuantized",
                                                             "GroupQueryAttention")}
    return f"{size_mb:.0f} MB, ops {main_ops}" + (f", quantization {sorted(quant)}" if quant else "")


def answer(out: Path, max_new_tokens: int = 32) -> str:
    """Greedy answer to QUESTION with the model's chat template, through onnxruntime-genai."""
    import onnxruntime_genai as og

    model = og.Model(str(out))
    tokenizer = og.Tokenizer(model)
    prompt = tokenizer.apply_chat_template(json.dumps([{"role": "user", "content": QUESTION}]),
                                           add_generation_prompt=True)
    ids = tokenizer.encode(prompt)
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(ids) + max_new_tokens)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    new: list[int] = []
    while not generator.is_done():
        generator.generate_next_token()
        new.append(int(generator.get_next_tokens()[0]))
    return tokenizer.decode(new).strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", type=Path, default=DEFAULT_HF, help="Hugging Face directory (export_hf.py)")
    parser.add_argument("--precision", choices=PRECISIONS, nargs="+", default=list(PRECISIONS))
    parser.add_argument("--force", action="store_true", help="rebuild even if the output exists")
    args = parser.parse_args()

    if not (args.hf / "config.json").is_file():
        sys.exit(f"{args.hf} has no config.json; run `python bench/peers/export_hf.py` first")
    failed = []
    for precision in args.precision:
        out = out_dir(precision)
        if is_built(out) and not args.force:
            print(f"{precision}: {out} exists (--force to rebuild)")
        else:
            build(args.hf, precision, out)
        print(f"{precision}: {describe(out)}")
        reply = answer(out)
        print(f"{precision}: {QUESTION!r} -> {reply!r}", flush=True)
        if "paris" not in reply.lower():
            failed.append(precision)
    if "fp32" in failed:
        sys.exit("the fp32 model did not answer Paris")
    for precision in failed:
        print(f"warning: the {precision} model did not answer Paris (quantization can flip a 135M model's greedy path)")


if __name__ == "__main__":
    main()
