"""Exports SmolLM2-135M-Instruct to LiteRT-LM bundles (.litertlm), fp32 and int8, for run_litertlm.py.

Run with the LiteRT-LM venv's interpreter (bash bench/peers/setup_litertlm.sh creates it):

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE bench/peers/.venv-litertlm/bin/python \\
        bench/peers/make_litertlm_models.py [--variants fp32 int8] [--force]

Source: the Hugging Face directory ~/.cache/litekv/peers/SmolLM2-135M-Instruct-hf (written by
export_hf.py). Exporter: litert-torch's Hugging Face exporter (`litert_torch.generative.export_hf.export`,
the `litert-torch export_hf` CLI), which loads the checkpoint with transformers, traces one prefill
signature per prefill length plus a decode signature over a static KV cache, converts them into one
multi-signature .tflite, quantizes it with an ai-edge-quantizer recipe, and bundles it with the HF
tokenizer.json, the chat template and the stop tokens into a .litertlm file (litert-lm-builder).

    fp32: quantization_recipe="none"
    int8: quantization_recipe="dynamic_wi8_afp32": dynamic-range quantization, int8 per-channel weights,
          fp32 activations quantized on the fly. This is the export_hf spelling of the recipe that
          litert-torch's older example converters call `dynamic_int8`
          (quant_recipes.full_dynamic_recipe: int8, CHANNELWISE, dynamic).

Signatures: prefill_64, prefill_256, prefill_1024 and decode over a 2048-entry KV cache (--cache-length),
so a 1024-token prompt is one prefill call and prompt + decode fits with room to spare. The 64-token
signature keeps the short prefills of run_litertlm.py's passage check cheap.

Two fixes to the exporter's LlmMetadata, applied by unpacking the bundle with litert-lm-builder, editing
the metadata proto and packing it again (tflite, tokenizer and executor metadata are copied unchanged):

  * start_token removed. The exporter sets start_token "<|im_start|>" (id 1) because SmolLM2's chat
    template begins with that token, and the runtime then prepends it to every prefill, on top of the
    template's own "<|im_start|>". SmolLM2 is used without a BOS (its HF tokenizer adds none; the other
    peers feed no BOS), and with the doubled token the fp32 model answers the question below with a
    French word list instead of "Paris". Without it, raw sessions prefill exactly the prompt's tokens.
  * stop_tokens reduced to the model's eos id(s) from generation_config.json (2, "<|im_end|>"). The
    exporter adds "<|im_end|>\\n" with 13 punctuation/space prefixes (".<|im_end|>\\n", ",<|im_end|>\\n",
    ...), a guard against SentencePiece merging a stop string into the preceding token; SmolLM2's BPE keeps
    <|im_end|> a single special token, so those never add anything, but the runtime's stop detector
    holds back the text of every "." "," " " etc. that could begin one, so a one-token response made of
    such a token came back empty (run_litertlm.py's passage check needs the token).
  * jinja_prompt_template replaced by the same SmolLM2 ChatML template written so that it also accepts a
    message whose content is a list of {"type": "text", "text": ...} parts: the runtime's template
    engine hands content over in that form, and the exported template (`'...' + message['content']`)
    fails with "tried to use + operator on unsupported types string and sequence".

Writes ~/.cache/litekv/peers/litertlm-fp32.litertlm and litertlm-int8.litertlm. Idempotent: an existing
bundle is not exported again (--force to redo) and is patched only if its metadata still needs it; each
bundle is then loaded with LiteRT-LM's CPU backend and must answer "What is the capital of France?"
(chat template, greedy); the answer is printed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

PEERS_CACHE = Path.home() / ".cache" / "litekv" / "peers"
DEFAULT_HF = PEERS_CACHE / "SmolLM2-135M-Instruct-hf"
RECIPES = {"fp32": "none", "int8": "dynamic_wi8_afp32"}
QUESTION = "What is the capital of France?"

# SmolLM2-Instruct's ChatML template (default system prompt included), accepting string or list content.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_START = time.perf_counter()


def log(message: str) -> None:
    """Progress line on stderr with the elapsed time since the script started."""
    print(f"[{time.perf_counter() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)


def bundle_path(out_dir: Path, variant: str) -> Path:
    return out_dir / f"litertlm-{variant}.litertlm"


def export_variant(hf_dir: Path, out_dir: Path, variant: str, prefill_lengths: list[int],
                   cache_length: int) -> Path:
    """Runs litert-torch's HF exporter for one variant and moves its model.litertlm into place."""
    from litert_torch.generative.export_hf import export as export_hf

    target = bundle_path(out_dir, variant)
    work = out_dir / f"litertlm-{variant}.build"   # exporter output_dir; removed on success
    if work.exists():
        shutil.rmtree(work)
    log(f"exporting {variant} (recipe {RECIPES[variant]}, prefill {prefill_lengths}, cache {cache_length}) "
        f"into {work}")
    start = time.perf_counter()
    export_hf.export(
        model=str(hf_dir),
        output_dir=str(work),
        task="text_generation",
        prefill_lengths=prefill_lengths,
        cache_length=cache_length,
        quantization_recipe=RECIPES[variant],
        bundle_litert_lm=True,
        keep_temporary_files=False,
    )
    produced = work / "model.litertlm"
    if not produced.exists():
        raise RuntimeError(f"the exporter wrote no {produced}")
    tmp = target.with_suffix(".litertlm.tmp")
    shutil.move(str(produced), tmp)
    tmp.replace(target)
    shutil.rmtree(work, ignore_errors=True)
    log(f"{variant}: wrote {target} ({target.stat().st_size / 2**20:.0f} MiB) in "
        f"{time.perf_counter() - start:.0f} s")
    return target


def eos_ids(hf_dir: Path) -> list[int]:
    """The checkpoint's end-of-sequence id(s), from generation_config.json (else config.json)."""
    for name in ("generation_config.json", "config.json"):
        path = hf_dir / name
        if path.exists():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    raise RuntimeError(f"no eos_token_id in {hf_dir}")


def patch_metadata(model: Path, stop_ids: list[int]) -> None:
    """Removes start_token, keeps only stop_ids as stop tokens and installs CHAT_TEMPLATE in the bundle's
    LlmMetadata; no-op if already so. Also deletes XNNPACK weight caches of earlier versions of the file."""
    import tempfile

    import litert_lm_builder
    from google.protobuf import text_format
    from litert_lm_builder.runtime.proto import llm_metadata_pb2

    with tempfile.TemporaryDirectory(dir=model.parent, prefix=model.stem + ".unpack.") as tmp:
        toml = Path(litert_lm_builder.unpack(str(model), tmp))
        meta_file = Path(tmp) / "LlmMetadataProto.pbtext"   # the name unpack gives the LlmMetadata section
        if not meta_file.exists():
            raise RuntimeError(f"no LlmMetadata section in {model}: {sorted(p.name for p in Path(tmp).iterdir())}")
        meta = text_format.Parse(meta_file.read_text(), llm_metadata_pb2.LlmMetadata())
        stops = [list(t.token_ids.ids) if t.HasField("token_ids") else t.token_str for t in meta.stop_tokens]
        if (not meta.HasField("start_token") and meta.jinja_prompt_template == CHAT_TEMPLATE
                and stops == [[i] for i in stop_ids]):
            log(f"{model.name}: metadata already patched")
            return
        meta.ClearField("start_token")
        del meta.stop_tokens[:]
        for token_id in stop_ids:
            meta.stop_tokens.add().token_ids.ids.append(token_id)
        meta.jinja_prompt_template = CHAT_TEMPLATE
        meta_file.write_text(text_format.MessageToString(meta))
        packed = Path(tmp) / "patched.litertlm"
        litert_lm_builder.pack(str(toml), str(packed))
        packed.replace(model)
    # The runtime keeps packed weights next to the model as NAME_<mtime>_<size>.xnnpack_cache; the ones of
    # the file just replaced are stale.
    for stale in model.parent.glob(model.name + "_*.xnnpack_cache"):
        stale.unlink()
    log(f"{model.name}: metadata patched (no start_token, stop tokens {stop_ids}, list-aware chat template)")


def verify(model: Path, threads: int) -> str:
    """Loads the bundle on the CPU backend and returns its greedy chat answer to QUESTION."""
    import litert_lm

    litert_lm.set_min_log_severity(litert_lm.LogSeverity.ERROR)
    start = time.perf_counter()
    engine = litert_lm.Engine(str(model), backend=litert_lm.Backend.CPU(thread_count=threads))
    try:
        # top_k=1: greedy (the sampler keeps the single most likely token).
        conversation = engine.create_conversation(sampler_config=litert_lm.SamplerConfig(top_k=1, seed=0))
        answer = str(conversation.send_message(QUESTION, max_output_tokens=48)).strip()
        conversation.close()
    finally:
        engine.close()
    log(f"{model.name}: answered in {time.perf_counter() - start:.1f} s (load included)")
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf", type=Path, default=DEFAULT_HF, help="Hugging Face model directory")
    parser.add_argument("--out-dir", type=Path, default=PEERS_CACHE)
    parser.add_argument("--variants", nargs="+", choices=sorted(RECIPES), default=["fp32", "int8"])
    parser.add_argument("--prefill-lengths", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--cache-length", type=int, default=2048,
                        help="KV cache entries (max context); 2048 like the other peers' contexts")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for the check")
    parser.add_argument("--force", action="store_true", help="export again even if the bundle exists")
    args = parser.parse_args()

    if not (args.hf / "config.json").exists():
        sys.exit(f"{args.hf} has no config.json: run `python bench/peers/export_hf.py` first")
    args.out_dir.mkdir(parents=True, exist_ok=True)

    stops = eos_ids(args.hf)
    failures = []
    for variant in args.variants:
        target = bundle_path(args.out_dir, variant)
        if target.exists() and not args.force:
            log(f"{variant}: {target} exists (--force to export again)")
        else:
            export_variant(args.hf, args.out_dir, variant, sorted(args.prefill_lengths), args.cache_length)
        patch_metadata(target, stops)
        answer = verify(target, args.threads)
        ok = "paris" in answer.lower()
        print(f"{variant}: {QUESTION!r} -> {answer!r} [{'ok' if ok else 'NO PARIS'}]", flush=True)
        if not ok:
            failures.append(variant)
    log("done")
    if failures:
        sys.exit(f"no 'Paris' in the answer of: {', '.join(failures)}")


if __name__ == "__main__":
    main()
