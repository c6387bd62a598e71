"""ONNX emitter: one graph with a dynamic token axis serves prefill chunks and decode steps.

Graph contract: inputs `tokens` int32 [1,T], `input_pos` int32 [T], `seqlens_k` int32 [1]
(= tokens in cache after this call - 1), `total_sequence_length` int32 scalar (same + 1),
`past_key_<i>` / `past_value_<i>` float32 [1,KVH,S,D]; outputs `logits` [1,1,V] (last
position) and `present_key_<i>` / `present_value_<i>`. Attention is com.microsoft
GroupQueryAttention, which writes the new rows into the past buffer when the caller binds the
same memory as past and present, and reads only the valid length: decode cost follows the
live context, not S. It may be litekv's DecodeAttention / PrefillAttention instead (domain
"litekv"; their Int8 forms over the int8 cache), with the same contract and the same cache.
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from litekv.bundle import HEAD_KEEP_INPUT, SAMPLER_INPUTS
from litekv.models.base import architecture
from litekv.models.config import ModelConfig

from .graph_ops import GraphOps, LoraSpec, Signature, Sym, rope_tables
from .quantize import QuantPlan, head_screen, int8_per_channel

LORA_LAYOUT = "in_out"
T_DIM = -1  # marker for the dynamic token axis in static shapes
IR_VERSION = 10
OPSET = 21
_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div"}
_ONNX_DTYPE = {"float32": TensorProto.FLOAT, "int32": TensorProto.INT32, "int64": TensorProto.INT64,
               "float16": TensorProto.FLOAT16, "int8": TensorProto.INT8}
_GQA_K_SCALE = 12  # GroupQueryAttention's k_scale input; v_scale follows
KERNEL_DOMAIN = "litekv"  # litekv.native_attention registers its ops under it
GATES = ("silu", "gelu_tanh")  # LinearInt4's `gate` attribute: 1 + the index (ort_ops.c: GATE_)


class OnnxOps(GraphOps):
    def __init__(self, cfg: ModelConfig, weights: Mapping[str, np.ndarray], plan: QuantPlan, sig: Signature,
                 lora: LoraSpec | None, tables, kv_scales: tuple[np.ndarray, np.ndarray] | None = None,
                 kv_dtype: str = "float32", decode_linears: str = "graph", step_graph: bool = False,
                 attention: str = "graph", prefill_linears: str = "graph", key_blocks: bool = False,
                 screened_head: bool = False):
        super().__init__(cfg, weights, plan, sig, lora, tables)
        # an fp32 head in LinearF32 screened by int8 codes (LinearF32Screened): a step that samples
        # reads the screen and a few hundred fp32 rows; the graph takes bundle.HEAD_KEEP_INPUT
        self.screened_head = screened_head
        self.key_blocks = key_blocks  # litekv's Int8 attention ops keep the keys in blocks of slots
        if key_blocks and (kv_scales is None or attention != "kernel"):
            raise ValueError("keys in blocks need litekv's Int8 attention ops (kernel attention, an int8 cache)")
        # "kernel": this graph attends in litekv's op (DecodeAttention in the step graph, else
        # PrefillAttention; their Int8 forms over an int8 cache) over the cache GroupQueryAttention
        # would read
        self.attention_kernel = attention == "kernel"
        # litekv's linear ops (domain "litekv"): with "kernel", one-row int4 / int8 projections (the
        # LM head), and in the step graph every int4 one; they read the tensors MatMulNBits reads.
        self.kernel_linears = decode_linears == "kernel"
        # "kernel": a chunk's int4 projections are LinearInt4 too (on the session's pool), whose tiles
        # prefilled 1.6x as fast as MatMulNBits (bench/PERFORMANCE.md, twentieth round)
        self.prefill_linears = prefill_linears
        # the graph calls litekv's library anyway: an fp32 LM head and a gated MLP's activation
        # (over the runtime's own projections) run in its ops too
        self.kernel_ops = self.kernel_linears or self.attention_kernel or prefill_linears == "kernel"
        self.step_graph = step_graph
        self.kv_scales = kv_scales  # (keys, values) [layers, KVH, D]: an int8 cache; None: float32 or float16
        self.kv_dtype = "int8" if kv_scales is not None else kv_dtype
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._count = 0
        self._weights: dict[str, str] = {}
        self._residual_adds: dict[str, int] = {}  # sum of two same-shape float tensors -> its node's index
        self._gates: dict[str, tuple[str, str]] = {}  # act(first half of a projection) -> (projection, act)
        # output -> (source, source width, start, width): tensors that are a last-axis slice of
        # another one, seen through head reshapes, so attention can take q, k and v as the one
        # fused projection.
        self._views: dict[str, tuple[str, int, int, int]] = {}
        self.presents: dict[int, tuple[str, str]] = {}

    # ---- helpers -----------------------------------------------------------------------------
    def _name(self, hint: str = "t") -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def _node(self, op: str, inputs: Sequence[Sym | str], shape: Sequence[int], dtype: str = "float32",
              domain: str = "", **attrs) -> Sym:
        out = self._name(op.lower())
        refs = [i.ref if isinstance(i, Sym) else i for i in inputs]
        self.nodes.append(helper.make_node(op, refs, [out], domain=domain or None, **attrs))
        return Sym(out, tuple(shape), dtype)

    def _initializer(self, array: np.ndarray, hint: str) -> str:
        name = self._name(hint)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def _weight(self, name: str, make) -> str:
        """A weight initializer named exactly `name`, created once: the plain and the LoRA graph of a
        bundle name their weights alike, so both read them from one external data file."""
        if name not in self._weights:
            self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(make()), name))
            self._weights[name] = name
        return self._weights[name]

    def _ints(self, values: Sequence[int]) -> Sym:
        arr = np.asarray(values, np.int64)
        return Sym(self._initializer(arr, "i64"), arr.shape, "int64")

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> Sym:
        dims = ["T" if d == T_DIM else d for d in shape]
        self.inputs.append(helper.make_tensor_value_info(name, _ONNX_DTYPE[dtype], dims))
        return Sym(name, tuple(shape), dtype)

    def output(self, name: str, sym: Sym) -> None:
        self.nodes.append(helper.make_node("Identity", [sym.ref], [name]))
        dims = ["T" if d == T_DIM else d for d in sym.shape]
        self.outputs.append(helper.make_tensor_value_info(name, _ONNX_DTYPE[sym.dtype], dims))

    # ---- primitives ----------------------------------------------------------------------------
    def const(self, value: np.ndarray) -> Sym:
        arr = np.asarray(value)
        arr = arr.astype(np.float32) if arr.dtype.kind == "f" else arr.astype(np.int32)
        return Sym(self._initializer(arr, "c"), arr.shape, "float32" if arr.dtype == np.float32 else "int32")

    def binary(self, op: str, a: Sym, b: Sym) -> Sym:
        out = self._node(_BINARY[op], [a, b], _broadcast(a.shape, b.shape), a.dtype)
        if op == "add" and a.shape == b.shape and a.dtype == b.dtype == "float32":
            self._residual_adds[out.ref] = len(self.nodes) - 1  # rms_norm may fuse it
        return out

    def unary(self, op: str, x: Sym) -> Sym:
        if op == "rsqrt":
            return self._node("Reciprocal", [self._node("Sqrt", [x], x.shape)], x.shape)
        return self._node({"tanh": "Tanh", "sigmoid": "Sigmoid", "exp": "Exp", "neg": "Neg",
                           "floor": "Floor"}[op], [x], x.shape, x.dtype)

    def rms_norm(self, x: Sym, name: str, eps: float) -> Sym:
        """One SimplifiedLayerNormalization node (ORT's fused RMSNorm) instead of seven elementwise ones;
        of a residual sum, one SkipSimplifiedLayerNormalization that also does the add (a node less
        per norm: a decode step pays ONNX Runtime's per-node cost about 3 us a node)."""
        scale = self._weight(f"{name}.weight", lambda: np.asarray(self.weights[f"{name}.weight"], np.float32))
        add = self._residual_adds.pop(x.ref, None)
        if add is not None:
            node = self.nodes[add]
            out = self._name("skipsimplifiedlayernormalization")
            self.nodes[add] = helper.make_node("SkipSimplifiedLayerNormalization", [*node.input, scale],
                                               [out, "", "", x.ref], domain="com.microsoft", epsilon=float(eps))
            return Sym(out, x.shape)
        return self._node("SimplifiedLayerNormalization", [x, scale], x.shape, axis=-1, epsilon=float(eps),
                          stash_type=1)

    def rope(self, x: Sym, rope) -> Sym:
        """Deferred: GroupQueryAttention applies it (do_rotary) from cos/sin tables by position."""
        if x.shape[-1] % 16:  # the fused kernel's requirement; otherwise compute it with plain ops
            return super().rope(x, rope)
        return Sym(x.ref, x.shape, x.dtype, rotary=rope)

    def mean_last(self, x: Sym) -> Sym:
        return self._node("ReduceMean", [x, self._ints([-1])], (*x.shape[:-1], 1), keepdims=1)

    def reshape(self, x: Sym, shape: Sequence[int]) -> Sym:
        target = []
        for i, d in enumerate(shape):
            if d == T_DIM:
                target.append(0 if i < x.rank and x.shape[i] == T_DIM else -1)
            else:
                target.append(d)
        return self._node("Reshape", [x, self._ints(target)], shape, x.dtype)

    def transpose(self, x: Sym, perm: Sequence[int]) -> Sym:
        return self._node("Transpose", [x], [x.shape[p] for p in perm], x.dtype, perm=list(perm))

    def slice_last(self, x: Sym, start: int, size: int) -> Sym:
        out = self._node("Slice", [x, self._ints([start]), self._ints([start + size]), self._ints([-1])],
                         (*x.shape[:-1], size), x.dtype)
        self._views[out.ref] = (x.ref, x.shape[-1], start, size)
        return out

    def split_heads(self, x: Sym, num_heads: int, head_dim: int) -> Sym:
        out = super().split_heads(x, num_heads, head_dim)
        if x.ref in self._views:
            self._views[out.ref] = self._views[x.ref]
        return out

    def _packed_qkv(self, q: Sym, k: Sym, v: Sym) -> str | None:
        """The fused projection q, k and v were sliced from, in that order, if they were."""
        views = [self._views.get(x.ref) for x in (q, k, v)]
        if None in views or len({(src, total) for src, total, _, _ in views}) != 1:
            return None
        starts = [start for _, _, start, _ in views]
        widths = [width for _, _, _, width in views]
        if starts != [0, widths[0], widths[0] + widths[1]] or views[0][1] != sum(widths):
            return None
        return views[0][0]

    def last_row(self, x: Sym) -> Sym:
        return self._node("Slice", [x, self._ints([-1]), self._ints([2 ** 31]), self._ints([1])],
                          (x.shape[0], 1, x.shape[2]))

    def concat_last(self, parts: Sequence[Sym]) -> Sym:
        shape = (*parts[0].shape[:-1], sum(p.shape[-1] for p in parts))
        return self._node("Concat", parts, shape, parts[0].dtype, axis=-1)

    def gather_rows(self, table: str | np.ndarray, indices: Sym) -> Sym:
        if isinstance(table, str):
            dtype = np.float16 if self.plan.embedding == "fp16" else np.float32
            params = self._weight(table, lambda: np.asarray(self.weights[table], dtype))
            width, half = self.weights[table].shape[1], self.plan.embedding == "fp16"
        else:
            params, width, half = self._initializer(np.asarray(table, np.float32), "table"), table.shape[1], False
        out = self._node("Gather", [params, indices], (*indices.shape, width), axis=0)
        return self._node("Cast", [out], out.shape, to=TensorProto.FLOAT) if half else out

    def _int4_tensors(self, weight: str, parts: Sequence[str]) -> tuple[str, str]:
        """(codes, float16 block scales) of an int4 weight: MatMulNBits' B, each nibble code + 8 with
        the even element low, which litekv's LinearInt4 reads as they are."""
        q, scales, _ = self.int4_weights(weight, parts)
        out_dim, in_dim = q.shape

        def packed() -> np.ndarray:
            nibbles = (q.astype(np.int16) + 8).astype(np.uint8).reshape(out_dim, in_dim // self.plan.block_size,
                                                                          self.plan.block_size)
            return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)

        return self._weight(weight, packed), self._weight(weight + ".scales", lambda: scales)

    def _int8_offsets(self, name: str, offsets: np.ndarray) -> tuple[str, str]:
        """(int8 codes [out, blocks], float32 scale per row) of an int4 weight's block offsets. Their
        rounding (1/254 of a row's largest offset) is far below that of the int8 activations."""
        codes, scales = int8_per_channel(offsets)
        return self._weight(f"{name}.offsets", lambda: codes), self._weight(f"{name}.offsets.scales", lambda: scales)

    def matmul_weight(self, x: Sym, weight: str, parts: Sequence[str]) -> Sym:
        out_dim, in_dim = sum(self.weights[p].shape[0] for p in parts), self.weights[parts[0]].shape[1]
        shape = (*x.shape[:-1], out_dim)
        fmt = self.plan.format_for(weight)
        if fmt == "int4":
            codes, scales16 = self._int4_tensors(weight, parts)
            # float16 in the file, for litekv's op; ONNX Runtime folds the cast once, at load
            scales = self._node("Cast", [scales16], (out_dim, in_dim // self.plan.block_size), to=TensorProto.FLOAT)
            return self._node("MatMulNBits", [x, codes, scales], shape, domain="com.microsoft", K=in_dim, N=out_dim,
                              bits=4, block_size=self.plan.block_size, accuracy_level=4)
        w = self.stacked(parts)
        if fmt == "int8":
            return self._int8_matmul(x, weight, w, shape)
        return self._node("MatMul", [x, self._weight(weight, lambda: w.T)], shape)

    def activation(self, x: Sym, kind: str) -> Sym:
        out = super().activation(x, kind)
        view = self._views.get(x.ref)
        if self.kernel_ops and view is not None and view[2] == 0 and 2 * view[3] == view[1]:
            self._gates[out.ref] = (view[0], kind)  # act(the first half of a projection): see mul
        return out

    def mul(self, a: Sym, b: Sym) -> Sym:
        """act(gate) * up, both halves of one projection's output: in the step graph that
        LinearInt4's `gate` form (the kernel applies it to its rows), elsewhere litekv's Gate op over
        the projection. Either way the two slices, the activation and the product (4 nodes a layer
        after ONNX Runtime's fusions) leave the graph."""
        gate, view = self._gates.get(a.ref), self._views.get(b.ref)
        if gate is not None and view is not None and view[0] == gate[0] and view[2] == view[3]:
            node = next((n for n in self.nodes if gate[0] in n.output), None)
            readers = sum(gate[0] in n.input for n in self.nodes)  # only the two slices, which then go
            if node is not None and readers == 2:
                if self.step_graph and node.op_type == "LinearInt4" and not any(a.name == "gate" for a in node.attribute):
                    out = self._name("gated")
                    node.output[0] = out
                    node.attribute.append(helper.make_attribute("gate", GATES.index(gate[1]) + 1))
                    return Sym(out, b.shape)
                return self._node("Gate", [gate[0]], b.shape, domain=KERNEL_DOMAIN, gate=GATES.index(gate[1]) + 1)
        return super().mul(a, b)

    def block_offsets(self, sums: Sym, name: str, offsets: np.ndarray) -> Sym:
        # The int8 codes times their row scales, transposed: all constant, so ONNX Runtime folds them
        # into one float initializer at load and this is a float MatMul. DequantizeLinear there
        # would be fused into an 8-bit MatMulNBits, which rounds the sums to int8 and ran prefill 5 %
        # slower.
        codes, scales = self._int8_offsets(name, offsets)
        column = self._node("Reshape", [scales, self._ints([-1, 1])], (offsets.shape[0], 1))
        rows = self._node("Mul", [self._node("Cast", [codes], offsets.shape, to=TensorProto.FLOAT), column],
                          offsets.shape)
        return self.matmul_input(sums, self._node("Transpose", [rows], offsets.shape[::-1], perm=[1, 0]))

    def project(self, x: Sym, name: str, parts: Sequence[str]) -> Sym:
        fmt = self.plan.format_for(name)
        if fmt == "fp32" and self.kernel_ops and x.shape[-2] == 1:
            return self._f32_rows(x, name, parts)
        chunk = not (self.step_graph or x.shape[-2] == 1)
        if chunk and fmt == "int4" and self.kernel_linears and self.prefill_linears != "kernel":
            # MatMulNBits, then litekv's Int4Offsets adds the offsets' share from the int8 offsets
            # LinearInt4 reads (in place of a block-sum matmul, a matmul and an add)
            codes_share = self.matmul_weight(x, name, parts)
            offsets = self._int8_offsets(name, self.int4_weights(name, parts)[2])
            return self._node("Int4Offsets", [codes_share, x, *offsets], codes_share.shape, domain=KERNEL_DOMAIN)
        kernel = (fmt == "int4" and self.prefill_linears == "kernel") if chunk else \
            (self.kernel_linears and fmt in ("int4", "int8"))
        if not kernel:
            return super().project(x, name, parts)
        out_dim = sum(self.weights[p].shape[0] for p in parts)
        if fmt == "int4":
            inputs = [*self._int4_tensors(name, parts), *self._int8_offsets(name, self.int4_weights(name, parts)[2])]
        else:
            q, scales = int8_per_channel(self.stacked(parts))
            inputs = [self._weight(f"{name}.rows", lambda: q), self._weight(f"{name}.scales", lambda: scales)]
        op = "LinearInt4" if fmt == "int4" else "LinearInt8"
        return self._node(op, [x, *inputs], (*x.shape[:-1], out_dim), domain=KERNEL_DOMAIN, **self._threads())

    def _threads(self) -> dict[str, int]:
        """A linear's `on_pool` attribute: the model graph's session has a pool of its own; the step
        graph runs on one thread and shares rows with litekv's helper (the op's default)."""
        return {} if self.step_graph else {"on_pool": 1}

    def _f32_rows(self, x: Sym, name: str, parts: Sequence[str]) -> Sym:
        """One row (an LM head's) times an fp32 weight in litekv's LinearF32, which streams W [out, in]
        at the machine's read rate (ONNX Runtime's MatMul read its packed copy of a 113 MB head at 29
        GB/s where the kernel reached 33-42). A tied head reads the embedding table the Gather reads:
        the file no longer holds a transposed copy, nor ONNX Runtime a packed one."""
        tied = len(parts) == 1 and self.weights.get(parts[0]) is self.weights.get("embed.weight") \
            and self.plan.embedding == "fp32"
        weight = (self._weight("embed.weight", lambda: np.asarray(self.weights["embed.weight"], np.float32)) if tied
                  else self._weight(f"{name}.rows", lambda: self.stacked(parts)))
        out_dim = sum(self.weights[p].shape[0] for p in parts)
        if not self.screened_head:
            return self._node("LinearF32", [x, weight], (*x.shape[:-1], out_dim), domain=KERNEL_DOMAIN,
                              **self._threads())
        screen = head_screen(self.stacked(parts))
        tensors = [self._weight(f"{name}.screen{suffix}", lambda a=a: a)
                   for suffix, a in zip(("", ".row_scales", ".bounds"), screen)]
        keep = self.input(HEAD_KEEP_INPUT, (1,), "int32")
        return self._node("LinearF32Screened", [x, weight, *tensors, keep], (*x.shape[:-1], out_dim),
                          domain=KERNEL_DOMAIN, **self._threads())

    def _int8_matmul(self, x: Sym, weight: str, w: np.ndarray, shape: Sequence[int]) -> Sym:
        """x @ W with W int8 per output channel, as DynamicQuantizeMatMul: MLAS's int8 GEMM, as fast
        as MatMulNBits for one token and ~4x faster for a prefill chunk (bench notes in ONNX_NOTES.md).

        That op quantizes x with one scale for the whole tensor, so in a prefill chunk one token with
        large activations would flatten every other token (prefill-then-step top-1 agreement fell
        from 93% to 57%). Each row is therefore divided by its own max |x| first and the output rows
        multiplied back: per-token quantization, as XNNPACK does.

        The codes are stored as uint8 with a zero point of 128 (the same weights). With int8 codes
        MLAS multiplies its uint8 activations by them with vpmaddubsw on CPUs without AVX-512 VNNI,
        whose int16 pair sums saturate (255 * 127 * 2 > 32767): on an AVX2 CPU a step's logits were
        20 % off. uint8 codes take MLAS's U8U8 kernel, which widens to int16 first and is exact."""
        q, scales = int8_per_channel(w)

        def quantized_matmul(a: Sym) -> Sym:
            codes = self._weight(weight, lambda: (q.T.astype(np.int16) + 128).astype(np.uint8))
            zero_points = self._weight(weight + ".zero_points", lambda: np.full(q.shape[0], 128, np.uint8))
            return self._node("DynamicQuantizeMatMul", [a, codes, self._weight(weight + ".scales", lambda: scales),
                                                        zero_points], shape, domain="com.microsoft")

        if x.shape[-2] == 1:  # one row: the tensor scale is the row scale already
            return quantized_matmul(x)
        row_max = self._node("ReduceMax", [self._node("Abs", [x], x.shape), self._ints([-1])],
                             (*x.shape[:-1], 1), keepdims=1)
        row_max = self._node("Max", [row_max, self.const(np.array(1e-30, np.float32))], row_max.shape)  # zero rows
        return self._node("Mul", [quantized_matmul(self._node("Div", [x, row_max], x.shape)), row_max], shape)

    def matmul_const(self, x: Sym, name: str, w: np.ndarray) -> Sym:
        return self._node("MatMul", [x, self._weight(name, lambda: np.asarray(w.T, np.float32))],
                          (*x.shape[:-1], w.shape[0]))

    def matmul_input(self, x: Sym, w: Sym) -> Sym:
        return self._node("MatMul", [x, w], (*x.shape[:-1], w.shape[1]))

    def lora_input(self, name: str, out_dim: int, in_dim: int) -> Sym:
        return self.input(name, (in_dim, out_dim))  # MatMul reads [in, out]: no transpose per step

    def int_op(self, op: str, a: Sym, b: Sym) -> Sym:
        name = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "mod": "Mod", "min": "Min"}[op]
        return self._node(name, [a, b], _broadcast(a.shape, b.shape), "int32")

    def _compare(self, op: str, a: Sym, b: Sym, to: int, dtype: str) -> Sym:
        flags = self._node({"le": "LessOrEqual", "lt": "Less"}[op], [a, b], _broadcast(a.shape, b.shape), "bool")
        return self._node("Cast", [flags], flags.shape, dtype, to=to)

    def int_compare(self, op: str, a: Sym, b: Sym) -> Sym:
        return self._compare(op, a, b, TensorProto.INT32, "int32")

    def float_compare(self, op: str, a: Sym, b: Sym) -> Sym:
        return self._compare(op, a, b, TensorProto.FLOAT, "float32")

    def to_float(self, x: Sym) -> Sym:
        return self._node("Cast", [x], x.shape, "float32", to=TensorProto.FLOAT)

    def to_int(self, x: Sym) -> Sym:
        return self._node("Cast", [x], x.shape, "int32", to=TensorProto.INT32)

    def topk(self, x: Sym, k: int) -> tuple[Sym, Sym]:
        shape = (*x.shape[:-1], k)
        values, indices = self._name("topk_values"), self._name("topk_indices")
        self.nodes.append(helper.make_node("TopK", [x.ref, self._ints([k]).ref], [values, indices], axis=-1))
        return Sym(values, shape), self.to_int(Sym(indices, shape, "int64"))

    def softmax_last(self, x: Sym) -> Sym:
        return self._node("Softmax", [x], x.shape, axis=-1)

    def cumsum_last(self, x: Sym) -> Sym:
        axis = Sym(self._initializer(np.asarray(-1, np.int32), "axis"), (), "int32")
        return self._node("CumSum", [x, axis], x.shape)

    def reduce_sum_last(self, x: Sym) -> Sym:
        return self._node("ReduceSum", [x, self._ints([-1])], (*x.shape[:-1], 1), x.dtype, keepdims=1)

    def gather_index(self, values: Sym, index: Sym) -> Sym:
        flat = self.reshape(values, (values.shape[-1],))
        return self._node("Gather", [flat, self.reshape(index, (1,))], (1,), "int32", axis=0)

    # ---- signature plumbing -------------------------------------------------------------------
    def begin(self, capacity: int) -> None:
        self.tokens = self.input("tokens", (1, T_DIM), "int32")
        self.positions = self.input("input_pos", (T_DIM,), "int32")
        self.seqlens = self.input("seqlens_k", (1,), "int32")
        self.total = self.input("total_sequence_length", (), "int32")
        self.capacity = capacity

    def attention(self, q: Sym, k: Sym, v: Sym, layer: int, window: int | None, scale: float) -> Sym:
        cfg = self.cfg
        kv_shape = (1, cfg.num_kv_heads, self.capacity, cfg.head_dim)
        kv_dtype = self.kv_dtype
        past_k = self.input(f"past_key_{layer}", kv_shape, kv_dtype)
        past_v = self.input(f"past_value_{layer}", kv_shape, kv_dtype)
        rotary = q.rotary
        packed = self._packed_qkv(q, k, v)
        if packed is not None:  # GQA splits the fused projection itself; the slices go unused
            qkv = [packed, "", ""]
        else:
            qkv = [self.reshape(Sym(x.ref, x.shape), (1, T_DIM, x.shape[2] * x.shape[3])).ref for x in (q, k, v)]
        if self.attention_kernel:
            return self._kernel_attention(qkv, past_k, past_v, layer, rotary, window, scale, kv_shape)
        half = kv_dtype == "float16"  # GroupQueryAttention takes its inputs in the cache's type
        if half:
            qkv = [self._half(x) if x else "" for x in qkv]
        inputs = [*qkv, past_k.ref, past_v.ref, self.seqlens.ref, self.total.ref]
        if rotary is not None:  # positions come from seqlens_k: the chunk sits right after the cache
            inputs += list(self._rotary_cache(rotary, half))
        quant = {}
        if self.kv_scales is not None:  # int8 K/V = code * scale, one scale per (KV head, channel)
            inputs += [""] * (_GQA_K_SCALE - len(inputs)) + self._kv_scale_inputs(layer)
            quant = dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8)
        out, present_k, present_v = (self._name("attn"), f"present_key_{layer}", f"present_value_{layer}")
        self.nodes.append(helper.make_node(
            "GroupQueryAttention", inputs, [out, present_k, present_v], domain="com.microsoft",
            num_heads=cfg.num_heads, kv_num_heads=cfg.num_kv_heads, scale=float(scale),
            local_window_size=window if window else -1, do_rotary=int(rotary is not None), rotary_interleaved=0,
            **quant))
        for name in (present_k, present_v):
            self.outputs.append(helper.make_tensor_value_info(name, _ONNX_DTYPE[kv_dtype], list(kv_shape)))
        out = Sym(out, (1, T_DIM, cfg.num_heads * cfg.head_dim))
        return self.to_float(out) if half else out

    def _kernel_attention(self, qkv: list[str], past_k: Sym, past_v: Sym, layer: int, rotary, window: int | None,
                          scale: float, kv_shape: tuple[int, ...]) -> Sym:
        """Attention as litekv's DecodeAttention or PrefillAttention (ort_ops.c): GroupQueryAttention's
        contract over a float32 cache or its int8 one (the ops' Int8 forms, with GroupQueryAttention's
        scale tensors), on litekv's kernels."""
        cfg = self.cfg
        int8 = self.kv_dtype == "int8"
        if self.kv_dtype not in ("float32", "int8"):
            raise ValueError(f"litekv's ONNX attention ops read a float32 or int8 cache, not {self.kv_dtype}")
        inputs = [*qkv, past_k.ref, past_v.ref, self.seqlens.ref]
        inputs += list(self._rotary_cache(rotary)) if rotary is not None else ["", ""]
        if int8:
            inputs += self._kv_scale_inputs(layer)
        while not inputs[-1]:
            inputs.pop()
        op = ("DecodeAttention" if self.step_graph else "PrefillAttention") + ("Int8" if int8 else "")
        out, present_k, present_v = (self._name("attn"), f"present_key_{layer}", f"present_value_{layer}")
        blocks = {"key_blocks": 1} if self.key_blocks else {}
        self.nodes.append(helper.make_node(
            op, inputs, [out, present_k, present_v], domain=KERNEL_DOMAIN, num_heads=cfg.num_heads,
            kv_num_heads=cfg.num_kv_heads, scale=float(scale), local_window_size=window if window else -1, **blocks))
        for name in (present_k, present_v):
            self.outputs.append(helper.make_tensor_value_info(name, _ONNX_DTYPE[self.kv_dtype], list(kv_shape)))
        return Sym(out, (1, T_DIM, cfg.num_heads * cfg.head_dim))

    def _kv_scale_inputs(self, layer: int) -> list[str]:
        """An int8 cache's k_scale and v_scale tensors of a layer, [1, KVH, 1, D]: one scale per (KV
        head, channel), code * scale being the value (GroupQueryAttention's and litekv's Int8 ops')."""
        cfg, names = self.cfg, []
        for kind, scales in zip(("k", "v"), self.kv_scales):
            names.append(f"kv_scale_{kind}_{layer}")
            array = scales[layer].reshape(1, cfg.num_kv_heads, 1, cfg.head_dim).astype(np.float32)
            self.initializers.append(numpy_helper.from_array(array, names[-1]))
        return names

    def _half(self, name: str) -> str:
        """A float16 copy of tensor `name`."""
        out = self._name("half")
        self.nodes.append(helper.make_node("Cast", [name], [out], to=TensorProto.FLOAT16))
        return out

    def _drop_unused(self) -> None:
        """Remove nodes and initializers no output depends on (the slices packed QKV bypasses)."""
        needed = {o.name for o in self.outputs}
        kept = []
        for node in reversed(self.nodes):
            if any(o in needed for o in node.output):
                kept.append(node)
                needed.update(i for i in node.input if i)
        self.nodes = kept[::-1]
        self.initializers = [t for t in self.initializers if t.name in needed]

    def _rotary_cache(self, rope, half: bool = False) -> tuple[str, str]:
        cos, sin = self.rope_tables[rope]
        tag = f"{rope.kind}_{rope.theta:g}_{rope.factor:g}" + ("_f16" if half else "")
        dtype = np.float16 if half else np.float32
        return (self._weight(f"rope_cos_{tag}", lambda: cos.astype(dtype)),
                self._weight(f"rope_sin_{tag}", lambda: sin.astype(dtype)))

    def _norms_into_linears(self) -> None:
        """Each RMSNorm read only by one of litekv's linears becomes that linear's norm inputs (skip,
        weight, `epsilon`; ort_ops.c), its residual sum the linear's second output: a decode step
        pays ONNX Runtime about 5 us a node, and a norm of one row is a fraction of that."""
        readers: dict[str, int] = {}
        for node in self.nodes:
            for name in node.input:
                readers[name] = readers.get(name, 0) + 1
        graph_outputs = {o.name for o in self.outputs}
        producer = {out: node for node in self.nodes for out in node.output if out}
        fused: dict[int, onnx.NodeProto] = {}  # id(norm node) -> the linear taking its place
        for linear in self.nodes:
            weights = {"LinearInt4": 5, "LinearInt8": 3}.get(linear.op_type)
            norm = producer.get(linear.input[0]) if weights and linear.domain == KERNEL_DOMAIN else None
            if (norm is None or norm.op_type not in ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization")
                    or norm.output[0] != linear.input[0] or readers[linear.input[0]] != 1
                    or linear.input[0] in graph_outputs or len(linear.input) != weights or id(norm) in fused):
                continue
            skip = norm.op_type.startswith("Skip")
            if skip and len(norm.input) != 3:  # a bias input: not the contract
                continue
            epsilon = next(a.f for a in norm.attribute if a.name == "epsilon")
            linear.input[0] = norm.input[0]
            linear.input.extend([norm.input[1] if skip else "", norm.input[-1]])
            linear.attribute.append(helper.make_attribute("epsilon", epsilon))
            if skip and len(norm.output) > 3 and norm.output[3]:
                linear.output.append(norm.output[3])
            fused[id(norm)] = linear
        # each fused linear takes its norm's place: its sum output is read before the linear's own place
        taken = {id(linear) for linear in fused.values()}
        self.nodes = [fused.get(id(node), node) for node in self.nodes if id(node) not in taken]

    def finish(self, logits: Sym) -> onnx.ModelProto:
        self.output("logits", logits)
        if self.step_graph:
            self._norms_into_linears()
        self._drop_unused()
        graph = helper.make_graph(self.nodes, f"litekv_{self.cfg.architecture}", self.inputs, self.outputs,
                                  self.initializers)
        domains = [("", OPSET), ("com.microsoft", 1)] + ([(KERNEL_DOMAIN, 1)] if self.kernel_ops else [])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in domains],
                                  producer_name="litekv")
        model.ir_version = IR_VERSION
        return model


def share_external_data(model: onnx.ModelProto, saved_path: str) -> int:
    """Point `model`'s initializers at the identical ones already saved as external data of
    `saved_path`, instead of storing them again; returns how many were shared."""
    saved = onnx.load_model(saved_path, load_external_data=False)
    external = {t.name: t for t in saved.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    shared = 0
    for tensor in model.graph.initializer:
        twin = external.get(tensor.name)
        if twin is not None and list(twin.dims) == list(tensor.dims) and twin.data_type == tensor.data_type:
            tensor.ClearField("raw_data")
            tensor.data_location = TensorProto.EXTERNAL
            del tensor.external_data[:]
            tensor.external_data.extend(twin.external_data)
            shared += 1
    return shared


def _broadcast(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """numpy broadcasting where T_DIM (dynamic) wins over 1."""
    a, b = tuple(a), tuple(b)
    rank = max(len(a), len(b))
    a, b = (1,) * (rank - len(a)) + a, (1,) * (rank - len(b)) + b
    return tuple(T_DIM if T_DIM in (x, y) else max(x, y) for x, y in zip(a, b))


def emit_onnx(cfg: ModelConfig, weights: Mapping[str, np.ndarray], plan: QuantPlan, lora: LoraSpec | None,
              max_context: int, progress: Callable[[str], None] | None = None,
              kv_scales: tuple[np.ndarray, np.ndarray] | None = None,
              kv_dtype: str = "float32", decode_linears: str = "graph", step_graph: bool = False,
              decode_attention: str = "graph", prefill_attention: str = "graph",
              prefill_linears: str = "graph", key_blocks: bool = False,
              screened_head: bool = False) -> onnx.ModelProto:
    """Trace the architecture once into an ONNX model with a dynamic token axis; with
    `kv_scales` (see kv_calibration) the KV cache is int8, else of `kv_dtype` (float32 or float16).
    decode_linears="kernel": one-row quantized projections run in litekv's ops, and with
    `step_graph` (the graph for decode steps) every int4 projection does. decode_attention /
    prefill_attention="kernel": the step graph / the other attends in litekv's ops.
    prefill_linears="kernel": a chunk's int4 projections run in litekv's LinearInt4 as well.
    key_blocks: litekv's Int8 attention ops keep the keys in blocks of slots (kv_layout BHSD_KB8).
    screened_head: an fp32 head in LinearF32 gets an int8 screen (LinearF32Screened) and the graph
    the HEAD_KEEP_INPUT input."""
    weights = dict(weights)
    weights.setdefault("lm_head.weight", weights["embed.weight"])
    sig = Signature("decode" if step_graph else "model", T_DIM, max_context, lora=lora is not None)
    ops = OnnxOps(cfg, weights, plan, sig, lora, rope_tables(cfg, max_context), kv_scales, kv_dtype, decode_linears,
                  step_graph, decode_attention if step_graph else prefill_attention, prefill_linears, key_blocks,
                  screened_head)
    ops.begin(max_context)
    model = ops.finish(architecture(cfg.architecture).forward(ops, cfg))
    if progress:
        progress("model")
    return model, ops.lora_groups


def emit_onnx_sampler(cfg: ModelConfig) -> onnx.ModelProto:
    """A small companion model: logits [1,1,V] + sampler inputs -> `next_token` int32 [1].

    Bound to the main model's logits buffer through IO binding, so logits never pass through Python.
    """
    from .sampling_graph import SamplerInputs, emit_sampler

    ops = OnnxOps(cfg, {}, QuantPlan(), Signature("sampler", 1, 1), None, {})
    logits = ops.input("logits", (1, 1, cfg.vocab_size))
    params = SamplerInputs(*(ops.input(n, (1,), dt) for n, dt in SAMPLER_INPUTS))
    token = emit_sampler(ops, ops.reshape(logits, (1, cfg.vocab_size)), params)
    ops.output("next_token", token)
    graph = helper.make_graph(ops.nodes, "litekv_sampler", ops.inputs, ops.outputs, ops.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="litekv")
    model.ir_version = IR_VERSION
    return model
