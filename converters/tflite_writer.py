"""Low-level writer for TFLite flatbuffer models (no TensorFlow needed).

This is the bottom layer of litekv's converter: a graph-building layer drives it
to emit whole LLMs as ``.tflite`` files that hold several signatures (for example
``decode`` and ``prefill_128``), each in its own subgraph, all sharing one copy of
the weights. It knows TFLite's schema, not models.

    w = TFLiteModelWriter()
    weight = w.add_constant(np.ones((8, 4), np.float32), "fc.weight")  # stored once
    sg = w.add_signature("decode")            # one subgraph per signature
    x = sg.add_input("x", (1, 4))
    y = sg.tensor("y", (1, 8))
    sg.op("FULLY_CONNECTED", [x, sg.use(weight), -1], [y], keep_num_dims=True)
    sg.add_output("y", y)
    w.write("model.tflite")

Tensor dtypes: float32, float16, int32, int8, int4 (plus int64, uint8, bool).
Weight quantization that XNNPACK runs on CPU:

* int8 per-channel (``PerChannelQuant``, zero points 0, ``quantized_dimension``
  = output channel): FULLY_CONNECTED with float activations runs as
  dynamic-range / weight-only quantization.
* int4 block-wise (``add_blockwise_int4``): an INT4 tensor with schema
  ``BlockwiseQuantization`` whose ``scales`` field is the index of a float16
  constant tensor of shape [out, in / block_size] in the same subgraph,
  symmetric (no zero points), values in [-8, 7], two values per byte with the
  first element in the low nibble.

Buffer data is 64-byte aligned. Large constant data (> 256 MiB by default, and
always past the 2 GiB flatbuffer limit) is appended after the flatbuffer and
referenced through ``Buffer.offset``/``Buffer.size``, which LiteRT's
CompiledModel and Interpreter both load; ``write(external_data=...)`` overrides.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from typing import Iterable, Sequence

import flatbuffers
import numpy as np
from ai_edge_litert import schema_py_generated as schema

__all__ = [
    "BlockwiseQuant",
    "Constant",
    "PerChannelQuant",
    "SubgraphBuilder",
    "TFLiteModelWriter",
    "pack_int4",
    "quantize_blockwise_int4",
    "quantize_per_channel_int8",
    "tensor_type",
]

_ALIGN = 64  # byte alignment of constant data inside the file
_EXTERNAL_DATA_THRESHOLD = 256 << 20  # auto: larger constant data goes after the flatbuffer
_DEDUPE_MAX_BYTES = 1 << 16  # identical small constants share one buffer

# dtype name -> (schema TensorType, numpy storage dtype)
_DTYPES = {
    "float32": (schema.TensorType.FLOAT32, np.float32),
    "float16": (schema.TensorType.FLOAT16, np.float16),
    "int32": (schema.TensorType.INT32, np.int32),
    "int64": (schema.TensorType.INT64, np.int64),
    "int8": (schema.TensorType.INT8, np.int8),
    "uint8": (schema.TensorType.UINT8, np.uint8),
    "bool": (schema.TensorType.BOOL, np.bool_),
    "int4": (schema.TensorType.INT4, np.int8),  # logical values; packed on write
}

# Ops whose options table is not simply CamelCase(op) + "Options".
_OPTIONS_NAME = {
    "BATCH_MATMUL": "BatchMatMulOptions",
    "TOPK_V2": "TopKV2Options",
    "MEAN": "ReducerOptions",
    "SUM": "ReducerOptions",
    "REDUCE_MAX": "ReducerOptions",
    "REDUCE_MIN": "ReducerOptions",
    "REDUCE_PROD": "ReducerOptions",
    "MAXIMUM": "MaximumMinimumOptions",
    "MINIMUM": "MaximumMinimumOptions",
    "RANDOM_UNIFORM": "RandomOptions",
    "RANDOM_STANDARD_NORMAL": "RandomOptions",
    "MULTINOMIAL": "RandomOptions",
}

# Defaults that differ from the schema's zero values.
_OPTION_DEFAULTS = {
    "SOFTMAX": {"beta": 1.0},  # schema default 0.0 would give a uniform softmax
    "ARG_MAX": {"outputType": schema.TensorType.INT32},
    "ARG_MIN": {"outputType": schema.TensorType.INT32},
}

# Op versions below these are not registered in LiteRT's builtin op resolver.
_MIN_VERSION = {"BROADCAST_TO": 2}

_ACTIVATIONS = {
    name: value
    for name, value in vars(schema.ActivationFunctionType).items()
    if not name.startswith("_")
}


def _dtype_name(dtype) -> str:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"unsupported tensor dtype {dtype!r}; use one of {sorted(_DTYPES)}")
        return dtype
    np_dtype = np.dtype(dtype)
    for name, (_, storage) in _DTYPES.items():
        if name != "int4" and np.dtype(storage) == np_dtype:
            return name
    raise ValueError(f"unsupported tensor dtype {np_dtype}")


def tensor_type(dtype) -> int:
    """Schema TensorType code for a dtype name or numpy dtype."""
    return _DTYPES[_dtype_name(dtype)][0]


def _camel(name: str) -> str:
    """snake_case -> camelCase (schema object-API field names)."""
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


# ---------------------------------------------------------------- quantization


@dataclasses.dataclass(frozen=True)
class PerChannelQuant:
    """Affine quantization: one scale (and zero point) per slice along ``axis``.

    A single scale means per-tensor. For FULLY_CONNECTED weights [out, in] use
    axis 0; XNNPACK requires all zero points to be 0 for int8 per-channel.
    """

    scales: tuple
    zero_points: tuple | None = None
    axis: int = 0

    def to_schema(self) -> schema.QuantizationParametersT:
        q = schema.QuantizationParametersT()
        q.scale = [float(s) for s in self.scales]
        zp = self.zero_points if self.zero_points is not None else [0] * len(q.scale)
        q.zeroPoint = [int(z) for z in zp]
        q.quantizedDimension = int(self.axis)
        return q


@dataclasses.dataclass(frozen=True)
class BlockwiseQuant:
    """Block-wise quantization; ``scales`` is a float16 Constant [out, in/block]."""

    scales: "Constant"
    block_size: int


@dataclasses.dataclass(frozen=True)
class Constant:
    """A constant stored once in the model; ``SubgraphBuilder.use`` references it."""

    buffer: int
    shape: tuple
    dtype: str
    name: str
    quant: PerChannelQuant | BlockwiseQuant | None = None


def pack_int4(values: np.ndarray) -> np.ndarray:
    """Packs int values in [-8, 7] two per byte, first element in the low nibble."""
    flat = np.asarray(values).reshape(-1).astype(np.int16)
    if flat.size and (flat.min() < -8 or flat.max() > 7):
        raise ValueError("int4 values must lie in [-8, 7]")
    nibbles = (flat & 0xF).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)


def quantize_per_channel_int8(w: np.ndarray, axis: int = 0):
    """Symmetric int8 per-channel quantization. Returns (q int8, scales float32)."""
    w = np.asarray(w, np.float32)
    reduce_axes = tuple(i for i in range(w.ndim) if i != axis % w.ndim)
    amax = np.max(np.abs(w), axis=reduce_axes, keepdims=True)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q = np.clip(np.round(w / scales), -127, 127).astype(np.int8)
    return q, scales.reshape(-1)


def quantize_blockwise_int4(w: np.ndarray, block_size: int = 32):
    """Symmetric int4 quantization of [out, in] in blocks along ``in``.

    Returns (q int8 values in [-8, 7] shaped like w, scales float16 [out, in/block]).
    Dequantized value = q * scales[o, i // block_size].
    """
    w = np.asarray(w, np.float32)
    out_dim, in_dim = w.shape
    if in_dim % block_size:
        raise ValueError(f"input dim {in_dim} is not a multiple of block size {block_size}")
    blocks = w.reshape(out_dim, in_dim // block_size, block_size)
    amax = np.max(np.abs(blocks), axis=2)
    # XNNPACK rejects scales that are not normal positive float16 numbers.
    scales = np.clip(amax / 7.0, 2.0**-14, 65504.0).astype(np.float16)
    q = np.clip(np.round(blocks / scales.astype(np.float32)[..., None]), -8, 7)
    return q.astype(np.int8).reshape(out_dim, in_dim), scales


# --------------------------------------------------------------------- writer


class _AlignedBufferT(schema.BufferT):
    """BufferT whose data vector is written ``_ALIGN``-aligned without extra copies."""

    def Pack(self, builder):
        data = None
        if self.data is not None:
            raw = memoryview(self.data).cast("B")
            builder.StartVector(1, raw.nbytes, _ALIGN)
            builder.head -= raw.nbytes
            builder.Bytes[builder.head : builder.head + raw.nbytes] = raw
            data = builder.EndVector()
        schema.BufferStart(builder)
        if data is not None:
            schema.BufferAddData(builder, data)
        schema.BufferAddOffset(builder, self.offset)
        schema.BufferAddSize(builder, self.size)
        return schema.BufferEnd(builder)


class SubgraphBuilder:
    """Tensors, operators and named inputs/outputs of one subgraph (= one signature)."""

    def __init__(self, writer: "TFLiteModelWriter", name: str):
        self._writer = writer
        self.name = name
        self.tensors: list[schema.TensorT] = []
        self.operators: list[schema.OperatorT] = []
        self.inputs: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        # (buffer, name) of a Constant, or ("inline", buffer, shape, dtype) of an inline one -> tensor index
        self._used: dict[tuple, int] = {}

    def tensor(self, name: str, shape: Sequence[int], dtype="float32", *,
               buffer: int = 0, quant=None, shape_signature: Sequence[int] | None = None,
               is_variable: bool = False) -> int:
        """Adds a tensor and returns its index. ``buffer`` 0 means no data."""
        t = schema.TensorT()
        t.name = name
        t.shape = [int(d) for d in shape]
        t.type = tensor_type(dtype)
        t.buffer = int(buffer)
        t.isVariable = is_variable
        if shape_signature is not None:
            t.shapeSignature = [int(d) for d in shape_signature]
        if isinstance(quant, PerChannelQuant):
            t.quantization = quant.to_schema()
        elif isinstance(quant, BlockwiseQuant):
            details = schema.BlockwiseQuantizationT()
            details.scales = self.use(quant.scales)
            details.zeroPoints = -1  # none (the field is a tensor index; 0 would be tensor 0)
            details.blockSize = int(quant.block_size)
            q = schema.QuantizationParametersT()
            q.detailsType = schema.QuantizationDetails.BlockwiseQuantization
            q.details = details
            q.quantizedDimension = 0
            t.quantization = q
        elif quant is not None:
            raise TypeError(f"unsupported quantization {quant!r}")
        self.tensors.append(t)
        return len(self.tensors) - 1

    def use(self, const: Constant) -> int:
        """Tensor index of a shared Constant in this subgraph (created on first use)."""
        key = (const.buffer, const.name)
        if key not in self._used:
            self._used[key] = self.tensor(const.name, const.shape, const.dtype,
                                          buffer=const.buffer, quant=const.quant)
        return self._used[key]

    def const(self, value, dtype=None, name: str | None = None) -> int:
        """Small inline constant (shapes, axes, scalars) local to this subgraph."""
        arr = np.asarray(value, dtype=None if dtype is None else _DTYPES[_dtype_name(dtype)][1])
        if dtype is None and arr.dtype == np.float64:
            arr = arr.astype(np.float32)
        if dtype is None and arr.dtype == np.int64:
            arr = arr.astype(np.int32)
        c = self._writer.add_constant(arr, name or f"{self.name}/const{len(self.tensors)}")
        if name is not None:
            return self.use(c)
        # Equal inline constants share one tensor: LiteRT keeps an in-memory copy of every tensor
        # of every signature (about 0.6 KB each), and a layer repeats the same shapes and axes.
        key = ("inline", c.buffer, c.shape, c.dtype)
        if key not in self._used:
            self._used[key] = self.use(c)
        return self._used[key]

    def add_input(self, name: str, shape: Sequence[int], dtype="float32", **kw) -> int:
        """Adds a signature input tensor named ``name``."""
        if name in self.inputs:
            raise ValueError(f"duplicate input {name!r} in {self.name!r}")
        idx = self.tensor(name, shape, dtype, **kw)
        self.inputs[name] = idx
        return idx

    def add_output(self, name: str, tensor: int) -> int:
        """Marks ``tensor`` as the signature output ``name`` (may equal an input name)."""
        if name in self.outputs:
            raise ValueError(f"duplicate output {name!r} in {self.name!r}")
        self.outputs[name] = int(tensor)
        return tensor

    def op(self, op_name: str, inputs: Iterable[int], outputs: Iterable[int], **options):
        """Appends builtin ``op_name``; -1 in ``inputs`` marks an omitted optional input.

        ``options`` are fields of the op's schema options table in snake_case or
        camelCase (e.g. keep_num_dims=True, adj_y=True, axis=1, beta=1.0);
        ``fused_activation_function`` accepts names like "RELU".
        """
        code = getattr(schema.BuiltinOperator, op_name, None)
        if code is None:
            raise ValueError(f"unknown builtin op {op_name!r}")
        o = schema.OperatorT()
        o.opcodeIndex = self._writer._opcode_index(code, _MIN_VERSION.get(op_name, 1))
        o.inputs = [int(i) for i in inputs]
        o.outputs = [int(i) for i in outputs]
        options_name = _OPTIONS_NAME.get(
            op_name, "".join(p.capitalize() for p in op_name.split("_")) + "Options")
        options_cls = getattr(schema, options_name + "T", None)
        if options_cls is None:
            if options:
                raise ValueError(f"{op_name} takes no options, got {sorted(options)}")
        else:
            opts = options_cls()
            for field, value in {**_OPTION_DEFAULTS.get(op_name, {}), **options}.items():
                field = _camel(field)
                if not hasattr(opts, field):
                    raise ValueError(f"{options_name} has no field {field!r}")
                if field == "fusedActivationFunction" and isinstance(value, str):
                    value = _ACTIVATIONS[value]
                elif field in ("outputType", "inDataType", "outDataType") and not isinstance(value, int):
                    value = tensor_type(value)
                setattr(opts, field, value)
            o.builtinOptionsType = getattr(schema.BuiltinOptions, options_name)
            o.builtinOptions = opts
        self.operators.append(o)
        return list(o.outputs)

    def custom_op(self, custom_code: str, inputs: Iterable[int], outputs: Iterable[int], version: int = 1):
        """Appends custom op ``custom_code`` (no options); the runtime must register its kernel."""
        o = schema.OperatorT()
        o.opcodeIndex = self._writer._opcode_index(schema.BuiltinOperator.CUSTOM, version, custom_code)
        o.inputs = [int(i) for i in inputs]
        o.outputs = [int(i) for i in outputs]
        o.customOptionsFormat = schema.CustomOptionsFormat.FLEXBUFFERS
        self.operators.append(o)
        return list(o.outputs)

    def _to_schema(self) -> schema.SubGraphT:
        sg = schema.SubGraphT()
        sg.name = self.name
        sg.tensors = self.tensors
        sg.operators = self.operators
        sg.inputs = list(self.inputs.values())
        sg.outputs = list(self.outputs.values())
        return sg


class TFLiteModelWriter:
    """Collects buffers, subgraphs and signatures; ``write`` emits the .tflite file."""

    def __init__(self, description: str = "litekv"):
        self.description = description
        self._buffers: list[np.ndarray | None] = [None]  # buffer 0 is the empty sentinel
        self._dedupe: dict[tuple, int] = {}
        self._opcodes: list[tuple[int, int, str | None]] = []  # (builtin code, version, custom code)
        self.subgraphs: list[SubgraphBuilder] = []

    # -- constants
    def add_buffer(self, data: np.ndarray | bytes) -> int:
        """Stores raw constant bytes once; returns the buffer index.

        Small identical payloads are deduplicated. The array is kept by reference
        (not copied) until ``write``.
        """
        arr = np.ascontiguousarray(np.frombuffer(data, np.uint8) if isinstance(data, bytes) else data)
        key = None
        if arr.nbytes <= _DEDUPE_MAX_BYTES:
            key = (arr.nbytes, hashlib.blake2b(arr.tobytes(), digest_size=16).digest())
            if key in self._dedupe:
                return self._dedupe[key]
        self._buffers.append(arr)
        if key is not None:
            self._dedupe[key] = len(self._buffers) - 1
        return len(self._buffers) - 1

    def add_constant(self, array: np.ndarray, name: str, dtype=None, quant=None) -> Constant:
        """Adds constant data (weights etc.) that any subgraph can ``use``.

        ``dtype`` defaults to the array's dtype; "int4" takes int values in
        [-8, 7] in the logical shape and packs them.
        """
        arr = np.asarray(array)
        dtype = _dtype_name(arr.dtype if dtype is None else dtype)
        if dtype == "int4":
            data = pack_int4(arr)
        else:
            data = np.ascontiguousarray(arr, dtype=_DTYPES[dtype][1])
        return Constant(self.add_buffer(data), tuple(int(d) for d in arr.shape), dtype, name, quant)

    def add_blockwise_int4(self, q: np.ndarray, scales: np.ndarray, name: str,
                           block_size: int = 32) -> Constant:
        """int4 [out, in] weight with float16 block scales [out, in/block_size]."""
        out_dim, in_dim = q.shape
        scales = np.asarray(scales, np.float16)
        if scales.shape != (out_dim, in_dim // block_size):
            raise ValueError(f"scales shape {scales.shape} != {(out_dim, in_dim // block_size)}")
        scale_const = self.add_constant(scales, name + ".scales")
        return self.add_constant(q, name, "int4", BlockwiseQuant(scale_const, block_size))

    # -- graph
    def _opcode_index(self, code: int, version: int, custom_code: str | None = None) -> int:
        key = (code, version, custom_code)
        if key not in self._opcodes:
            self._opcodes.append(key)
        return self._opcodes.index(key)

    def add_signature(self, key: str) -> SubgraphBuilder:
        """New subgraph exposed as signature ``key`` (inputs/outputs by name)."""
        if any(sg.name == key for sg in self.subgraphs):
            raise ValueError(f"duplicate signature {key!r}")
        sg = SubgraphBuilder(self, key)
        self.subgraphs.append(sg)
        return sg

    # -- serialization
    @property
    def data_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers if b is not None)

    def _model(self, external_offsets: list[int] | None) -> schema.ModelT:
        m = schema.ModelT()
        m.version = 3
        m.description = self.description
        m.operatorCodes = []
        for code, version, custom_code in self._opcodes:
            oc = schema.OperatorCodeT()
            oc.builtinCode = code
            oc.deprecatedBuiltinCode = min(code, schema.BuiltinOperator.PLACEHOLDER_FOR_GREATER_OP_CODES)
            oc.version = version
            oc.customCode = custom_code
            m.operatorCodes.append(oc)
        m.subgraphs = [sg._to_schema() for sg in self.subgraphs]
        m.buffers = []
        for i, data in enumerate(self._buffers):
            b = _AlignedBufferT()
            if data is not None and data.nbytes:
                if external_offsets is None:
                    b.data = data
                else:
                    b.offset, b.size = external_offsets[i], data.nbytes
            m.buffers.append(b)
        m.signatureDefs = []
        for i, sg in enumerate(self.subgraphs):
            sd = schema.SignatureDefT()
            sd.signatureKey = sg.name
            sd.subgraphIndex = i
            sd.inputs = [_tensor_map(n, t) for n, t in sg.inputs.items()]
            sd.outputs = [_tensor_map(n, t) for n, t in sg.outputs.items()]
            m.signatureDefs.append(sd)
        return m

    def _finish(self, model: schema.ModelT, size_hint: int) -> memoryview:
        builder = flatbuffers.Builder(min(max(size_hint, 1024), flatbuffers.Builder.MAX_BUFFER_SIZE))
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return memoryview(builder.Bytes)[builder.Head():]

    def _chunks(self, external_data: bool | None):
        """Yields the file as byte chunks (flatbuffer, then any external data)."""
        payload = self.data_bytes
        if external_data is None:
            external_data = payload > _EXTERNAL_DATA_THRESHOLD
        if not external_data:
            yield self._finish(self._model(None), payload + len(self._buffers) * _ALIGN + (1 << 20))
            return
        # Offsets are uint64 scalars (fixed width), so the flatbuffer size does not
        # depend on their values: build once with placeholders, then for real.
        placeholder = [2**40] * len(self._buffers)
        head_len = len(self._finish(self._model(placeholder), 1 << 20))
        offsets, pos = [0] * len(self._buffers), _round_up(head_len, _ALIGN)
        for i, data in enumerate(self._buffers):
            if data is not None and data.nbytes:
                offsets[i] = pos
                pos = _round_up(pos + data.nbytes, _ALIGN)
        head = self._finish(self._model(offsets), 1 << 20)
        if len(head) != head_len:
            raise AssertionError("flatbuffer size changed between passes")
        yield head
        written = head_len
        for i, data in enumerate(self._buffers):
            if data is not None and data.nbytes:
                yield bytes(offsets[i] - written)
                yield memoryview(data).cast("B")
                written = offsets[i] + data.nbytes

    def to_bytes(self, external_data: bool | None = None) -> bytes:
        """The serialized model (for ``CompiledModel.from_buffer``)."""
        return b"".join(bytes(c) for c in self._chunks(external_data))

    def write(self, path: str | os.PathLike, external_data: bool | None = None) -> int:
        """Atomically writes the model (temp file, fsync, rename); returns its size.

        ``external_data``: True stores constant data after the flatbuffer (Buffer
        offset/size); None does so when it exceeds 256 MiB, which keeps writing
        fast and memory-light and is required past the 2 GiB flatbuffer limit.
        """
        path = os.fspath(path)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".tflite",
                                   dir=os.path.dirname(os.path.abspath(path)))
        try:
            os.fchmod(fd, 0o644)
            with os.fdopen(fd, "wb") as f:
                for chunk in self._chunks(external_data):
                    f.write(chunk)
                f.flush()
                os.fsync(f.fileno())
                size = f.tell()
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return size


def _tensor_map(name: str, tensor: int) -> schema.TensorMapT:
    tm = schema.TensorMapT()
    tm.name = name
    tm.tensorIndex = int(tensor)
    return tm


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align
