"""TFLite emitter: one subgraph per signature, weights stored once and shared by all of them.

Signature contract (LiteRT-LM conventions): inputs `tokens` int32 [1,T], `input_pos` int32 [T],
`mask` float32 [1,1,T,S] (0 = attend, -inf-like = masked; `local_mask` too for sliding-window
layers), `kv_cache_k_<i>` / `kv_cache_v_<i>` float32 [1,S,KVH*D] (the host's [1,S,KVH,D] buffer
seen as rows: XNNPACK copies a bound tensor it reshapes, so the graph never reshapes the cache for
decode); outputs the updated caches
under the same names (written by DYNAMIC_UPDATE_SLICE, so one buffer can be bound in place) and
`logits` [1,1,V] (decode). One more entry point, `sampler`, takes a decode's `logits` and the
sampler inputs and returns `next_token` int32 [1]. By default attention is a custom op of
litekv.native_attention: `litekv.decode_attention` for a decode, `litekv.prefill_attention` for a
prefill chunk; decode_attention / prefill_attention="graph" keep builtin ops only. With
decode_linears="kernel" a one-token step's int4 and int8 projections are custom ops too
(`litekv.linear_int4` / `litekv.linear_int8`) that read the buffers prefill's FULLY_CONNECTED ops use;
with prefill_linears="kernel" a prefill chunk's int4 projections are `litekv.linear_int4` as well.
With `kv_scales` (converters.kv_calibration) the cache tensors are int8 codes of K/V / scale, one
static scale per (layer, KV head, channel): new rows are quantized in the graph, the kernels' int8
forms read the codes, and builtin-op attention dequantizes the cache it reads. With
kv_dtype="float16" the cache tensors are float16: new rows are cast in the graph, the kernels'
f16 forms read half a float32 cache's bytes, and builtin-op attention casts the cache it reads.
Where one-token steps attend in litekv's kernel they rotate q and k in `litekv.rope`; over a float
cache, or an int8 one with static scales, the attention op's rope form takes q, k and v as projected
and writes (for int8: quantizes) the rows itself, so those steps' caches are inputs only. An fp32 LM
head is then `litekv.linear_f32` over its table.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Mapping, Sequence

import numpy as np

from litekv.bundle import HEAD_KEEP_INPUT, SAMPLER_INPUTS
from litekv.errors import ConfigError
from litekv.models.base import architecture
from litekv.models.config import ModelConfig, RopeConfig
from litekv.native_attention import ROPE_OP_NAME, SCREENED_HEAD_OP_NAME, linear_op_name, rope_op_name
from litekv.native_attention import op_name as attention_op_name

from .graph_ops import GraphOps, LoraSpec, Signature, Sym, rope_tables
from .quantize import QuantPlan, head_screen, int8_per_channel
from .tflite_writer import Constant, PerChannelQuant, SubgraphBuilder, TFLiteModelWriter

LORA_LAYOUT = "out_in"
_BINARY = {"add": "ADD", "sub": "SUB", "mul": "MUL", "div": "DIV"}
_UNARY = {"rsqrt": "RSQRT", "tanh": "TANH", "sigmoid": "LOGISTIC", "exp": "EXP", "neg": "NEG", "floor": "FLOOR"}


class TFLiteWeights:
    """Weight constants shared by every signature of one model file."""

    def __init__(self, writer: TFLiteModelWriter, weights: Mapping[str, np.ndarray], plan: QuantPlan):
        self.writer = writer
        self.weights = weights
        self.plan = plan
        self._consts: dict[str, Constant] = {}
        self.quant_cache: dict = {}

    def matmul(self, name: str, parts: Sequence[str], ops: "TFLiteOps") -> Constant:
        tied_table = self.weights.get(parts[0]) is self.weights.get("embed.weight") and len(parts) == 1
        if tied_table and self.plan.format_for(name) == "fp32" and self.plan.embedding == "fp32":
            return self.table("embed.weight")  # a tied fp32 head reads the embedding buffer itself
        if name not in self._consts:
            fmt = self.plan.format_for(name)
            if fmt == "int4":
                q, scales, _ = ops.int4_weights(name, parts)
                self._consts[name] = self.writer.add_blockwise_int4(q, scales, name, self.plan.block_size)
            elif fmt == "int8":
                return self.int8(name, ops.stacked(parts))
            else:
                self._consts[name] = self.writer.add_constant(ops.stacked(parts), name, "float32")
        return self._consts[name]

    def row_scales(self, name: str, const: Constant) -> Constant:
        """A per-channel int8 constant's scales as a float32 [out] constant, for a kernel to read."""
        return self.dense(f"{name}.row_scales", np.asarray(const.quant.scales, np.float32))

    def int8(self, name: str, w: np.ndarray) -> Constant:
        """w [out, in] as int8 codes with one scale per output row."""
        if name not in self._consts:
            q, scales = int8_per_channel(w)
            self._consts[name] = self.writer.add_constant(q, name, "int8", PerChannelQuant(tuple(scales), axis=0))
        return self._consts[name]

    def dense(self, name: str, w: np.ndarray) -> Constant:
        if name not in self._consts:
            self._consts[name] = self.writer.add_constant(np.asarray(w, np.float32), name, "float32")
        return self._consts[name]

    def head_screen(self, name: str, w: np.ndarray) -> tuple[Constant, Constant, Constant]:
        """An fp32 head's int8 screen (quantize.head_screen): codes, row scales and bounds, shared by
        every entry point."""
        key = f"{name}.screen"
        if key not in self._consts:
            codes, scales, bounds = head_screen(w)
            self._consts[key] = self.writer.add_constant(codes, key, "int8")
            self._consts[f"{key}.row_scales"] = self.writer.add_constant(scales, f"{key}.row_scales", "float32")
            self._consts[f"{key}.bounds"] = self.writer.add_constant(bounds, f"{key}.bounds", "float32")
        return self._consts[key], self._consts[f"{key}.row_scales"], self._consts[f"{key}.bounds"]

    def table(self, name: str) -> Constant:
        if name not in self._consts:
            dtype = "float16" if self.plan.embedding == "fp16" else "float32"
            self._consts[name] = self.writer.add_constant(np.asarray(self.weights[name]), name, dtype)
        return self._consts[name]


SPREAD_MAX_KV_HEADS = 4  # one-token attention spreads heads over KVH blocks: KVH x the multiplies


def rotate_half_matrix(dim: int) -> np.ndarray:
    """W [D, D] with x @ W^T == concat(-x[D/2:], x[:D/2])."""
    half = dim // 2
    w = np.zeros((dim, dim), np.float32)
    w[np.arange(half), np.arange(half) + half] = -1.0
    w[np.arange(half) + half, np.arange(half)] = 1.0
    return w


def float_head_in_kernel(lm_head: str, decode_attention: str) -> bool:
    """Whether the LM head's one row runs in litekv's linear op (litekv.linear_f32) over the model
    file's table, not in XNNPACK, which packs a copy: wherever the bundle calls litekv's library anyway.
    Its rows from opposite ends on two threads read faster than XNNPACK's matrix-vector product: fp32
    steps at 300 tokens 0.966x the time (bench/PERFORMANCE.md, twenty-sixth round). For an fp32 head only."""
    return lm_head == "fp32" and decode_attention == "kernel"


class TFLiteOps(GraphOps):
    # XNNPACK packs its own copy of a constant for each op that uses it, so a shared membership
    # matrix is read once per projection: 12.5 MB of floats per SmolLM2 step. A sum reads none.
    block_sums_by_matmul = False

    def __init__(self, cfg: ModelConfig, store: TFLiteWeights, sg: SubgraphBuilder, sig: Signature,
                 lora: LoraSpec | None, tables, decode_attention: str = "kernel",
                 kv_scales: tuple[np.ndarray, np.ndarray] | None = None, prefill_attention: str = "kernel",
                 kv_dtype: str = "float32", kv_row_scales: bool = False, decode_linears: str = "graph",
                 prefill_linears: str = "graph", key_blocks: bool = False, screened_head: bool = False):
        super().__init__(cfg, store.weights, store.plan, sig, lora, tables, store.quant_cache)
        # int4 / int8 projections of one row in litekv's linear kernels: a decode step's, and prefill's
        # LM head (its last row), so no FULLY_CONNECTED keeps the head for XNNPACK to pack a copy of
        self.decode_linears = decode_linears
        # int4 projections of prefill chunks in litekv's kernel: XNNPACK's block-wise int4 GEMM ran at
        # half its int8 rate on AVX2 (bench/PERFORMANCE.md, twentieth round)
        self.prefill_linears = prefill_linears
        self.kernel_linears = decode_linears == "kernel" and sig.tokens == 1
        # One-token steps rotate q and k in litekv.rope wherever they call litekv's library anyway. In
        # XNNPACK the rotation is a FULLY_CONNECTED, two products and a sum per tensor: 240 dispatches in
        # a SmolLM2 step, which wake XNNPACK's worker where the linears are litekv's, and made an fp32
        # step at 300 tokens 2.3 % longer (bench/PERFORMANCE.md, twenty-sixth round).
        self.kernel_rope = sig.tokens == 1 and (self.kernel_linears or decode_attention == "kernel")
        self.float_head = float_head_in_kernel(store.plan.lm_head, decode_attention)
        # that head screened by int8 codes (litekv.linear_f32_screened): a step that samples in the
        # graph reads the screen and a few hundred fp32 rows, not the whole table
        self.screened_head = screened_head and self.float_head
        self.store = store
        self.decode_attention = decode_attention  # "kernel": litekv's custom op; "graph": builtin ops
        self.prefill_attention = prefill_attention  # the same, for chunks of more than one token
        self.kv_scales = kv_scales  # (keys, values) [layers, KVH, D]: an int8 cache; None: float32 or float16
        self.kv_dtype = "int8" if kv_scales is not None else kv_dtype
        # int8 codes with a scale per row: computed as each row is written, kept in [1, KVH, S] tensors
        # that only litekv's kernels read
        self.kv_row_scales = kv_row_scales
        if kv_row_scales and "graph" in (decode_attention, prefill_attention):
            raise ConfigError("an int8 cache with row scales is read by litekv's attention kernels only; convert "
                              "with kernel attention or another --kv-cache.")
        # int8 keys in blocks of slots (kv_layout BSHD_KB8), which litekv's attention ops write themselves
        self.key_blocks = key_blocks
        # A one-token step hands the op q, k and v as projected: it applies RoPE and the scale and writes
        # the rows itself, where the graph spent 7 ops a layer on that over a float cache, 16 over an int8
        # one with static scales (quantizing the rows: MUL, ROUND, MINIMUM, MAXIMUM; scaling the output).
        self.rope_attention = (sig.tokens == 1 and decode_attention == "kernel" and not kv_row_scales
                               and not key_blocks
                               and (self.kv_dtype in ("float32", "float16") or kv_scales is not None))
        if key_blocks and ("graph" in (decode_attention, prefill_attention) or kv_scales is None):
            raise ConfigError("keys in blocks are an int8 cache that only litekv's attention kernels read.")
        self.sg = sg
        self._count = 0
        self.kv_outputs: dict[str, Sym] = {}
        self._full_rope: dict[RopeConfig, tuple[Sym, Sym]] = {}

    # ---- helpers -----------------------------------------------------------------------------
    def _new(self, shape: Sequence[int], dtype: str = "float32") -> Sym:
        self._count += 1
        shape = tuple(int(d) for d in shape)
        return Sym(self.sg.tensor(f"t{self._count}", shape, dtype), shape, dtype)

    def _op(self, name: str, inputs: Sequence[Sym | int], shape: Sequence[int], dtype: str = "float32",
            **options) -> Sym:
        out = self._new(shape, dtype)
        refs = [i.ref if isinstance(i, Sym) else i for i in inputs]
        self.sg.op(name, refs, [out.ref], **options)
        return out

    def _shared(self, name: str, value: np.ndarray) -> Sym:
        """A float constant stored once in the file and used by every signature that names it."""
        const = self.store.dense(name, value)
        return Sym(self.sg.use(const), const.shape, const.dtype)

    def _ints(self, values: Sequence[int]) -> Sym:
        arr = np.asarray(values, np.int32)
        return Sym(self.sg.const(arr, "int32"), arr.shape, "int32")

    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> Sym:
        shape = tuple(int(d) for d in shape)
        return Sym(self.sg.add_input(name, shape, dtype), shape, dtype)

    # ---- primitives ----------------------------------------------------------------------------
    def const(self, value: np.ndarray) -> Sym:
        arr = np.asarray(value)
        arr = arr.astype(np.float32) if arr.dtype.kind == "f" else arr.astype(np.int32)
        dtype = "float32" if arr.dtype == np.float32 else "int32"
        return Sym(self.sg.const(arr, dtype), arr.shape, dtype)

    def binary(self, op: str, a: Sym, b: Sym) -> Sym:
        shape = np.broadcast_shapes(a.shape, b.shape)
        return self._op(_BINARY[op], [a, b], shape, a.dtype)

    def unary(self, op: str, x: Sym) -> Sym:
        return self._op(_UNARY[op], [x], x.shape, x.dtype)

    def mean_last(self, x: Sym) -> Sym:
        return self._op("MEAN", [x, self._ints([x.rank - 1])], (*x.shape[:-1], 1), keep_dims=True)

    def reshape(self, x: Sym, shape: Sequence[int]) -> Sym:
        return self._op("RESHAPE", [x, self._ints(shape)], shape, x.dtype, new_shape=[int(d) for d in shape])

    def transpose(self, x: Sym, perm: Sequence[int]) -> Sym:
        return self._op("TRANSPOSE", [x, self._ints(perm)], [x.shape[p] for p in perm], x.dtype)

    def slice_last(self, x: Sym, start: int, size: int) -> Sym:
        begin = [0] * (x.rank - 1) + [start]
        return self._op("SLICE", [x, self._ints(begin), self._ints([*x.shape[:-1], size])],
                        (*x.shape[:-1], size), x.dtype)

    def last_row(self, x: Sym) -> Sym:
        b, t, h = x.shape
        return self._op("SLICE", [x, self._ints([0, t - 1, 0]), self._ints([b, 1, h])], (b, 1, h))

    def concat_last(self, parts: Sequence[Sym]) -> Sym:
        shape = (*parts[0].shape[:-1], sum(p.shape[-1] for p in parts))
        return self._op("CONCATENATION", parts, shape, parts[0].dtype, axis=parts[0].rank - 1)

    def gather_rows(self, table: str | np.ndarray, indices: Sym) -> Sym:
        if isinstance(table, str):
            const = self.store.table(table)
        else:  # stored once by content, shared by every signature
            data = np.ascontiguousarray(table, np.float32)
            key = hashlib.blake2b(data.tobytes() + str(data.shape).encode(), digest_size=16).hexdigest()
            const = self.store.dense(f"table.{key}", data)
        params = Sym(self.sg.use(const), const.shape, const.dtype)
        out = self._op("GATHER", [params, indices], (*indices.shape, *const.shape[1:]), const.dtype, axis=0)
        return self._op("DEQUANTIZE", [out], out.shape) if const.dtype == "float16" else out

    def rope(self, x: Sym, rope: RopeConfig) -> Sym:
        """x * cos + rotate_half(x) * sin, with rotate_half as one FULLY_CONNECTED by a constant
        signed permutation: four ops per tensor instead of nine slices, products and concats.
        A one-token decode step pays per op, not per multiply."""
        if rope not in self._full_rope:
            cos, sin = self.rope_tables[rope]  # [max_context, D/2]
            self._full_rope[rope] = tuple(
                self.reshape(self.gather_rows(np.concatenate([t, t], axis=1), self.positions),
                             (1, self.sig.tokens, 1, 2 * t.shape[1]))
                for t in (cos, sin))
        cos, sin = self._full_rope[rope]
        if self.rope_attention:  # deferred into the attention op
            return Sym(x.ref, x.shape, x.dtype, rotary=rope)
        if self.kernel_rope:
            out = self._new(x.shape)
            self.sg.custom_op(ROPE_OP_NAME, [x.ref, cos.ref, sin.ref], [out.ref])
            return out
        rotated = self.matmul_const(x, f"rope.rotate_half.{x.shape[-1]}", rotate_half_matrix(x.shape[-1]))
        return self.binary("add", self.binary("mul", x, cos), self.binary("mul", rotated, sin))

    def _matmul_by(self, x: Sym, const: Constant) -> Sym:
        return self.matmul_input(x, Sym(self.sg.use(const), const.shape, const.dtype))

    def matmul_weight(self, x: Sym, weight: str, parts: Sequence[str]) -> Sym:
        return self._matmul_by(x, self.store.matmul(weight, parts, self))

    def matmul_const(self, x: Sym, name: str, w: np.ndarray) -> Sym:
        return self._matmul_by(x, self.store.dense(name, w))

    def project(self, x: Sym, name: str, parts: Sequence[str]) -> Sym:
        fmt = self.plan.format_for(name)
        one_row = x.shape[-2] == 1
        float_head = one_row and name.startswith("lm_head") and self.float_head
        if not (one_row and self.decode_linears == "kernel" and fmt in ("int4", "int8")
                or not one_row and self.prefill_linears == "kernel" and fmt == "int4" or float_head):
            return super().project(x, name, parts)
        weight = self.store.matmul(name, parts, self)  # the constant prefill's FULLY_CONNECTED reads
        if float_head:  # W itself (a tied head: the embedding table the GATHER reads), never packed by XNNPACK
            y = self._new((*x.shape[:-1], weight.shape[0]))
            if self.screened_head:
                screen = self.store.head_screen(name, self.stacked(parts))
                keep = self.input(HEAD_KEEP_INPUT, (1,), "int32")
                self.sg.custom_op(SCREENED_HEAD_OP_NAME, [x.ref, self.sg.use(weight), *map(self.sg.use, screen),
                                                          keep.ref], [y.ref])
            else:
                self.sg.custom_op(linear_op_name("f32"), [x.ref, self.sg.use(weight)], [y.ref])
            return y
        out_dim, in_dim = weight.shape

        def view(const: Constant, shape: tuple, dtype: str) -> int:
            # the same buffer as another tensor type, without its quantization: the kernel reads bytes
            return self.sg.use(Constant(const.buffer, shape, dtype, f"{const.name}.{dtype}"))

        if fmt == "int4":
            offsets = self.store.int8(f"{name}.offsets", self.int4_weights(name, parts)[2])
            inputs = [view(weight, (out_dim, in_dim // 2), "uint8"), self.sg.use(weight.quant.scales),
                      view(offsets, offsets.shape, "int8"), self.sg.use(self.store.row_scales(offsets.name, offsets))]
        else:
            inputs = [view(weight, weight.shape, "int8"), self.sg.use(self.store.row_scales(name, weight))]
        y = self._new((*x.shape[:-1], out_dim))
        self.sg.custom_op(linear_op_name(fmt), [x.ref, *inputs], [y.ref])
        return y

    def block_offsets(self, sums: Sym, name: str, offsets: np.ndarray) -> Sym:
        # int8 codes per output row: a quarter of the float bytes (13 MB per SmolLM2 step in fp32).
        # Their rounding (1/254 of a row's largest offset) is far below that of the int8 activations.
        return self._matmul_by(sums, self.store.int8(f"{name}.offsets", offsets))

    def matmul_input(self, x: Sym, w: Sym) -> Sym:
        return self._op("FULLY_CONNECTED", [x, w, -1], (*x.shape[:-1], w.shape[0]), keep_num_dims=True)

    def lora_input(self, name: str, out_dim: int, in_dim: int) -> Sym:
        return self.input(name, (out_dim, in_dim))  # FULLY_CONNECTED weights are [out, in]

    def int_op(self, op: str, a: Sym, b: Sym) -> Sym:
        name = {"add": "ADD", "sub": "SUB", "mul": "MUL", "div": "FLOOR_DIV", "mod": "FLOOR_MOD", "min": "MINIMUM"}[op]
        return self._op(name, [a, b], np.broadcast_shapes(a.shape, b.shape), "int32")

    def _compare(self, op: str, a: Sym, b: Sym, dtype: str) -> Sym:
        flags = self._op({"le": "LESS_EQUAL", "lt": "LESS"}[op], [a, b], np.broadcast_shapes(a.shape, b.shape), "bool")
        return self._op("CAST", [flags], flags.shape, dtype)

    def int_compare(self, op: str, a: Sym, b: Sym) -> Sym:
        return self._compare(op, a, b, "int32")

    def float_compare(self, op: str, a: Sym, b: Sym) -> Sym:
        return self._compare(op, a, b, "float32")

    def to_float(self, x: Sym) -> Sym:
        return self._op("CAST", [x], x.shape, "float32")

    def to_int(self, x: Sym) -> Sym:
        return self._op("CAST", [x], x.shape, "int32")

    def topk(self, x: Sym, k: int) -> tuple[Sym, Sym]:
        shape = (*x.shape[:-1], k)
        values, indices = self._new(shape), self._new(shape, "int32")
        k_const = Sym(self.sg.const(np.asarray(k, np.int32), "int32"), (), "int32")
        self.sg.op("TOPK_V2", [x.ref, k_const.ref], [values.ref, indices.ref])
        return values, indices

    def softmax_last(self, x: Sym) -> Sym:
        return self._op("SOFTMAX", [x], x.shape, beta=1.0)

    def cumsum_last(self, x: Sym) -> Sym:
        axis = Sym(self.sg.const(np.asarray(x.rank - 1, np.int32), "int32"), (), "int32")
        return self._op("CUMSUM", [x, axis], x.shape)

    def reduce_sum_last(self, x: Sym) -> Sym:
        return self._op("SUM", [x, self._ints([x.rank - 1])], (*x.shape[:-1], 1), x.dtype, keep_dims=True)

    def gather_index(self, values: Sym, index: Sym) -> Sym:
        flat = self.reshape(values, (values.shape[-1],))
        return self._op("GATHER", [flat, self.reshape(index, (1,))], (1,), "int32", axis=0)

    # ---- signature plumbing -------------------------------------------------------------------
    def begin(self) -> None:
        cfg, t, s = self.cfg, self.sig.tokens, self.sig.capacity
        self.tokens = self.input("tokens", (1, t), "int32")
        self.positions = self.input("input_pos", (t,), "int32")
        self.mask = self.input("mask", (1, 1, t, s))
        self.local_mask = self.input("local_mask", (1, 1, t, s)) if "sliding" in cfg.layer_types else None
        kv_shape = (1, s, cfg.num_kv_heads * cfg.head_dim)
        self.kv_inputs = {}
        for i in range(cfg.num_layers):
            for kind in ("k", "v"):
                name = f"kv_cache_{kind}_{i}"
                self.kv_inputs[name] = self.input(name, kv_shape, self.kv_dtype)
                if self.kv_row_scales:  # [1, KVH, S]: each KV head's scales contiguous, as the kernels read them
                    name = f"kv_scale_{kind}_{i}"
                    self.kv_inputs[name] = self.input(name, (1, cfg.num_kv_heads, s))
        first_pos = self.first_pos = self._op("SLICE", [self.positions, self._ints([0]), self._ints([1])], (1,),
                                               "int32")
        self.kv_start = self._op("CONCATENATION", [self._ints([0]), first_pos, self._ints([0])], (3,),
                                 "int32", axis=0)
        if self.kv_row_scales:
            self.kv_scale_start = self._op("CONCATENATION", [self._ints([0, 0]), first_pos], (3,), "int32", axis=0)

    def attention(self, q: Sym, k: Sym, v: Sym, layer: int, window: int | None, scale: float) -> Sym:
        cfg, t, s = self.cfg, self.sig.tokens, self.sig.capacity
        kvh, g, d = cfg.num_kv_heads, cfg.group_size, cfg.head_dim
        if q.rotary is not None:
            return self._rope_attention(q, k, v, layer, window, scale)
        caches, extra = [], []  # extra: the op's inputs after the mask
        for kind, new in (("k", k), ("v", v)):
            name = f"kv_cache_{kind}_{layer}"
            if self.kv_row_scales:
                new, scales = self._kv_row_codes(new)
                extra.append(self._write_rows(f"kv_scale_{kind}_{layer}", scales, self.kv_scale_start))
            new = self.reshape(new, (1, t, kvh * d))
            if self.kv_scales is not None:
                new = self._kv_codes(new, kind, layer)
            elif self.kv_dtype == "float16":
                new = self._op("CAST", [new], new.shape, "float16")
            if self.key_blocks and kind == "k":  # the op writes them into their blocks
                caches.append(self.kv_inputs[name])
                extra = [new, self.first_pos]
                continue
            caches.append(self._write_rows(name, new))
        mask = self.local_mask if window is not None else self.mask
        if (self.decode_attention if t == 1 else self.prefill_attention) == "kernel":
            return self._kernel_attention(q, caches, mask, scale, layer, extra)
        if self.kv_scales is not None:  # builtin attention reads float32: a pass over the cache
            caches = [self.binary("mul", self.to_float(c), self._kv_scale(kind, layer))
                      for kind, c in zip(("k", "v"), caches)]
        elif self.kv_dtype == "float16":
            caches = [self.to_float(c) for c in caches]
        if t == 1 and kvh <= SPREAD_MAX_KV_HEADS:
            return self._decode_attention(q, caches, mask, scale)
        # XNNPACK runs a reshape of a bound tensor as a copy: a pass over the cache, which a
        # prefill chunk's transposes pay anyway.
        caches = [self.reshape(c, (s, kvh, d)) for c in caches]
        keys = self.transpose(caches[0], (1, 0, 2))  # [KVH, S, D]
        values = self.transpose(caches[1], (1, 2, 0))  # [KVH, D, S]: both matmuls read rows (adj_y)
        q = self.binary("mul", q, self.const(np.float32(scale)))
        q = self.transpose(self.reshape(q, (t, kvh, g, d)), (1, 2, 0, 3))  # [KVH, G, T, D]
        q = self.reshape(q, (kvh, g * t, d))
        scores = self._op("BATCH_MATMUL", [q, keys], (kvh, g * t, s), adj_y=True)
        scores = self.binary("add", self.reshape(scores, (kvh, g, t, s)), mask)
        probs = self._op("SOFTMAX", [self.reshape(scores, (kvh, g * t, s))], (kvh, g * t, s), beta=1.0)
        out = self._op("BATCH_MATMUL", [probs, values], (kvh, g * t, d), adj_y=True)
        out = self.transpose(self.reshape(out, (kvh, g, t, d)), (2, 0, 1, 3))  # [T, KVH, G, D]
        return self.reshape(out, (1, t, cfg.num_heads * d))

    def _kv_scale(self, kind: str, layer: int, per_query_head: bool = False, times: float = 1.0) -> Sym:
        """The static scales of one layer's K or V (times a factor) as a row: [KVH*D], or [H*D]
        repeated per query head."""
        scales = self.kv_scales[0 if kind == "k" else 1][layer]  # [KVH, D]
        if per_query_head:
            scales = np.repeat(scales, self.cfg.group_size, axis=0)  # query head h reads KV head h // G
        name = f"kv_scale.{kind}.{layer}.{'q' if per_query_head else 'kv'}" + ("" if times == 1.0 else f".x{times:.9g}")
        return self._shared(name, (scales.reshape(-1) * np.float32(times)).astype(np.float32))

    def _write_rows(self, name: str, new: Sym, start: Sym | None = None) -> Sym:
        """The signature's rows written into the bound cache tensor `name` at `start` (the first
        position's slot)."""
        cache = self.kv_inputs[name]
        updated = self._op("DYNAMIC_UPDATE_SLICE", [cache, new, start or self.kv_start], cache.shape, cache.dtype)
        self.kv_outputs[name] = updated
        return updated

    def _kv_row_codes(self, x: Sym) -> tuple[Sym, Sym]:
        """New K or V rows [.., T, KVH, D] as int8 codes with a scale per token and KV head, the
        row's largest |x| over 127 (0 for a zero row, whose codes are 0): codes [1, T, KVH, D] and
        scales [1, KVH, T]."""
        t, kvh, d = self.sig.tokens, self.cfg.num_kv_heads, self.cfg.head_dim
        x = self.reshape(x, (1, t, kvh, d))
        largest = self._op("REDUCE_MAX", [self._op("ABS", [x], x.shape), self._ints([3])], (1, t, kvh, 1),
                           keep_dims=True)
        divisor = self._op("MAXIMUM", [largest, self.const(np.float32(np.finfo(np.float32).tiny))], largest.shape)
        unit = self._op("DIV", [x, divisor], x.shape)  # in [-1, 1]
        codes = self._op("ROUND", [self.binary("mul", unit, self.const(np.float32(127)))], x.shape)
        codes = self._op("CAST", [codes], x.shape, "int8")
        scales = self.binary("mul", largest, self.const(np.float32(1.0 / 127.0)))
        scales = self.reshape(scales, (1, kvh, 1)) if t == 1 else \
            self.transpose(self.reshape(scales, (1, t, kvh)), (0, 2, 1))
        return codes, scales

    def _kv_inverse_scale(self, kind: str, layer: int) -> Sym:
        """1 / the static scales of one layer's K or V, as a row [KVH*D]."""
        inverse = 1.0 / self.kv_scales[0 if kind == "k" else 1][layer].reshape(-1)
        return self._shared(f"kv_inverse_scale.{kind}.{layer}", inverse)

    def _kv_codes(self, x: Sym, kind: str, layer: int) -> Sym:
        """int8 codes round(x / scale), clipped to +-127 (a symmetric range, as the calibration assumes)."""
        codes = self._op("ROUND", [self.binary("mul", x, self._kv_inverse_scale(kind, layer))], x.shape)
        codes = self._op("MINIMUM", [codes, self.const(np.float32(127))], x.shape)
        codes = self._op("MAXIMUM", [codes, self.const(np.float32(-127))], x.shape)
        return self._op("CAST", [codes], x.shape, "int8")

    def _kernel_attention(self, q: Sym, caches: list[Sym], mask: Sym, scale: float, layer: int,
                          extra: Sequence[Sym] = ()) -> Sym:
        """The signature's tokens in litekv's attention kernels (litekv.native_attention), custom ops
        that read only the live cached rows, in place, where XNNPACK's batch matmuls repack the
        whole capacity: the decode op for one token, the prefill op for a chunk.

        With an int8 cache the kernel reads the codes: q . (code_k * s_k) = (q * s_k) . code_k, and
        sum p * code_v * s_v = s_v * sum p * code_v, so the query and the output carry the static
        scales. `extra`: scales per row go to the kernel's int8_rows form as two more inputs; keys in
        blocks to its int8_blocks form as the tokens' key codes and their first slot."""
        t, width = self.sig.tokens, self.cfg.num_heads * self.cfg.head_dim
        q = self.reshape(q, (1, t, width))
        op = attention_op_name("int8_rows" if self.kv_row_scales else self.kv_dtype, prefill=t > 1,
                               key_blocks=self.key_blocks)
        if self.kv_scales is None:
            q = self.binary("mul", q, self.const(np.float32(scale)))
        else:
            q = self.binary("mul", q, self._kv_scale("k", layer, True, scale))
        out = self._new((1, t, width))
        self.sg.custom_op(op, [q.ref, caches[0].ref, caches[1].ref, mask.ref, *(x.ref for x in extra)], [out.ref])
        return out if self.kv_scales is None else self.binary("mul", out, self._kv_scale("v", layer, True))

    def _rope_attention(self, q: Sym, k: Sym, v: Sym, layer: int, window: int | None, scale: float) -> Sym:
        """One token's attention in litekv's rope form: q and k as projected (their RoPE deferred by
        rope()), the caches as signature inputs that the op writes this step's rows into, and the slot
        and scale as inputs. Over an int8 cache, the scale is the query's factors, and the rows' inverse
        scales and the output's factors follow (_kernel_attention's algebra, in the op)."""
        if k.rotary != q.rotary:
            raise ConfigError(f"layer {layer}: q and k carry different RoPE; the rope attention form takes one")
        cos, sin = self._full_rope[q.rotary]
        width, kv_width = self.cfg.num_heads * self.cfg.head_dim, self.cfg.num_kv_heads * self.cfg.head_dim
        q, k, v = self.reshape(q, (1, 1, width)), self.reshape(k, (1, 1, kv_width)), self.reshape(v, (1, 1, kv_width))
        caches = [self.kv_inputs[f"kv_cache_{kind}_{layer}"] for kind in ("k", "v")]
        mask = self.local_mask if window is not None else self.mask
        out = self._new((1, 1, width))
        if self.kv_scales is None:
            factors = [self._shared(f"attention.scale.{scale:.9g}", np.float32([scale]))]
        else:
            factors = [self._kv_scale("k", layer, True, scale), self._kv_inverse_scale("k", layer),
                       self._kv_inverse_scale("v", layer), self._kv_scale("v", layer, True)]
        inputs = [q, *caches, mask, k, v, cos, sin, self.first_pos, *factors]
        self.sg.custom_op(rope_op_name(self.kv_dtype), [x.ref for x in inputs], [out.ref])
        return out

    def _decode_attention(self, q: Sym, caches: list[Sym], mask: Sym, scale: float) -> Sym:
        """One query token against the cache as it lies in memory, [S, KVH*D], never transposed or copied.

        Each query head is written into its KV head's block of a KVH*D row (zeros elsewhere), so
        one matmul against the cache rows scores every head; after the second matmul each head
        keeps its own block. The zero blocks multiply the attention arithmetic by KVH, which for
        one token and few KV heads is far less than the two whole-cache transposes (a copy of K
        and V per layer) it replaces; more KV heads take the transposing path.
        """
        cfg, s = self.cfg, self.sig.capacity
        kvh, g, d, heads = cfg.num_kv_heads, cfg.group_size, cfg.head_dim, cfg.num_heads
        select = self.const(np.eye(kvh, dtype=np.float32).reshape(kvh, 1, kvh, 1))
        keys, values = caches  # [1, S, KVH*D] as bound: no reshape, so no copy
        q = self.binary("mul", q, self.const(np.float32(scale)))
        spread = self.binary("mul", self.reshape(q, (kvh, g, 1, d)), select)  # [KVH, G, KVH, D]
        scores = self._op("BATCH_MATMUL", [self.reshape(spread, (1, heads, kvh * d)), keys], (1, heads, s), adj_y=True)
        scores = self.binary("add", scores, self.reshape(mask, (1, 1, s)))
        probs = self._op("SOFTMAX", [scores], (1, heads, s), beta=1.0)
        out = self._op("BATCH_MATMUL", [probs, values], (1, heads, kvh * d))
        out = self.binary("mul", self.reshape(out, (kvh, g, kvh, d)), select)
        out = self._op("SUM", [out, self._ints([2])], (kvh, g, d), keep_dims=False)
        return self.reshape(out, (1, 1, heads * d))

    def finish(self, logits: Sym) -> None:
        for name, sym in self.kv_outputs.items():
            self.sg.add_output(name, sym.ref)
        if self.sig.logits:
            self.sg.add_output("logits", logits.ref)

    def sampler(self) -> None:
        """The sampler entry point: a decode's logits [1,1,V] + sampler inputs -> `next_token` [1]."""
        from .sampling_graph import SamplerInputs, emit_sampler

        logits = self.input("logits", (1, 1, self.cfg.vocab_size))
        params = SamplerInputs(*(self.input(n, (1,), dt) for n, dt in SAMPLER_INPUTS))
        token = emit_sampler(self, self.reshape(logits, (1, self.cfg.vocab_size)), params)
        self.sg.add_output("next_token", token.ref)


def emit_tflite(cfg: ModelConfig, weights: Mapping[str, np.ndarray], plan: QuantPlan,
                signatures: Sequence[Signature], lora: LoraSpec | None, max_context: int,
                progress: Callable[[str], None] | None = None, decode_attention: str = "kernel",
                kv_scales: tuple[np.ndarray, np.ndarray] | None = None,
                prefill_attention: str = "kernel", kv_dtype: str = "float32",
                kv_row_scales: bool = False, decode_linears: str = "graph",
                prefill_linears: str = "graph", key_blocks: bool = False,
                screened_head: bool = False) -> TFLiteModelWriter:
    """Trace every signature of the architecture into one TFLite model (not yet written).

    decode_attention: "kernel" runs one-token attention in litekv's custom op, "graph" in builtin ops;
    prefill_attention the same for prefill chunks.
    kv_scales: (keys, values) [layers, KVH, D] static scales of an int8 KV cache; None: kv_dtype, float32
    or float16.
    kv_row_scales: an int8 cache whose codes have a scale per token and KV head, computed as rows are
    written (needs litekv's attention kernel).
    decode_linears: "kernel" runs one-token steps' int4 and int8 projections in litekv's custom ops;
    prefill_linears: "kernel" runs prefill chunks' int4 projections there too.
    key_blocks: an int8 cache's keys in blocks of slots (kv_layout BSHD_KB8), written and read by
    litekv's attention ops.
    screened_head: an fp32 head in litekv's op (float_head_in_kernel) gets an int8 screen, and its
    entry points the HEAD_KEEP_INPUT input."""
    weights = dict(weights)
    weights.setdefault("lm_head.weight", weights["embed.weight"])
    writer = TFLiteModelWriter(description=f"litekv {cfg.architecture}")
    store = TFLiteWeights(writer, weights, plan)
    tables = rope_tables(cfg, max_context)
    forward = architecture(cfg.architecture).forward
    groups = {}
    for sig in signatures:
        ops = TFLiteOps(cfg, store, writer.add_signature(sig.name), sig, lora, tables, decode_attention, kv_scales,
                        prefill_attention, kv_dtype, kv_row_scales, decode_linears, prefill_linears, key_blocks,
                        screened_head)
        if sig.sampler:
            ops.sampler()
        else:
            ops.begin()
            ops.finish(forward(ops, cfg))
        groups.update(ops.lora_groups)
        if progress:
            progress(sig.name)
    return writer, groups
