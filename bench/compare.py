"""litekv against its peers on SmolLM2-135M-Instruct: one command, every system, same machine.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/compare.py [--rounds 3] [--only SUBSTR,...]

Every system runs in a fresh process per round (so load time and peak RSS are its own), with its
runner in bench/peers/ measuring the same things on the same fixed token ids with 2 threads
(LiteRT-LM takes text only: its runner re-encodes the same pseudo-random text to exactly the same
lengths). Contexts: llama.cpp n_ctx 2048, onnxruntime-genai max_length 2048, LiteRT-LM a
2048-entry cache, transformers a dynamic cache, litekv max context 4096 in capacity buckets. The
rounds interleave the systems, rotating the order, and each figure is the median over rounds;
a litekv / peer ratio is computed within each round and its median reported, so slow drift of
the machine hits both sides of a ratio alike. The first round also records each system's
teacher-forced next-token argmax on bench/peers/passage.json, compared with litekv's numpy fp32
reference for the quality column. Peers that are not set up are listed with the command that
sets them up (see bench/peers/README.md).

Writes bench/results/compare.md, compare.json and compare_tok_s.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import RESULTS, SWEEP_CACHES, default_cache, markdown_table

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "bench" / "peers"
PEER_CACHE = Path.home() / ".cache" / "litekv" / "peers"
PASSAGE = PEERS / "passage.json"
MAIN_PYTHON = sys.executable


@dataclass
class System:
    name: str
    precision_class: str          # "fp32", "8-bit" or "4-bit"
    python: Path | str
    argv: list[str]
    litekv: bool = False
    requires: list[Path] = field(default_factory=list)
    setup: str = ""
    default: bool = False         # a litekv bundle with the converter's default KV cache for its weights

    @property
    def shown(self) -> str:
        """The name in tables and plots; the name alone keys the results, whatever the defaults."""
        return self.name + (" (default)" if self.default else "")

    def missing(self) -> list[Path]:
        return [p for p in [Path(self.python), *self.requires] if not p.exists()]


def systems() -> list[System]:
    out = []
    # Each backend with the step sweeps' two KV caches, LiteRT's first; the tables mark the
    # converter's default for the weights (LiteRT: int8 with int4 weights, else float16).
    for backend, kv in sorted(SWEEP_CACHES, key=lambda pair: pair[0] != "litert"):
        label = {"litert": "LiteRT", "onnx": "ONNX Runtime"}[backend]
        for quantize, cls in (("fp32", "fp32"), ("int8", "8-bit"), ("int4", "4-bit")):
            out.append(System(f"litekv {label} {quantize} + {kv} KV", cls, MAIN_PYTHON,
                              ["bench/peers/run_litekv.py", "--backend", backend, "--quantize", quantize, "--kv-cache", kv],
                              litekv=True, default=kv == default_cache(backend, quantize)))
    # The 4-bit peers' own LM-head class: onnxruntime-genai's head is 4-bit, litekv's int4 default
    # keeps the GGUF's 8-bit one. The quality column shows what each choice costs.
    out.append(System("litekv LiteRT int4 + int8 KV + int4 head", "4-bit", MAIN_PYTHON,
                      ["bench/peers/run_litekv.py", "--backend", "litert", "--quantize", "int4", "--kv-cache", "int8",
                       "--lm-head", "int4"], litekv=True))
    # The default bundles' decode linears in the runtime's own ops instead of litekv's kernels
    # (`--decode-linears graph`): XNNPACK's, and ONNX Runtime's MatMulNBits
    for backend, quantize, kv, cls, ops in (("litert", "int4", "int8", "4-bit", "XNNPACK"),
                                            ("litert", "int8", "int8", "8-bit", "XNNPACK"),
                                            ("onnx", "int4", "fp32", "4-bit", "MatMulNBits")):
        label = {"litert": "LiteRT", "onnx": "ONNX Runtime"}[backend]
        out.append(System(f"litekv {label} {quantize} + {kv} KV + {ops} linears", cls, MAIN_PYTHON,
                          ["bench/peers/run_litekv.py", "--backend", backend, "--quantize", quantize, "--kv-cache", kv,
                           "--decode-linears", "graph"], litekv=True))
    from litekv.catalog import checkpoint_path
    q41, f32 = Path(checkpoint_path()), PEER_CACHE / "SmolLM2-135M-Instruct.F32.gguf"
    llama_py = PEERS / ".venv" / "bin" / "python"
    out += [
        System("llama.cpp F32", "fp32", llama_py, ["bench/peers/run_llamacpp.py", "--model", str(f32)],
               requires=[f32], setup="bash bench/peers/setup.sh && bench/peers/.venv/bin/python bench/peers/make_models.py"),
        System("llama.cpp Q4_1", "4-bit", llama_py, ["bench/peers/run_llamacpp.py", "--model", str(q41)],
               setup="bash bench/peers/setup.sh"),
        System("transformers fp32", "fp32", MAIN_PYTHON, ["bench/peers/run_transformers.py"]),
    ]
    out += exported_peer("onnxruntime-genai", ".venv-ortgenai", "run_ortgenai.py", "setup_ortgenai.sh",
                         "make_ortgenai_models.py",
                         [(p, cls, PEER_CACHE / f"ortgenai-{p}") for p, cls in (("fp32", "fp32"), ("int4", "4-bit"))])
    out += exported_peer("LiteRT-LM", ".venv-litertlm", "run_litertlm.py", "setup_litertlm.sh",
                         "make_litertlm_models.py",
                         [(p, cls, PEER_CACHE / f"litertlm-{p}.litertlm") for p, cls in (("fp32", "fp32"), ("int8", "8-bit"))])
    return out


def exported_peer(label: str, venv: str, runner: str, setup: str, make: str,
                  variants: list[tuple[str, str, Path]]) -> list[System]:
    """A peer with its own venv and exported models: one System per (precision, class, model)."""
    python = PEERS / venv / "bin" / "python"
    return [System(f"{label} {precision}", cls, python, [f"bench/peers/{runner}", "--model", str(model)],
                   requires=[model], setup=f"bash bench/peers/{setup} && bench/peers/{venv}/bin/python bench/peers/{make}")
            for precision, cls, model in variants]


def run_process(system: System, extra: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(PEERS), str(ROOT / "bench"), env.get("PYTHONPATH", "")])
    return subprocess.run([str(system.python), *system.argv, *extra], cwd=ROOT, env=env, capture_output=True, text=True)


def prepare_bundles(chosen: list[System]) -> dict[str, str]:
    """Converts every litekv bundle the rounds need before any is measured: a conversion in a
    measured process put its ~1 GB peak into that system's peak RSS and its time beside the
    round's. Returns the systems whose conversion failed, with the error."""
    failed = {}
    for s in chosen:
        if s.litekv:
            proc = run_process(s, ["--convert-only"])
            if proc.returncode != 0:
                failed[s.name] = "\n".join(proc.stderr.strip().splitlines()[-15:])
                print(f"{s.name}: conversion failed:\n{failed[s.name]}", file=sys.stderr)
    return failed


def run_once(system: System, threads: int, with_passage: bool) -> dict:
    extra = ["--threads", str(threads), "--repeats", "1"] + (["--passage", str(PASSAGE)] if with_passage else [])
    proc = run_process(system, extra)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{system.name} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1])


def reference_argmax() -> np.ndarray:
    """litekv's numpy fp32 reference on the passage: the quality baseline for every system."""
    from litekv.catalog import checkpoint_path
    from litekv.converters.checkpoint import load_checkpoint
    from litekv.reference import ReferenceModel

    ckpt = load_checkpoint(checkpoint_path())
    ids = json.loads(PASSAGE.read_text())["token_ids"]
    model = ReferenceModel(ckpt.config, ckpt.weights)
    return model.forward(np.array(ids[:-1]), model.new_cache(256))[0].argmax(axis=-1)


FIELDS = ("decode_tok_s", "prefill_256_tok_s", "prefill_1024_tok_s", "ttft_ms", "load_s", "peak_rss_mb")


def median_field(runs: list[dict], key: str) -> float:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def paired_ratio(a: list[dict], b: list[dict], key: str) -> float:
    """Median over rounds of a[r] / b[r] (both ran in round r)."""
    ratios = [x[key] / y[key] for x, y in zip(a, b) if x.get(key) and y.get(key)]
    return statistics.median(ratios) if ratios else float("nan")


TARGETS = [  # (litekv class, peer, key, minimum ratio)
    ("fp32", "llama.cpp F32", "decode_tok_s", 1.1),
    ("8-bit", "LiteRT-LM int8", "decode_tok_s", 1.3),
    ("4-bit", "onnxruntime-genai int4", "decode_tok_s", 1.1),
    ("4-bit", "llama.cpp Q4_1", "decode_tok_s", 1.3),
]


def report(runs: dict[str, list[dict]], ran: list[System], skipped: list[System], quality: dict[str, float],
           threads: int, rounds: int) -> str:
    fmt = lambda v, spec: "–" if v != v else format(v, spec)  # noqa: E731  (nan -> dash)
    rows = []
    for s in ran:
        r = runs[s.name]
        rss_budget = ""
        if s.litekv:
            budget = r[0]["model_file_mb"] + r[0]["kv_mb"] + 150
            rss_budget = f"{fmt(median_field(r, 'peak_rss_mb'), '.0f')} / {budget:.0f}"
        rows.append([s.shown, s.precision_class, fmt(median_field(r, "decode_tok_s"), ".1f"),
                     fmt(median_field(r, "decode_step_tok_s"), ".1f"), fmt(median_field(r, "prefill_256_tok_s"), ".0f"),
                     fmt(median_field(r, "prefill_1024_tok_s"), ".0f"),
                     fmt(median_field(r, "ttft_ms"), ".0f"), fmt(median_field(r, "load_s"), ".2f"),
                     fmt(median_field(r, "peak_rss_mb"), ".0f"), rss_budget,
                     fmt(100 * quality.get(s.name, float("nan")), ".1f")])
    text = [f"# litekv vs peers: SmolLM2-135M-Instruct, {threads} threads, median of {rounds} interleaved rounds",
            "", time.strftime("%Y-%m-%d %H:%M"), "",
            markdown_table(["system", "class", "decode tok/s", "litekv steps, every logit, tok/s", "prefill@256 tok/s",
                            "prefill@1024 tok/s", "TTFT@256 ms", "load s", "peak RSS MB", "litekv RSS / budget MB",
                            "top-1 agreement %"], rows), "",
            "litekv's decode is its sessions' path (`sample_tokens`, sampled inside the model), whose fp32 "
            "bundles read an int8 screen of the LM head and only the fp32 rows that can rank among the "
            "sampler's 64 candidates; its steps that return every logit read the whole head, as the peers' "
            "loops do.", ""]

    peers = [s for s in ran if not s.litekv]
    ratio_rows = []
    for s in (s for s in ran if s.litekv):
        for p in (p for p in peers if p.precision_class == s.precision_class):
            ratio_rows.append([s.shown, p.name, *(fmt(paired_ratio(runs[s.name], runs[p.name], k), ".2f")
                                                 for k in ("decode_tok_s", "prefill_256_tok_s", "prefill_1024_tok_s"))])
    text += ["## litekv / peer, same precision class (median of per-round ratios)", "",
             markdown_table(["litekv", "peer", "decode", "prefill@256", "prefill@1024"], ratio_rows), ""]

    target_rows = []
    for cls, peer, key, minimum in TARGETS:
        if peer not in runs:
            target_rows.append([cls, peer, key, f">= {minimum}", "peer not run", ""])
            continue
        for s in (s for s in ran if s.litekv and s.precision_class == cls):
            ratio = paired_ratio(runs[s.name], runs[peer], key)
            target_rows.append([s.shown, peer, key, f">= {minimum}", fmt(ratio, ".3f"), "met" if ratio >= minimum else "not met"])
    for s in (s for s in ran if s.litekv):
        same = [p for p in peers if p.precision_class == s.precision_class]
        for key in ("prefill_256_tok_s", "prefill_1024_tok_s"):
            if not same:
                continue
            best = max(same, key=lambda p: median_field(runs[p.name], key))
            ratio = paired_ratio(runs[s.name], runs[best.name], key)
            target_rows.append([s.shown, f"best: {best.name}", key, ">= 1.0", fmt(ratio, ".3f"),
                                "met" if ratio >= 1.0 else "not met"])
    text += ["## Targets", "", markdown_table(["litekv", "peer", "figure", "target", "ratio", ""], target_rows), ""]
    if skipped:
        text += ["## Not run (not set up here)", ""]
        text += [f"- {s.name}: missing {', '.join(str(p) for p in s.missing())}; set up with `{s.setup}`" for s in skipped]
        text.append("")
    return "\n".join(text)


def plot(runs: dict[str, list[dict]], ran: list[System], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"fp32": "#4C72B0", "8-bit": "#DD8452", "4-bit": "#55A868"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 6), sharey=True)
    names = [s.name for s in ran][::-1]
    for ax, key, title in zip(axes, ("decode_tok_s", "prefill_256_tok_s", "prefill_1024_tok_s"),
                              ("decode (128 new tokens)", "prefill, 256 tokens", "prefill, 1024 tokens")):
        values = [median_field(runs[n], key) for n in names]
        bars = ax.barh([s.shown for s in ran][::-1], values, color=[colors[s.precision_class] for s in ran][::-1],
                       edgecolor=["black" if s.litekv else "none" for s in ran][::-1])
        ax.bar_label(bars, fmt="%.0f", padding=2, fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("tokens/s")
        ax.grid(True, axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="lower center", ncol=3, title="precision class (litekv outlined)")
    fig.suptitle("SmolLM2-135M-Instruct on 2 CPU threads: litekv and peers (median of interleaved rounds)")
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated substrings of system names to run")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite compare.md and the plot from the last compare.json, measuring nothing")
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads((RESULTS / "compare.json").read_text())
        runs = saved["runs"]
        ran = [s for s in systems() if s.name in runs]
        skipped = [s for s in systems() if s.name not in runs and s.missing()]
        write_results(runs, ran, skipped, saved["quality"], saved["threads"], saved["rounds"], {})
        return
    wanted = [w.strip().lower() for w in args.only.split(",") if w.strip()]
    chosen = [s for s in systems() if not wanted or any(w in s.name.lower() for w in wanted)]
    ran = [s for s in chosen if not s.missing()]
    skipped = [s for s in chosen if s.missing()]
    for s in skipped:
        print(f"skipping {s.name}: not set up ({s.setup})", file=sys.stderr)

    failed = prepare_bundles(ran)
    runs: dict[str, list[dict]] = {s.name: [] for s in ran}
    for r in range(args.rounds):
        order = ran[r % len(ran):] + ran[:r % len(ran)]  # rotate, so no system always runs first
        for s in order:
            if s.name in failed:
                continue
            start = time.perf_counter()
            try:
                runs[s.name].append(run_once(s, args.threads, with_passage=(r == 0)))
            except RuntimeError as e:
                failed[s.name] = str(e)
                print(e, file=sys.stderr)
                continue
            print(f"round {r + 1}/{args.rounds} {s.name}: decode {runs[s.name][-1]['decode_tok_s']:.1f} tok/s "
                  f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    ran = [s for s in ran if runs[s.name]]

    expected = reference_argmax()
    quality = {}
    for s in ran:
        got = runs[s.name][0].get("passage_argmax")
        if got is not None:
            quality[s.name] = float(np.mean(np.array(got) == expected))

    (RESULTS / "compare.json").parent.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compare.json").write_text(json.dumps({"threads": args.threads, "rounds": args.rounds, "runs": runs,
                                                      "quality": quality}, indent=1))
    write_results(runs, ran, skipped, quality, args.threads, args.rounds, failed)


def write_results(runs: dict[str, list[dict]], ran: list[System], skipped: list[System], quality: dict[str, float],
                  threads: int, rounds: int, failed: dict[str, str]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    text = report(runs, ran, skipped, quality, threads, rounds)
    if failed:
        text += "\n## Failed\n\n" + "\n".join(f"- {name}: {err.splitlines()[0]}" for name, err in failed.items()) + "\n"
    (RESULTS / "compare.md").write_text(text)
    plot(runs, ran, RESULTS / "compare_tok_s.png")
    print(text)
    print(f"wrote {RESULTS / 'compare.md'} and {RESULTS / 'compare_tok_s.png'}")


if __name__ == "__main__":
    main()
