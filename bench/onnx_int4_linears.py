"""What the exact int4 block offsets cost on ONNX Runtime, against the forms that drop or round them.

A graph holding only SmolLM2's decode-time int4 linears (30 layers of fused q/k/v, o, fused
gate/up and down; random weights quantized like the converter's int4, block 32) is timed for one
token on the CPU EP, in four forms:
- symmetric: MatMulNBits alone (the offsets dropped; onnxruntime-genai's builder default);
- exact offsets as litekv emits them: MatMulNBits + block sums (MatMul) + offsets (MatMul) + Add;
- exact offsets as float zero points of MatMulNBits (one op, but ORT's slow path);
- offsets rounded to 4-bit zero points (one op on the fast path, but no longer exact);
- three other forms of the exact correction: block sums by Reshape + ReduceSum instead of the 0/1
  membership matmul (no constant to read); the same with the offsets as int8 codes
  (DynamicQuantizeMatMul, a quarter of the bytes); and the same with the correction passed as
  MatMulNBits' bias, which saves the Add but takes one row, so only a decode step could use it.
Each form also reports its error against the exact weights, so speed and fidelity sit side by side.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/onnx_int4_linears.py
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from common import markdown_table, median_time, save
from litekv.converters.quantize import int4_blockwise_asymmetric

HIDDEN, QKV, FFN, LAYERS, BLOCK = 576, 960, 1536, 30, 32
FORMS = ("symmetric (offsets dropped)", "exact offsets: MatMulNBits + MatMul + MatMul + Add",
         "exact offsets as float zero points", "offsets rounded to 4-bit zero points",
         "exact offsets, block sums by ReduceSum", "exact offsets, ReduceSum, int8 offsets",
         "exact offsets, ReduceSum, correction as MatMulNBits bias")
REDUCE_SUM_FORMS = FORMS[4:]


class LinearsGraph:
    """Builds the chain of linears in one form; keeps the exact dequantized weights for checking."""

    def __init__(self, form: str, rng: np.random.Generator):
        self.form, self.rng = form, rng
        self.nodes, self.inits, self.exact = [], [], []
        self._n = 0

    def _name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}{self._n}"

    def _init(self, array: np.ndarray, hint: str) -> str:
        name = self._name(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def _node(self, op: str, inputs: list[str], domain: str = "", **attrs) -> str:
        out = self._name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], domain=domain or None, **attrs))
        return out

    def linear(self, x: str, in_dim: int, out_dim: int) -> str:
        w = (self.rng.standard_normal((out_dim, in_dim)) * 0.02).astype(np.float32)
        q, scales16, offsets = int4_blockwise_asymmetric(w, BLOCK)
        scales = scales16.astype(np.float32)
        blocks = in_dim // BLOCK
        self.exact.append((q.reshape(out_dim, blocks, BLOCK) * scales[..., None] + offsets[..., None])
                          .reshape(out_dim, in_dim))
        codes = (q.astype(np.int16) + 8).astype(np.uint8).reshape(out_dim, blocks, BLOCK)
        inputs = [x, self._init(codes[..., 0::2] | (codes[..., 1::2] << 4), "w"), self._init(scales, "s")]
        # (q - zp) * s + offset == (q - (zp - offset / s)) * s: the offset is a fractional zero point
        float_zp = 8.0 - offsets / scales
        if self.form == FORMS[2]:
            inputs.append(self._init(float_zp.astype(np.float32), "zp"))
        elif self.form == FORMS[3]:
            rounded = np.clip(np.rint(float_zp), 0, 15).astype(np.uint8)
            padded = np.zeros((out_dim, blocks + blocks % 2), np.uint8)
            padded[:, :blocks] = rounded
            inputs.append(self._init(padded[:, 0::2] | (padded[:, 1::2] << 4), "zp"))
        attrs = dict(K=in_dim, N=out_dim, bits=4, block_size=BLOCK, accuracy_level=4)
        if self.form not in (FORMS[1], *REDUCE_SUM_FORMS):
            return self._node("MatMulNBits", inputs, "com.microsoft", **attrs)
        if self.form == FORMS[1]:
            membership = np.kron(np.eye(blocks, dtype=np.float32), np.ones((1, BLOCK), np.float32))
            sums = self._node("MatMul", [x, self._init(membership.T, "m")])
        else:
            grouped = self._node("Reshape", [x, self._init(np.array([1, blocks, BLOCK], np.int64), "shape")])
            sums = self._node("ReduceSum", [grouped, self._init(np.array([-1], np.int64), "axes")], keepdims=0)
        if self.form == FORMS[5]:  # int8 codes per output column, the block sums quantized on the fly
            column_scale = np.maximum(np.abs(offsets).max(axis=1), np.finfo(np.float32).tiny) / 127.0
            codes8 = np.clip(np.rint(offsets.T / column_scale), -127, 127).astype(np.int8)
            correction = self._node("DynamicQuantizeMatMul", [sums, self._init(codes8, "o8"),
                                                              self._init(column_scale.astype(np.float32), "os")],
                                    "com.microsoft")
        else:
            correction = self._node("MatMul", [sums, self._init(offsets.T, "o")])
        if self.form == FORMS[6]:  # MatMulNBits' bias is [N]: one token's correction
            bias = self._node("Reshape", [correction, self._init(np.array([out_dim], np.int64), "shape")])
            return self._node("MatMulNBits", [*inputs, "", "", bias], "com.microsoft", **attrs)
        return self._node("Add", [self._node("MatMulNBits", inputs, "com.microsoft", **attrs), correction])

    def model(self) -> bytes:
        h = "x"
        for _ in range(LAYERS):
            qkv = self.linear(h, HIDDEN, QKV)
            q = self._node("Slice", [qkv, self._init(np.array([0]), "b"), self._init(np.array([HIDDEN]), "e"),
                                     self._init(np.array([-1]), "a")])
            h = self.linear(q, HIDDEN, HIDDEN)
            gate_up = self.linear(h, HIDDEN, 2 * FFN)
            gate = self._node("Slice", [gate_up, self._init(np.array([0]), "b"), self._init(np.array([FFN]), "e"),
                                        self._init(np.array([-1]), "a")])
            h = self.linear(gate, FFN, HIDDEN)
        self.nodes.append(helper.make_node("Identity", [h], ["y"]))
        graph = helper.make_graph(self.nodes, "linears", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, HIDDEN])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, HIDDEN])], self.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 10
        return model.SerializeToString()


def first_projection_error(form: str, threads: int) -> float:
    """Relative error of one q/k/v projection in this form against its exact weights."""
    graph = LinearsGraph(form, np.random.default_rng(1))
    y = graph.linear("x", HIDDEN, QKV)
    graph.nodes.append(helper.make_node("Identity", [y], ["y"]))
    onnx_graph = helper.make_graph(graph.nodes, "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, HIDDEN])],
                                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, QKV])], graph.inits)
    model = helper.make_model(onnx_graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    x = np.random.default_rng(2).standard_normal((1, HIDDEN)).astype(np.float32)
    got = session(model.SerializeToString(), threads).run(None, {"x": x})[0]
    want = x @ graph.exact[0].T
    return float(np.abs(got - want).max() / np.abs(want).max())


def session(model: bytes, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=30, help="runs per form and round")
    parser.add_argument("--rounds", type=int, default=5, help="the forms take turns, so a slow phase hits them all")
    args = parser.parse_args()
    x = np.full((1, HIDDEN), 0.1, np.float32)
    sessions = {form: session(LinearsGraph(form, np.random.default_rng(0)).model(), args.threads) for form in FORMS}
    medians: dict[str, list[float]] = {form: [] for form in FORMS}
    for _ in range(args.rounds):
        for form, sess in sessions.items():
            medians[form].append(1e3 * median_time(lambda: sess.run(None, {"x": x}), args.runs, warmup=3))
    rows, result = [], {}
    for form in FORMS:
        ms, error = statistics.median(medians[form]), first_projection_error(form, args.threads)
        result[form] = dict(ms=ms, rounds_ms=medians[form], relative_error=error)
        rows.append([form, f"{ms:.2f}", f"{min(medians[form]):.2f}–{max(medians[form]):.2f}", f"{error:.1e}"])
    print(markdown_table(["int4 form (30 layers of linears, one token)", "ms, median of rounds", "rounds' range",
                          "max error / max |y|, one q/k/v"], rows))
    save("onnx_int4_linears", {"rounds": args.rounds, "runs": args.runs, "forms": result})

if __name__ == "__main__":
    main()
