"""The targets measured in pairs: a litekv bundle and a peer, both loaded, take turns seconds apart.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/pairs.py [--turns 7] [--only SUBSTR,...]

compare.py runs each system in a fresh process per round, one after another, so a litekv bundle
and its peer are measured minutes apart, and this machine's read rate moves by up to 1.8x within
an hour (bench/PERFORMANCE.md): a round's ratio then carries the drift between the two runs. Here
every runner of a pair is started once in serve mode (bench/peers/peer_common.serve) and they
alternate one measure at a time, in the order A B, B A, A B, ... (so neither always runs first);
each turn gives one ratio from runs a few seconds apart, and the median over turns is reported
with its spread. A runner waiting for its turn sits on a read of stdin; the CPU time every other
runner used during each measurement is recorded, to show that it was none.

Pairs: each default litekv bundle (LiteRT and ONNX Runtime; fp32, int8, int4) with every peer of
its precision class, on the measures the issue sets targets on: decode tok/s (against the peers
named in compare.TARGETS) and prefill tok/s at 256 and 1,024 tokens (against each peer of the
class; the target is the best of them, the one litekv's ratio is lowest against). Writes
bench/results/pairs.md and pairs.json; `--report-only` rewrites pairs.md from pairs.json.

litekv's decode is its sessions' path, `sample_tokens` (sampled inside the model). Its fp32
bundles screen the LM head there (converters' head_screen), so the fp32 pairs also measure
"decode_step": litekv's `step`, which returns every logit, against the peer's decode. Such a step
reads every weight once, the same bytes in every system, so its speed is bounded by the machine's
read rate. After each of its turns, the C read loop of bench/memory_bandwidth.py measures that rate
over an array the weights' size, and the report gives both systems' weight bytes per second as a
share of it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from common import RESULTS, markdown_table
from compare import ROOT, TARGETS, System, systems
from litekv.catalog import checkpoint_path
from memory_bandwidth import build as build_read_loop, read_rate

MEASURES = ("decode", "prefill_256", "prefill_1024")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class Runner:
    """One system's runner in serve mode: loaded once, measured on request."""

    def __init__(self, system: System, threads: int, log_dir: Path):
        env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "bench" / "peers"), str(ROOT / "bench"),
                                             env.get("PYTHONPATH", "")])
        self.system = system
        self.log = log_dir / (system.name.replace(" ", "_").replace("/", "_") + ".log")
        argv = [str(system.python), *system.argv, "--threads", str(threads), "--repeats", "1", "--serve"]
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log.open("w"), text=True, bufsize=1)
        self._reply()  # {"ready": [...]} once the model is loaded and warmed up

    def _reply(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                tail = "\n".join(self.log.read_text().strip().splitlines()[-15:])
                raise RuntimeError(f"{self.system.name} stopped (exit {self.proc.wait()}):\n{tail}")
            if line.startswith("{"):
                return json.loads(line)

    def measure(self, name: str) -> float:
        self.proc.stdin.write(name + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise RuntimeError(f"{self.system.name}: {reply['error']}")
        return reply["tok_s"]

    def cpu_seconds(self) -> float:
        """User and system CPU time of the whole process (every thread) so far."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Fp32Yardstick:
    """What an fp32 decode step reads, and how fast this machine reads that much: the weights' bytes
    (every tensor of the checkpoint once, in float32; a tied embedding is read whole as the LM head,
    its lookup only one row) and the best of a few passes of bench/memory_bandwidth.c's loop over
    an array as large (more than the L3 holds), measured on request."""

    def __init__(self, directory: Path, threads: int, repeats: int = 5):
        import gguf  # the converter's dependency, installed with litekv[bench]

        self.weight_bytes = 4 * sum(int(t.n_elements) for t in gguf.GGUFReader(checkpoint_path()).tensors)
        self.binary, self.threads, self.repeats = build_read_loop(directory), threads, repeats

    def machine_gb_s(self) -> float:
        mib = -(-self.weight_bytes // 2**20)
        return read_rate(self.binary, mib, self.repeats, threads=self.threads)["gb_s"]


@dataclass
class Pair:
    litekv: System
    peer: System
    measures: tuple[str, ...]


def pairs(chosen: list[System]) -> list[Pair]:
    """Each default litekv bundle with each peer of its class: decode where compare.TARGETS names
    the peer, prefill with every peer of the class (the target is the best one)."""
    decode_peers = {(cls, peer) for cls, peer, key, _ in TARGETS if key == "decode_tok_s"}
    peers = [s for s in chosen if not s.litekv]
    out = []
    for s in (s for s in chosen if s.litekv and s.default):
        for p in (p for p in peers if p.precision_class == s.precision_class):
            decode = ("decode",) if (s.precision_class, p.name) in decode_peers else ()
            if decode and s.precision_class == "fp32":  # where a screened head makes the two paths differ
                decode = ("decode", "decode_step")
            out.append(Pair(s, p, (*decode, "prefill_256", "prefill_1024")))
    return out


def run_pair(pair: Pair, runners: dict[str, Runner], turns: int, yardstick: Fp32Yardstick | None = None) -> dict:
    """Alternates the two runners `turns` times over every measure of the pair; ratios per turn.
    With a yardstick, each turn of an fp32 pair's decode also measures the machine's read rate."""
    a, b = runners[pair.litekv.name], runners[pair.peer.name]
    result = {}
    for measure in pair.measures:
        rows = []
        for turn in range(turns):
            order = (a, b) if turn % 2 == 0 else (b, a)
            got, idle_cpu = {}, 0.0
            for runner in order:
                others = [r for r in runners.values() if r is not runner]
                before = sum(r.cpu_seconds() for r in others)
                # "decode_step": litekv's steps that return every logit, against the peer's decode
                got[runner] = runner.measure("decode" if measure == "decode_step" and runner is b else measure)
                idle_cpu = max(idle_cpu, sum(r.cpu_seconds() for r in others) - before)
            rows.append({"litekv": got[a], "peer": got[b], "ratio": got[a] / got[b], "idle_cpu_s": idle_cpu})
            # the read-rate yardstick where both systems read every weight: litekv's steps
            if yardstick is not None and measure == "decode_step" and pair.litekv.precision_class == "fp32":
                rows[-1]["machine_gb_s"] = yardstick.machine_gb_s()
        ratios = [r["ratio"] for r in rows]
        result[measure] = {"when": time.strftime("%Y-%m-%d %H:%M"), "turns": rows,
                           "ratio": statistics.median(ratios), "low": min(ratios),
                           "high": max(ratios), "litekv_tok_s": statistics.median(r["litekv"] for r in rows),
                           "peer_tok_s": statistics.median(r["peer"] for r in rows),
                           "idle_cpu_s": max(r["idle_cpu_s"] for r in rows)}
        if "machine_gb_s" in rows[0]:
            result[measure]["weight_bytes"] = yardstick.weight_bytes
        print(f"{pair.litekv.name} / {pair.peer.name} {measure}: {result[measure]['ratio']:.3f} "
              f"({result[measure]['low']:.3f}-{result[measure]['high']:.3f})", file=sys.stderr, flush=True)
    return result


def targets(results: dict[str, dict[str, dict]], chosen: list[System]) -> list[list]:
    """One row per target: decode against each named peer, prefill against the best peer of the class."""
    minimum = {(cls, peer): m for cls, peer, key, m in TARGETS if key == "decode_tok_s"}
    rows = []
    for s in (s for s in chosen if s.litekv and s.default):
        mine = {peer: r for key, r in results.items() if key.startswith(s.name + " / ")
                for peer in [key.split(" / ", 1)[1]]}
        for peer, r in mine.items():
            for measure, shown in (("decode", "decode"), ("decode_step", "decode, every logit (steps)")):
                if measure in r:
                    m = minimum[(s.precision_class, peer)]
                    d = r[measure]
                    rows.append([s.shown, peer, shown, f">= {m}", f"{d['ratio']:.3f}",
                                 f"{d['low']:.2f}-{d['high']:.2f}", "met" if d["ratio"] >= m else "not met"])
        for measure in ("prefill_256", "prefill_1024"):
            measured = {peer: r[measure] for peer, r in mine.items() if measure in r}
            if not measured:
                continue
            # the best peer is the one litekv leads least: pairs measured minutes apart cannot rank
            # the peers by their own tok/s, but each ratio holds within its pair
            best = min(measured, key=lambda peer: measured[peer]["ratio"])
            d = measured[best]
            rows.append([s.shown, f"best: {best}", measure, ">= 1.0", f"{d['ratio']:.3f}",
                         f"{d['low']:.2f}-{d['high']:.2f}", "met" if d["ratio"] >= 1.0 else "not met"])
    return rows


def read_rate_rows(results: dict[str, dict[str, dict]]) -> list[list]:
    """Per fp32 decode pair, medians over its turns: each system's weight bytes per second and their
    share of the machine's read rate measured after the turn, and the ceiling, the ratio litekv would
    reach reading every weight at that rate."""
    rows = []
    for key, pair in results.items():
        d = pair.get("decode_step", {})
        if "weight_bytes" not in d:
            continue
        gb, turns = d["weight_bytes"] / 1e9, d["turns"]
        machine = [t["machine_gb_s"] for t in turns]

        def rate(side: str) -> str:
            return (f"{statistics.median(t[side] * gb for t in turns):.1f} "
                    f"({statistics.median(t[side] * gb / m for t, m in zip(turns, machine)):.0%})")

        ceiling = statistics.median(m / (t["peer"] * gb) for t, m in zip(turns, machine))
        rows.append([key, f"{d['weight_bytes'] / 1e6:.0f}", f"{statistics.median(machine):.1f}",
                     rate("litekv"), rate("peer"), f"{ceiling:.2f}", f"{d['ratio']:.3f}"])
    return rows


def read_rate_section(results: dict[str, dict[str, dict]]) -> list[str]:
    rows = read_rate_rows(results)
    if not rows:
        return []
    return ["## fp32 decode against the machine's read rate", "",
            "An fp32 step that returns every logit (litekv's `step`, llama.cpp's decode) reads every weight "
            "once, so a system's weight bytes per second are its tok/s times "
            "the weights' bytes (the KV cache's few MB a step left out). The machine's rate is "
            "bench/memory_bandwidth.c's read loop over an array as large, best of 5 passes, measured after "
            "each turn. The ceiling is the ratio litekv would reach reading every weight at that rate: "
            "a target above it cannot be met in that turn.", "",
            markdown_table(["pair", "weight MB per token", "machine GB/s", "litekv GB/s (share)",
                            "peer GB/s (share)", "ceiling", "median ratio"], rows), ""]


def report(results: dict[str, dict[str, dict]], chosen: list[System], turns: int, threads: int) -> str:
    rows = [[key, measure, f"{r['litekv_tok_s']:.1f}", f"{r['peer_tok_s']:.1f}", f"{r['ratio']:.3f}",
             f"{r['low']:.3f}-{r['high']:.3f}", f"{r['idle_cpu_s']:.2f}", r.get("when", "")]
            for key, pair in results.items() for measure, r in pair.items()]
    return "\n".join([
        f"# litekv / peer in pairs: SmolLM2-135M-Instruct, {threads} threads, median of {turns} alternating turns",
        "", time.strftime("%Y-%m-%d %H:%M"), "",
        "Both runners stay loaded and take turns (A B, B A, ...); each turn's ratio comes from two runs "
        "seconds apart. The last column is the most CPU time all the waiting runners used together during "
        "one measurement.", "",
        "## Targets", "",
        markdown_table(["litekv", "peer", "figure", "target", "median ratio", "turns' range", ""],
                       targets(results, chosen)), "",
        *read_rate_section(results),
        "## Every pair", "",
        markdown_table(["pair", "measure", "litekv tok/s", "peer tok/s", "median ratio", "range",
                        "waiting runners' CPU s", "measured"], rows), ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="", help="comma-separated substrings: keep pairs either of whose "
                                                   "systems' names contains one; the other pairs' last results "
                                                   "stay in pairs.json and pairs.md")
    parser.add_argument("--report-only", action="store_true", help="rewrite pairs.md from the last pairs.json")
    args = parser.parse_args()
    if args.report_only:
        saved = json.loads((RESULTS / "pairs.json").read_text())
        names = {name for key in saved["results"] for name in key.split(" / ")}
        text = report(saved["results"], [s for s in systems() if s.name in names], saved["turns"], saved["threads"])
        (RESULTS / "pairs.md").write_text(text)
        print(text)
        return
    available = [s for s in systems() if not s.missing()]
    for s in systems():
        if s.missing():
            print(f"skipping {s.name}: not set up ({s.setup})", file=sys.stderr)
    wanted = [w.strip().lower() for w in args.only.split(",") if w.strip()]
    chosen_pairs = [p for p in pairs(available)
                    if not wanted or any(w in p.litekv.name.lower() or w in p.peer.name.lower() for w in wanted)]
    log_dir = RESULTS / "pairs-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    runners: dict[str, Runner] = {}
    results: dict[str, dict[str, dict]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            yardstick = Fp32Yardstick(Path(tmp), args.threads) if any(
                p.litekv.precision_class == "fp32" and "decode" in p.measures for p in chosen_pairs) else None
            for pair in chosen_pairs:
                for s in (pair.litekv, pair.peer):
                    if s.name not in runners:
                        print(f"loading {s.name}", file=sys.stderr, flush=True)
                        runners[s.name] = Runner(s, args.threads, log_dir)
                results[f"{pair.litekv.name} / {pair.peer.name}"] = run_pair(pair, runners, args.turns, yardstick)
    finally:
        for runner in runners.values():
            runner.close()
    if wanted and (RESULTS / "pairs.json").exists():  # a partial run: the other pairs keep their last results
        results = {**json.loads((RESULTS / "pairs.json").read_text())["results"], **results}
    names = {name for key in results for name in key.split(" / ")}
    chosen = [s for s in available if s.name in names]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pairs.json").write_text(json.dumps({"threads": args.threads, "turns": args.turns,
                                                    "results": results}, indent=1))
    text = report(results, chosen, args.turns, args.threads)
    (RESULTS / "pairs.md").write_text(text)
    print(text)
    print(f"wrote {RESULTS / 'pairs.md'}")


if __name__ == "__main__":
    main()
