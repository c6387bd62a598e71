"""How far a decode step's growth with the context can go down on this machine: the bytes a step
reads, and the least time the cache's extra bytes can add at the machine's read rate.

For each SmolLM2 bundle of bench/step_vs_context.py (both backends, fp32 / int8 / int4 weights,
LiteRT float16 and int8 caches, ONNX float32 and int8) it counts, from the model file itself:
- the constant bytes the one-token decode graph reads: every weight, scale and offset its ops take,
  but one row of a gathered table (the token embedding);
- the cache bytes per live token: layers x 2 (K, V) x KV heads x head_dim x the cache element.

At 2,048 live tokens a step reads 1,984 tokens' rows more than at 64. Read at the machine's rate,
those bytes add at least `extra / rate` to the 64-token step, so no kernel can make the step ratio
2,048 / 64 smaller than `1 + extra / rate / step(64)`. The rate is the higher of what the C read
loop of bench/memory_bandwidth.py reaches now (2 threads, 540 MB) and what the sweep's fastest
64-token step read its constants at (the machine drifts by tens of percent within minutes). The
table sets that floor beside the ratio bench/step_vs_context.py measured (its
results/step_vs_context.json, when present) and the read rate the cache's bytes got in that sweep:
the extra bytes over the extra time.

A second floor adds what the platform costs every LiteRT attention call: its second core joins a
call only after a handoff (XNNPACK's worker spins on that core after its last task, and a wake-up
across cores takes about as long here; the fourth round of PERFORMANCE.md). Until then one core
reads alone at its own rate (the C loop on 1 thread). The handoff is measured here, from the kernel's
counters at 2,048 tokens in the default int4 bundle. ONNX Runtime's attention runs on its own
spinning pool, so its bundles get no handoff.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/step_bytes.py
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx

from common import (RESULTS, SWEEP_CACHES, default_mark, markdown_table, rewound_step_seconds, save, smollm2_bundle,
                    sweep_label)
from memory_bandwidth import read_rates
from litekv.bundle import read_manifest
from litekv.executor import open_executor

SHORT, LONG = 64, 2048
BUNDLES = [(backend, quantize, kv) for backend, kv in SWEEP_CACHES for quantize in ("fp32", "int8", "int4")]


def tflite_decode_constants(path: Path, signature: str) -> int:
    """Bytes of the constant tensors the ops of one signature's subgraph read; a GATHER from a
    constant table counts one row of it."""
    from ai_edge_litert import schema_py_generated as schema

    model = schema.Model.GetRootAs(path.read_bytes(), 0)
    index = next(model.SignatureDefs(i).SubgraphIndex() for i in range(model.SignatureDefsLength())
                 if model.SignatureDefs(i).SignatureKey().decode() == signature)
    graph = model.Subgraphs(index)
    gather = {c for c in range(model.OperatorCodesLength())
              if max(model.OperatorCodes(c).BuiltinCode(), model.OperatorCodes(c).DeprecatedBuiltinCode())
              == schema.BuiltinOperator.GATHER}
    counted: dict[int, int] = {}
    for o in range(graph.OperatorsLength()):
        op = graph.Operators(o)
        for position in range(op.InputsLength()):
            t = op.Inputs(position)
            if t < 0:
                continue
            tensor = graph.Tensors(t)
            buffer = model.Buffers(tensor.Buffer())
            size = buffer.Size() if buffer.Offset() > 1 else buffer.DataLength()
            if not size:
                continue  # an activation or an input
            if op.OpcodeIndex() in gather and position == 0:
                size //= int(tensor.Shape(0))
            counted[tensor.Buffer()] = max(counted.get(tensor.Buffer(), 0), size)
    return sum(counted.values())


def onnx_decode_constants(path: Path) -> int:
    """Bytes of the initializers the graph's nodes read; a Gather from an initializer counts one row."""
    model = onnx.load(str(path), load_external_data=False)
    sizes = {}
    for init in model.graph.initializer:
        external = {entry.key: entry.value for entry in init.external_data}
        nbytes = int(external["length"]) if "length" in external else len(init.raw_data) or \
            int(np.prod(init.dims)) * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
        sizes[init.name] = (nbytes, tuple(init.dims))
    counted: dict[str, int] = {}
    for node in model.graph.node:
        for position, name in enumerate(node.input):
            if name not in sizes:
                continue
            nbytes, dims = sizes[name]
            counted[name] = nbytes // dims[0] if node.op_type == "Gather" and position == 0 else nbytes
    return sum(counted.values())


def step_bytes(bundle: Path) -> dict:
    manifest = read_manifest(bundle)
    cfg = manifest.config
    if manifest.backend == "litert":
        decode = min((s for s in manifest.signatures if s.kind == "decode" and not s.lora), key=lambda s: s.capacity)
        constants = tflite_decode_constants(bundle / manifest.model_file, decode.name)
    else:
        constants = onnx_decode_constants(bundle / manifest.model_file)
    per_token = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * np.dtype(manifest.kv_dtype).itemsize
    return {"constants_mb": constants / 1e6, "kv_bytes_per_token": per_token, "kv_dtype": manifest.kv_dtype,
            "layers": cfg.num_layers}


def helper_start_us(steps: int = 30) -> float:
    """How late the kernel's helper thread joins an attention call, on average, in rewound steps of
    the int4 LiteRT bundle with an int8 cache at 2,048 live tokens."""
    ex = open_executor(smollm2_bundle("litert", "int4", kv_cache="int8"), threads=2)
    cache = ex.create_kv_cache()
    ex.prefill(np.arange(LONG - 1) % 40000 + 100, cache)
    before = ex.attention_stats()
    rewound_step_seconds(ex, cache, LONG - 1, steps)
    return (ex.attention_stats() - before).helper_start_microseconds


def least_read_us(nbytes: float, one_core_gb_s: float, two_cores_gb_s: float, handoff_us: float) -> float:
    """The least microseconds a call can take to read nbytes when the second core joins it
    handoff_us late: one core alone until then, both after."""
    alone = one_core_gb_s * 1e3 * handoff_us  # bytes one core reads before the second joins
    if nbytes <= alone:
        return nbytes / (one_core_gb_s * 1e3)
    return handoff_us + (nbytes - alone) / (two_cores_gb_s * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", type=Path, default=RESULTS / "step_vs_context.json",
                        help="bench/step_vs_context.py's results (the measured step times)")
    args = parser.parse_args()
    loop_rate = max(r["gb_s"] for r in read_rates(sizes_mib=(515,), prefetch=(0,), repeats=10))
    one_core_loop_rate = max(r["gb_s"] for r in read_rates(sizes_mib=(515,), prefetch=(0,), threads=1, repeats=10))
    handoff_us = helper_start_us()
    sweep = json.loads(args.sweep.read_text()) if args.sweep.exists() else {}
    counted = {sweep_label(backend, quantize, kv): step_bytes(smollm2_bundle(backend, quantize, kv_cache=kv))
               for backend, quantize, kv in BUNDLES}
    # The machine's rate drifts by tens of percent within minutes: a step of the sweep that read its
    # constants faster than the loop reads now shows the rate the sweep had at least.
    sweep_rate = max((found["constants_mb"] / sweep[label][str(SHORT)] for label, found in counted.items()
                      if label in sweep), default=0.0)
    rate = max(loop_rate, sweep_rate)
    one_core_rate = one_core_loop_rate * rate / loop_rate  # the same phase as `rate`
    rows, results = [], {}
    for label, found in counted.items():
        extra_mb = (LONG - SHORT) * found["kv_bytes_per_token"] / 1e6
        least_ms = extra_mb / rate
        # per layer and call, with the handoff: LiteRT's kernel only (ONNX Runtime's pool is already spinning)
        layer_bytes = {n: n * found["kv_bytes_per_token"] / found["layers"] for n in (SHORT, LONG)}
        handoff = handoff_us if label.startswith("litert") else 0.0
        with_handoff_ms = found["layers"] / 1e3 * (least_read_us(layer_bytes[LONG], one_core_rate, rate, handoff)
                                                    - least_read_us(layer_bytes[SHORT], one_core_rate, rate, handoff))
        found.update(extra_mb=extra_mb, least_added_ms=least_ms, least_added_with_handoff_ms=with_handoff_ms)
        measured = sweep.get(label)
        cells = ["", "", "", "", ""]
        if measured:
            short, long = measured[str(SHORT)], measured[str(LONG)]
            ratio = sweep.get("ratio_2048_64", {}).get(label, long / short)  # per-round ratios when recorded
            found.update(step_ms={SHORT: short, LONG: long}, floor_ratio=1 + least_ms / short,
                         floor_ratio_with_handoff=1 + with_handoff_ms / short,
                         measured_ratio=ratio, attention_gb_s=extra_mb / (long - short))
            cells = [f"{short:.2f} / {long:.2f}", f"{1 + least_ms / short:.2f}", f"{1 + with_handoff_ms / short:.2f}",
                     f"{ratio:.2f}", f"{extra_mb / (long - short):.1f}"]
        results[label] = found
        rows.append([default_mark(label), found["kv_dtype"], f"{found['constants_mb']:.0f}", f"{extra_mb:.1f}", f"{least_ms:.2f}",
                     f"{with_handoff_ms:.2f}", *cells])
    print(f"read rate: {loop_rate:.1f} GB/s by the C read loop now (2 threads, 540 MB, best of 10; {one_core_loop_rate:.1f} "
          f"on 1 thread), {sweep_rate:.1f} by the fastest {SHORT}-token step of the sweep; the floors use {rate:.1f} "
          f"and {one_core_rate:.1f} for one core. The second core joins a LiteRT attention call {handoff_us:.1f} µs late.")
    print(markdown_table(["bundle", "cache", "constants read per step, MB", f"cache bytes {SHORT} -> {LONG} tokens, MB",
                          "least added ms at that rate", "with the handoff", f"step ms at {SHORT} / {LONG} (sweep)",
                          "floor of the ratio", "with the handoff", "measured ratio",
                          "cache bytes' read rate in the sweep, GB/s"], rows))
    save("step_bytes", {"read_gb_s": rate, "loop_read_gb_s": loop_rate, "one_core_read_gb_s": one_core_rate,
                        "one_core_loop_read_gb_s": one_core_loop_rate, "sweep_read_gb_s": sweep_rate,
                        "handoff_us": handoff_us, "sweep": str(args.sweep), "bundles": results})


if __name__ == "__main__":
    main()
