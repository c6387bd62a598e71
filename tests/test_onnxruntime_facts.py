"""Facts about onnxruntime that the ONNX emitter and executor rely on (GQA in place, MatMulNBits, cancellation).

Everything is built with ``onnx.helper`` and run on onnxruntime's CPU EP.
The facts proven here are summarised in ``converters/ONNX_NOTES.md``.

Run with ``python -m pytest tests/test_onnxruntime_facts.py -q -s`` to see the
printed timings.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper

IR_VERSION = 10
OPSET = 21
MS_OPSET = 1
ATOL = 1e-5


# ----------------------------------------------------------------------------
# generic helpers
# ----------------------------------------------------------------------------


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = oh.make_graph(list(nodes), "g", list(inputs), list(outputs), initializer=list(initializers))
    model = oh.make_model(
        graph,
        opset_imports=[oh.make_opsetid("", OPSET), oh.make_opsetid("com.microsoft", MS_OPSET)],
        ir_version=IR_VERSION,
    )
    return model


def _session(model, threads: int = 1, opt_level=None, spin: bool = True) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    if not spin:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    if opt_level is not None:
        so.graph_optimization_level = opt_level
    src = model if isinstance(model, (str, os.PathLike)) else model.SerializeToString()
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])


def _vi(name, dtype, shape):
    return oh.make_tensor_value_info(name, dtype, shape)


def _bench(fn, iters: int, repeats: int = 5) -> float:
    """Seconds per call: min over ``3*repeats`` batches of ``iters/3`` calls.

    Taking the best batch filters out interference on this shared 2-vCPU VM
    (2-thread timings are especially sensitive to a busy sibling core)."""
    fn()
    fn()
    n = max(1, iters // 3)
    best = float("inf")
    for _ in range(3 * repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


# ----------------------------------------------------------------------------
# GroupQueryAttention graph + numpy reference
# ----------------------------------------------------------------------------


def rope_tables(max_pos: int, rot_dim: int, base: float = 10000.0):
    inv = 1.0 / (base ** (np.arange(0, rot_dim, 2, dtype=np.float64) / rot_dim))
    ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)  # [max_pos, rot_dim/2]


def np_rope(x, pos, cos, sin):
    """HF ``rotate_half`` (non-interleaved) RoPE. x: [T, N, D], pos: [T]."""
    half = cos.shape[1]
    c = cos[pos][:, None, :].astype(np.float64)
    s = sin[pos][:, None, :].astype(np.float64)
    x = x.astype(np.float64)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = x.copy()
    out[..., :half] = x1 * c - x2 * s
    out[..., half : 2 * half] = x2 * c + x1 * s
    return out


def np_attention(q, k, v, q_pos, window=-1, softcap=0.0, scale=None):
    """Reference attention for ONE sequence.

    q: [T, H, D] (already rotated), k/v: [L, KVH, D] (all keys 0..L-1, rotated),
    q_pos: absolute positions of the T queries. Causal, GQA grouping
    (q head h uses kv head h // (H // KVH)), sliding window as implemented by
    ORT 1.31: key j visible from query i iff i - window < j <= i (``window``
    keys including the query itself, same as HF ``sliding_window``).
    Returns [T, H*D].
    """
    T, H, D = q.shape
    L, KVH, _ = k.shape
    grp = H // KVH
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out = np.zeros((T, H, D))
    j = np.arange(L)
    for hh in range(H):
        kh = k[:, hh // grp].astype(np.float64)
        vh = v[:, hh // grp].astype(np.float64)
        s = scale * (q[:, hh].astype(np.float64) @ kh.T)  # [T, L]
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        mask = j[None, :] <= np.asarray(q_pos)[:, None]
        if window > 0:
            mask &= j[None, :] > np.asarray(q_pos)[:, None] - window
        s = np.where(mask, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, hh] = p @ vh
    return out.reshape(T, H * D)


def gqa_model(H, KVH, D, *, rope="none", window=-1, softcap=0.0, packed=False, scale=None, max_pos=4096):
    """One GroupQueryAttention node.

    rope: "none"   -> q/k fed as-is (caller pre-rotates, e.g. in numpy)
          "fused"  -> do_rotary=1 with cos_cache/sin_cache graph inputs
          "graph"  -> RoPE done with standard ONNX ops before GQA, positions
                      come from a ``position_ids`` int64 [B, T] input.
    """
    nodes, inits = [], []
    inputs = []
    if packed:
        inputs.append(_vi("query", TP.FLOAT, ["B", "T", (H + 2 * KVH) * D]))
    else:
        inputs += [
            _vi("query", TP.FLOAT, ["B", "T", H * D]),
            _vi("key", TP.FLOAT, ["B", "T", KVH * D]),
            _vi("value", TP.FLOAT, ["B", "T", KVH * D]),
        ]
    inputs += [
        _vi("past_key", TP.FLOAT, ["B", KVH, "S_max", D]),
        _vi("past_value", TP.FLOAT, ["B", KVH, "S_max", D]),
        _vi("seqlens_k", TP.INT32, ["B"]),
        _vi("total_sequence_length", TP.INT32, []),
    ]
    q_name, k_name, v_name = "query", ("" if packed else "key"), ("" if packed else "value")

    if rope == "graph":
        assert not packed
        inputs.append(_vi("position_ids", TP.INT64, ["B", "T"]))
        cos, sin = rope_tables(max_pos, D)
        # full-width tables [max_pos, D] = concat(cos, cos) (HF rotate_half layout)
        inits += [
            numpy_helper.from_array(np.concatenate([cos, cos], 1), "rope_cos"),
            numpy_helper.from_array(np.concatenate([sin, sin], 1), "rope_sin"),
            numpy_helper.from_array(np.array([0, 0, -1, D], np.int64), "shape_bthd"),
            numpy_helper.from_array(np.array([0, 0, -1], np.int64), "shape_bth"),
            numpy_helper.from_array(np.array([2], np.int64), "ax2"),
            numpy_helper.from_array(np.array([D // 2], np.int64), "split_half"),
        ]
        nodes += [
            oh.make_node("Gather", ["rope_cos", "position_ids"], ["cos_btd"]),
            oh.make_node("Gather", ["rope_sin", "position_ids"], ["sin_btd"]),
            oh.make_node("Unsqueeze", ["cos_btd", "ax2"], ["cos_b"]),  # [B,T,1,D]
            oh.make_node("Unsqueeze", ["sin_btd", "ax2"], ["sin_b"]),
        ]
        for src in ("query", "key"):
            nodes += [
                oh.make_node("Reshape", [src, "shape_bthd"], [f"{src}_4d"]),
                oh.make_node("Split", [f"{src}_4d", "split_half_2"], [f"{src}_x1", f"{src}_x2"], axis=-1),
                oh.make_node("Neg", [f"{src}_x2"], [f"{src}_nx2"]),
                oh.make_node("Concat", [f"{src}_nx2", f"{src}_x1"], [f"{src}_rot"], axis=-1),
                oh.make_node("Mul", [f"{src}_4d", "cos_b"], [f"{src}_c"]),
                oh.make_node("Mul", [f"{src}_rot", "sin_b"], [f"{src}_s"]),
                oh.make_node("Add", [f"{src}_c", f"{src}_s"], [f"{src}_r4d"]),
                oh.make_node("Reshape", [f"{src}_r4d", "shape_bth"], [f"{src}_roped"]),
            ]
        inits.append(numpy_helper.from_array(np.array([D // 2, D // 2], np.int64), "split_half_2"))
        q_name, k_name = "query_roped", "key_roped"

    gqa_inputs = [q_name, k_name, v_name, "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    if rope == "fused":
        inputs += [_vi("cos_cache", TP.FLOAT, ["M", D // 2]), _vi("sin_cache", TP.FLOAT, ["M", D // 2])]
        gqa_inputs += ["cos_cache", "sin_cache"]
    attrs = dict(num_heads=H, kv_num_heads=KVH, local_window_size=window, do_rotary=int(rope == "fused"))
    if rope == "fused":
        attrs["rotary_interleaved"] = 0
    if softcap:
        attrs["softcap"] = float(softcap)
    if scale is not None:
        attrs["scale"] = float(scale)
    nodes.append(
        oh.make_node(
            "GroupQueryAttention",
            gqa_inputs,
            ["output", "present_key", "present_value"],
            domain="com.microsoft",
            **attrs,
        )
    )
    outputs = [
        _vi("output", TP.FLOAT, ["B", "T", H * D]),
        _vi("present_key", TP.FLOAT, ["B", KVH, "S_max", D]),
        _vi("present_value", TP.FLOAT, ["B", KVH, "S_max", D]),
    ]
    return _model(nodes, inputs, outputs, inits)


class InPlaceKV:
    """Drives a GQA session with ONE max-length KV buffer bound as both
    past_* input and present_* output (the recipe from ONNX_NOTES.md)."""

    def __init__(self, sess, B, KVH, S_max, D, *, rope="none", max_pos=4096, k_np=None, v_np=None):
        self.sess = sess
        self.rope = rope
        # numpy arrays own the memory; OrtValues wrap them without copying.
        # k_np/v_np may be given, e.g. a contiguous batch-row view of a bigger cache.
        self.k_np = np.zeros((B, KVH, S_max, D), np.float32) if k_np is None else k_np
        self.v_np = np.zeros((B, KVH, S_max, D), np.float32) if v_np is None else v_np
        self.k_ov = ort.OrtValue.ortvalue_from_numpy(self.k_np)
        self.v_ov = ort.OrtValue.ortvalue_from_numpy(self.v_np)
        self.io = sess.io_binding()
        self.io.bind_ortvalue_input("past_key", self.k_ov)
        self.io.bind_ortvalue_input("past_value", self.v_ov)
        self.io.bind_ortvalue_output("present_key", self.k_ov)
        self.io.bind_ortvalue_output("present_value", self.v_ov)
        if rope == "fused":
            cos, sin = rope_tables(max_pos, D)
            self.io.bind_cpu_input("cos_cache", cos)
            self.io.bind_cpu_input("sin_cache", sin)
        self._out_cache = {}

    def step(self, q, k=None, v=None, *, seqlens_k, total, position_ids=None, run_options=None):
        """q/k/v: [B, T, *]. seqlens_k: [B] = per-sequence (total_len - 1);
        total: max total length (past + new) over the batch."""
        io = self.io
        io.bind_cpu_input("query", np.ascontiguousarray(q, np.float32))
        if k is not None:
            io.bind_cpu_input("key", np.ascontiguousarray(k, np.float32))
            io.bind_cpu_input("value", np.ascontiguousarray(v, np.float32))
        io.bind_cpu_input("seqlens_k", np.asarray(seqlens_k, np.int32))
        io.bind_cpu_input("total_sequence_length", np.array(total, np.int32))
        if self.rope == "graph":
            io.bind_cpu_input("position_ids", np.asarray(position_ids, np.int64))
        # pre-bound, reused output buffer per shape: no allocation per step
        shape = (q.shape[0], q.shape[1], self.sess.get_outputs()[0].shape[2])
        if shape not in self._out_cache:
            arr = np.empty(shape, np.float32)
            self._out_cache[shape] = (arr, ort.OrtValue.ortvalue_from_numpy(arr))
        arr, ov = self._out_cache[shape]
        io.bind_ortvalue_output("output", ov)
        if run_options is None:
            self.sess.run_with_iobinding(io)
        else:
            self.sess.run_with_iobinding(io, run_options)
        outs = io.get_outputs()  # binding order: present_key, present_value, output
        assert outs[0].data_ptr() == self.k_ov.data_ptr() == self.k_np.ctypes.data
        assert outs[1].data_ptr() == self.v_ov.data_ptr() == self.v_np.ctypes.data
        assert outs[2].data_ptr() == arr.ctypes.data
        return arr.copy()


def _rand_seq(rng, L, H, KVH, D, B=1):
    q = rng.standard_normal((B, L, H, D), dtype=np.float32)
    k = rng.standard_normal((B, L, KVH, D), dtype=np.float32)
    v = rng.standard_normal((B, L, KVH, D), dtype=np.float32)
    return q, k, v


def _feed(q, k, v, lo, hi, packed, rope, max_pos=4096):
    """Slice tokens [lo, hi) of one sequence (q: [L,H,D]) into GQA inputs."""
    qs, ks, vs = q[lo:hi], k[lo:hi], v[lo:hi]
    T = hi - lo
    if rope == "none":
        # "RoPE outside" done in numpy: pre-rotate at absolute positions
        cos, sin = rope_tables(max_pos, q.shape[-1])
        pos = np.arange(lo, hi)
        qs = np_rope(qs, pos, cos, sin).astype(np.float32)
        ks = np_rope(ks, pos, cos, sin).astype(np.float32)
    if packed:
        qkv = np.concatenate([qs.reshape(T, -1), ks.reshape(T, -1), vs.reshape(T, -1)], -1)
        return dict(q=qkv[None])
    return dict(q=qs.reshape(1, T, -1), k=ks.reshape(1, T, -1), v=vs.reshape(1, T, -1))


def _reference(q, k, v, lo, hi, window=-1, softcap=0.0, scale=None, max_pos=4096):
    """Reference output for queries [lo, hi) of one sequence; q/k get RoPE at
    absolute positions (every GQA_CASES variant applies RoPE somewhere)."""
    cos, sin = rope_tables(max_pos, q.shape[-1])
    pos = np.arange(hi)
    qr, kr = np_rope(q[:hi], pos, cos, sin), np_rope(k[:hi], pos, cos, sin)
    return np_attention(qr[lo:hi], kr, v[:hi].astype(np.float64), np.arange(lo, hi), window, softcap, scale)


GQA_CASES = [
    # id, packed, rope, window, softcap
    ("separate-ropeNumpy", False, "none", -1, 0.0),
    ("separate-ropeFused", False, "fused", -1, 0.0),
    ("separate-ropeGraph", False, "graph", -1, 0.0),
    ("packed-ropeFused", True, "fused", -1, 0.0),
    ("packed-ropeNumpy-window4", True, "none", 4, 0.0),
    ("separate-ropeFused-window4-softcap", False, "fused", 4, 7.5),
    ("separate-ropeGraph-softcap", False, "graph", -1, 2.0),
]


def _chunk_driver(case, chunks, S_max=32, H=4, KVH=2, D=16, seed=0, scale=None):
    """Run a sequence through GQA as a list of chunk lengths; check every chunk's
    output against the reference and the cache contents after each call."""
    _, packed, rope, window, softcap = case
    sess = _session(gqa_model(H, KVH, D, rope=rope, window=window, softcap=softcap, packed=packed, scale=scale))
    drv = InPlaceKV(sess, 1, KVH, S_max, D, rope=rope)
    L = sum(chunks)
    rng = np.random.default_rng(seed)
    q, k, v = (a[0] for a in _rand_seq(rng, L, H, KVH, D))
    cos, sin = rope_tables(4096, D)
    k_rot_ref = np_rope(k, np.arange(L), cos, sin)
    lo = 0
    for T in chunks:
        hi = lo + T
        feed = _feed(q, k, v, lo, hi, packed, rope)
        out = drv.step(
            **feed,
            seqlens_k=[hi - 1],  # total length - 1
            total=hi,  # past + new
            position_ids=np.arange(lo, hi)[None],
        )
        ref = _reference(q, k, v, lo, hi, window, softcap, scale)
        np.testing.assert_allclose(out[0], ref, atol=ATOL, rtol=0, err_msg=f"{case[0]} chunk {lo}:{hi}")
        # cache holds the (rotated) keys / raw values at absolute positions [0, hi)
        np.testing.assert_allclose(drv.k_np[0, :, :hi].transpose(1, 0, 2), k_rot_ref[:hi], atol=ATOL)
        np.testing.assert_array_equal(drv.v_np[0, :, :hi].transpose(1, 0, 2), v[:hi])
        assert not drv.k_np[0, :, hi:].any() and not drv.v_np[0, :, hi:].any(), "wrote past total length"
        lo = hi
    return drv


@pytest.mark.parametrize("case", GQA_CASES, ids=[c[0] for c in GQA_CASES])
def test_gqa_inplace_prefill_then_decode(case):
    # prefill 7 tokens, then 6 single-token decode steps, one shared buffer
    _chunk_driver(case, [7, 1, 1, 1, 1, 1, 1])


@pytest.mark.parametrize("case", GQA_CASES, ids=[c[0] for c in GQA_CASES])
def test_gqa_chunked_prefill(case):
    # first prompt of 6, then chunks of 5 and 3 appended after cached tokens
    # (past P>0, T>1), then decode. seqlens_k = P+T-1, total = P+T.
    _chunk_driver(case, [6, 5, 3, 1, 1, 4, 1])


def test_gqa_chunked_prefill_from_empty_cache_and_custom_scale():
    # chunks of 1 from the very beginning (first "decode" with total=1 is a
    # first prompt), then chunk of 2 and custom scale (Gemma query_pre_attn_scalar)
    _chunk_driver(("c", False, "fused", -1, 0.0), [1, 2, 1, 5], scale=0.3)


def test_gqa_chunked_prefill_rules():
    H, KVH, D, S_max = 4, 2, 16, 32
    rng = np.random.default_rng(1)

    # (a) chunk with batch > 1 and past context is rejected
    sess = _session(gqa_model(H, KVH, D))
    drv = InPlaceKV(sess, 2, KVH, S_max, D)
    q, k, v = _rand_seq(rng, 3, H, KVH, D, B=2)
    with pytest.raises(Exception) as ei:
        drv.step(q.reshape(2, 3, -1), k.reshape(2, 3, -1), v.reshape(2, 3, -1), seqlens_k=[5, 5], total=6)
    print("\n[chunk, B=2] ->", type(ei.value).__name__, str(ei.value).splitlines()[0][:200])
    assert "batch_size must be 1" in str(ei.value)

    # (b) total_sequence_length == T with past in cache: treated as a FIRST
    # prompt -> the past is ignored (attends only within the chunk) and the
    # chunk is written at positions [0, T) regardless of seqlens_k.
    sess = _session(gqa_model(H, KVH, D))
    drv = InPlaceKV(sess, 1, KVH, S_max, D)
    q, k, v = (a[0] for a in _rand_seq(rng, 8, H, KVH, D))
    drv.step(q[None, :5].reshape(1, 5, -1), k[None, :5].reshape(1, 5, -1), v[None, :5].reshape(1, 5, -1),
             seqlens_k=[4], total=5)
    out = drv.step(q[None, 5:8].reshape(1, 3, -1), k[None, 5:8].reshape(1, 3, -1), v[None, 5:8].reshape(1, 3, -1),
                   seqlens_k=[7], total=3)
    ref_isolated = np_attention(q[5:8], k[5:8], v[5:8], np.arange(3))
    np.testing.assert_allclose(out[0], ref_isolated, atol=ATOL)
    np.testing.assert_array_equal(drv.k_np[0, :, :3].transpose(1, 0, 2), k[5:8])

    # (c) per-sequence past length and RoPE positions come from seqlens_k only;
    #     total_sequence_length only has to satisfy T < total <= S_max for a
    #     chunk (== T means "first prompt", > S_max makes present_* grow past the
    #     bound buffer -> error). Recommended: total = max_b(P_b + T).
    ok, errors = [], []
    for total in (8, 9, 20, S_max, 4, S_max + 1):
        drv = InPlaceKV(sess, 1, KVH, S_max, D)
        drv.step(q[None, :5].reshape(1, 5, -1), k[None, :5].reshape(1, 5, -1), v[None, :5].reshape(1, 5, -1),
                 seqlens_k=[4], total=5)
        try:
            out = drv.step(q[None, 5:8].reshape(1, 3, -1), k[None, 5:8].reshape(1, 3, -1),
                           v[None, 5:8].reshape(1, 3, -1), seqlens_k=[7], total=total)
        except Exception as e:  # noqa: BLE001
            errors.append(total)
            print(f"[chunk P=5 T=3 total={total}] ->", str(e).split("Status Message: ")[-1][:150])
            continue
        np.testing.assert_allclose(out[0], np_attention(q[5:8], k[:8], v[:8], np.arange(5, 8)), atol=ATOL)
        ok.append(total)
    print("[chunk P=5 T=3] total_sequence_length values giving exact results:", ok)
    assert ok == [8, 9, 20, S_max, 4] and errors == [S_max + 1]


def test_gqa_rewind_overwrites_in_place():
    """Rolling back = just pass a smaller seqlens_k/total: the op writes new
    K/V at position seqlens_k+1-T and ignores stale rows beyond it."""
    H, KVH, D, S_max = 4, 2, 16, 32
    sess = _session(gqa_model(H, KVH, D, rope="fused"))
    drv = InPlaceKV(sess, 1, KVH, S_max, D, rope="fused")
    rng = np.random.default_rng(2)
    q, k, v = (a[0] for a in _rand_seq(rng, 12, H, KVH, D))
    drv.step(**_feed(q, k, v, 0, 10, False, "fused"), seqlens_k=[9], total=10)
    # rewind to 6 tokens, feed a different continuation of 3 tokens
    q2, k2, v2 = (a[0] for a in _rand_seq(rng, 12, H, KVH, D))
    qn, kn, vn = np.concatenate([q[:6], q2[6:9]]), np.concatenate([k[:6], k2[6:9]]), np.concatenate([v[:6], v2[6:9]])
    out = drv.step(**_feed(qn, kn, vn, 6, 9, False, "fused"), seqlens_k=[8], total=9)
    np.testing.assert_allclose(out[0], _reference(qn, kn, vn, 6, 9), atol=ATOL)


def test_gqa_ragged_batch_decode_with_per_sequence_prefill():
    """Prefill each sequence separately through a contiguous batch-slice view
    of the shared cache, then decode the whole batch with ragged seqlens_k."""
    H, KVH, D, S_max, B = 4, 2, 16, 32, 2
    model = gqa_model(H, KVH, D, rope="fused")
    sess = _session(model)
    big = InPlaceKV(sess, B, KVH, S_max, D, rope="fused")
    rng = np.random.default_rng(3)
    lens = [9, 4]
    seqs = [tuple(a[0] for a in _rand_seq(rng, 12, H, KVH, D)) for _ in range(B)]
    for b, L in enumerate(lens):
        # row b of the shared cache is a contiguous view -> bind it on its own
        sub = InPlaceKV(sess, 1, KVH, S_max, D, rope="fused",
                        k_np=big.k_np[b : b + 1], v_np=big.v_np[b : b + 1])
        q, k, v = seqs[b]
        sub.step(**_feed(q, k, v, 0, L, False, "fused"), seqlens_k=[L - 1], total=L)
    for _ in range(3):  # batched decode, different past lengths per row
        feeds = [_feed(*seqs[b], lens[b], lens[b] + 1, False, "fused") for b in range(B)]
        qb = np.concatenate([f["q"] for f in feeds])
        kb = np.concatenate([f["k"] for f in feeds])
        vb = np.concatenate([f["v"] for f in feeds])
        out = big.step(qb, kb, vb, seqlens_k=lens, total=max(lens) + 1)
        for b in range(B):
            ref = _reference(*seqs[b], lens[b], lens[b] + 1)
            np.testing.assert_allclose(out[b], ref, atol=ATOL)
        lens = [n + 1 for n in lens]


def test_gqa_sliding_window_convention():
    """local_window_size=W: a query at i sees keys (i-W, i] = W keys including
    itself, i.e. HF ``sliding_window`` maps 1:1 (NOT W+1 keys as in older ORT
    CPU kernels). Checked for prompt and decode."""
    H, KVH, D, W = 2, 1, 16, 3
    sess = _session(gqa_model(H, KVH, D, window=W))
    drv = InPlaceKV(sess, 1, KVH, 16, D)
    rng = np.random.default_rng(4)
    q, k, v = (a[0] for a in _rand_seq(rng, 10, H, KVH, D))
    out = drv.step(q[None].reshape(1, 10, -1), k[None].reshape(1, 10, -1), v[None].reshape(1, 10, -1),
                   seqlens_k=[9], total=10)
    good = np_attention(q, k, v, np.arange(10), window=W)
    bad = np_attention(q, k, v, np.arange(10), window=W + 1)  # would be "W+1 keys"
    np.testing.assert_allclose(out[0], good, atol=ATOL)
    assert np.abs(out[0] - bad).max() > 1e-3
    drv2 = InPlaceKV(sess, 1, KVH, 16, D)
    dec = [drv2.step(q[None, i : i + 1].reshape(1, 1, -1), k[None, i : i + 1].reshape(1, 1, -1),
                     v[None, i : i + 1].reshape(1, 1, -1), seqlens_k=[i], total=i + 1)[0] for i in range(10)]
    np.testing.assert_allclose(np.concatenate(dec), good, atol=ATOL)


@pytest.mark.parametrize("capacity", [4, 6])
def test_gqa_sliding_window_cache(capacity):
    """ORT 1.31 CPU: sliding_window_cache=1 lets a local (Gemma 3 sliding)
    layer use a window-sized in-place buffer [B, KVH, C, D] with C >= window.
    Multi-token chunks of any length (even > C) work; rows [0, L) hold the
    most recent L positions, L = T if T <= C else T - G*ceil((T-C)/G), G=C-W+1."""
    H, KVH, D, W = 4, 2, 16, 4
    m = gqa_model(H, KVH, D, rope="fused", window=W)
    m.graph.node[-1].attribute.append(oh.make_attribute("sliding_window_cache", 1))
    sess = _session(m)
    rng = np.random.default_rng(5)
    L = 20
    q, k, v = (a[0] for a in _rand_seq(rng, L, H, KVH, D))
    cos, sin = rope_tables(4096, D)
    qr, kr = np_rope(q, np.arange(L), cos, sin), np_rope(k, np.arange(L), cos, sin)
    for chunks in ([1] * L, [3, 1, 1, 5, 1, 1, 1, 7], [8, 1, 1, 10]):
        drv = InPlaceKV(sess, 1, KVH, capacity, D, rope="fused")
        lo = 0
        for T in chunks:
            hi = lo + T
            out = drv.step(**_feed(q, k, v, lo, hi, False, "fused"), seqlens_k=[hi - 1], total=hi)
            ref = np_attention(qr[lo:hi], kr[:hi], v[:hi], np.arange(lo, hi), window=W)
            np.testing.assert_allclose(out[0], ref, atol=ATOL)
            G = capacity - W + 1
            resident = hi if hi <= capacity else hi - G * (-(-(hi - capacity) // G))
            np.testing.assert_allclose(drv.k_np[0, :, :resident].transpose(1, 0, 2), kr[hi - resident : hi], atol=ATOL)
            lo = hi


# ----------------------------------------------------------------------------
# decode cost vs S_max
# ----------------------------------------------------------------------------


def _decode_time(S_max, live, H=14, KVH=2, D=64, shared=True, iters=300):
    sess = _session(gqa_model(H, KVH, D, rope="fused"), threads=1)
    rng = np.random.default_rng(0)
    drv = InPlaceKV(sess, 1, KVH, S_max, D, rope="fused")
    drv.k_np[:, :, :live] = rng.standard_normal((1, KVH, live, D))
    drv.v_np[:, :, :live] = rng.standard_normal((1, KVH, live, D))
    q = rng.standard_normal((1, 1, H * D), dtype=np.float32)
    kv = rng.standard_normal((1, 1, KVH * D), dtype=np.float32)
    io = drv.io
    io.bind_cpu_input("query", q)
    io.bind_cpu_input("key", kv)
    io.bind_cpu_input("value", kv)
    # decoding always at the same position (rewind): cost of one step at `live`
    io.bind_cpu_input("seqlens_k", np.array([live], np.int32))
    io.bind_cpu_input("total_sequence_length", np.array(live + 1, np.int32))
    out = np.empty((1, 1, H * D), np.float32)
    io.bind_ortvalue_output("output", ort.OrtValue.ortvalue_from_numpy(out))
    if not shared:  # separate present buffers: ORT allocates + copies every step
        io.bind_output("present_key")
        io.bind_output("present_value")
    return _bench(lambda: sess.run_with_iobinding(io), iters)


# ----------------------------------------------------------------------------
# quantized matmuls
# ----------------------------------------------------------------------------


def quantize_nbits(w: np.ndarray, bits: int, block: int, symmetric: bool):
    """Quantize weight w [K, N] for com.microsoft.MatMulNBits.

    Returns (B uint8 [N, n_blocks, block*bits/8], scales f32 [N, n_blocks],
    zero_points uint8 packed [N, ceil(n_blocks*bits/8)] or None, dequantized [K, N]).
    Values are packed along K within each block, little-end first (for 4 bits
    element 2i -> low nibble, 2i+1 -> high nibble)."""
    K, N = w.shape
    nb = -(-K // block)
    wt = np.zeros((N, nb * block), np.float32)
    wt[:, :K] = w.T
    wb = wt.reshape(N, nb, block)
    qmax = (1 << bits) - 1
    if symmetric:  # default zero point 2^(bits-1)
        zp = np.full((N, nb), 1 << (bits - 1), np.int32)
        amax = np.abs(wb).max(-1)
        scale = amax / (1 << (bits - 1))
        scale[scale == 0] = 1.0
    else:
        mn, mx = np.minimum(wb.min(-1), 0), np.maximum(wb.max(-1), 0)
        scale = (mx - mn) / qmax
        scale[scale == 0] = 1.0
        zp = np.clip(np.round(-mn / scale), 0, qmax).astype(np.int32)
    q = np.clip(np.round(wb / scale[..., None]) + zp[..., None], 0, qmax).astype(np.uint8)
    deq = ((q.astype(np.float32) - zp[..., None]) * scale[..., None]).reshape(N, -1)[:, :K].T
    if bits == 8:
        packed = q
        zpp = zp.astype(np.uint8)
    elif bits == 4:
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        zpad = np.zeros((N, nb + (nb & 1)), np.uint8)
        zpad[:, :nb] = zp
        zpp = (zpad[:, 0::2] | (zpad[:, 1::2] << 4)).astype(np.uint8)
    else:
        raise ValueError(bits)
    return packed, scale.astype(np.float32), (None if symmetric else zpp), deq.astype(np.float32)


def matmulnbits_model(w, bits, block=32, symmetric=False, accuracy_level=0):
    K, N = w.shape
    B, scales, zp, deq = quantize_nbits(w, bits, block, symmetric)
    inits = [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales, "scales")]
    ins = ["A", "B", "scales"]
    if zp is not None:
        inits.append(numpy_helper.from_array(zp, "zp"))
        ins.append("zp")
    node = oh.make_node("MatMulNBits", ins, ["Y"], domain="com.microsoft", K=K, N=N, bits=bits,
                        block_size=block, accuracy_level=accuracy_level)
    m = _model([node], [_vi("A", TP.FLOAT, ["M", K])], [_vi("Y", TP.FLOAT, ["M", N])], inits)
    return m, deq


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [False, True], ids=["zp", "nozp"])
@pytest.mark.parametrize("K", [576, 100])  # 100: K not a multiple of block_size
def test_matmulnbits_layout(bits, symmetric, K):
    rng = np.random.default_rng(bits + K)
    N = 96
    w = rng.standard_normal((K, N), dtype=np.float32) * 0.05
    m, deq = matmulnbits_model(w, bits, 32, symmetric)
    sess = _session(m)
    a = rng.standard_normal((3, K), dtype=np.float32)
    y = sess.run(None, {"A": a})[0]
    ref = a.astype(np.float64) @ deq.astype(np.float64)
    np.testing.assert_allclose(y, ref, atol=1e-4, rtol=1e-4)
    # sanity: quantization error vs the fp32 weight is as expected for the bit width
    err = np.abs(y - a @ w).max() / np.abs(a @ w).max()
    assert err < (0.15 if bits == 4 else 0.01)


def test_matmulnbits_bias_is_a_runtime_input_of_shape_n():
    """The bias slot (input 5) may be a graph input, read at run time, but only as [N]: one row's
    correction. The int4 emitter's per-row block-offset term [.., T, N] therefore stays an Add."""
    rng = np.random.default_rng(5)
    K, N = 64, 48
    B, scales, _, deq = quantize_nbits(rng.standard_normal((K, N), dtype=np.float32), 4, 32, True)

    def model(bias_shape):
        node = oh.make_node("MatMulNBits", ["A", "B", "scales", "", "", "bias"], ["Y"], domain="com.microsoft",
                            K=K, N=N, bits=4, block_size=32)
        return _model([node], [_vi("A", TP.FLOAT, ["M", K]), _vi("bias", TP.FLOAT, bias_shape)],
                      [_vi("Y", TP.FLOAT, ["M", N])],
                      [numpy_helper.from_array(B, "B"), numpy_helper.from_array(scales, "scales")])

    a = rng.standard_normal((3, K), dtype=np.float32)
    bias = rng.standard_normal(N).astype(np.float32)
    y = _session(model([N])).run(None, {"A": a, "bias": bias})[0]
    np.testing.assert_allclose(y, a @ deq + bias, atol=1e-4, rtol=1e-4)
    with pytest.raises(Exception, match="bias shape must be"):
        _session(model(["M", N]))


def _q8_per_channel(w):
    scale = (np.abs(w).max(0) / 127.0).astype(np.float32)  # [N]
    wq = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    return wq, scale


def _quant_variant_nodes(kind, w, i):
    """Nodes + initializers computing Y{i} = A @ quant(w) for one variant."""
    K, N = w.shape
    A, Y = "A", f"Y{i}"
    if kind == "fp32 MatMul":
        return [oh.make_node("MatMul", [A, f"W{i}"], [Y])], [numpy_helper.from_array(w, f"W{i}")], w
    if kind.startswith("MatMulNBits"):
        bits, acc = int(kind.split("bits=")[1][0]), int(kind.split("acc=")[1][0])
        Bq, scales, zp, deq = quantize_nbits(w, bits, 32, symmetric=False)
        inits = [numpy_helper.from_array(Bq, f"B{i}"), numpy_helper.from_array(scales, f"S{i}"),
                 numpy_helper.from_array(zp, f"Z{i}")]
        node = oh.make_node("MatMulNBits", [A, f"B{i}", f"S{i}", f"Z{i}"], [Y], domain="com.microsoft",
                            K=K, N=N, bits=bits, block_size=32, accuracy_level=acc)
        return [node], inits, deq
    wq, sc = _q8_per_channel(w)
    deq8 = wq.astype(np.float32) * sc
    inits = [numpy_helper.from_array(wq, f"Wq{i}"), numpy_helper.from_array(sc, f"Ws{i}")]
    if kind == "int8/ch DequantizeLinear(axis=1)+MatMul":
        nodes = [oh.make_node("DequantizeLinear", [f"Wq{i}", f"Ws{i}"], [f"W{i}"], axis=1),
                 oh.make_node("MatMul", [A, f"W{i}"], [Y])]
    elif kind == "int8/ch DynamicQuantizeMatMul":
        inits.append(numpy_helper.from_array(np.zeros(N, np.int8), f"Wz{i}"))
        nodes = [oh.make_node("DynamicQuantizeMatMul", [A, f"Wq{i}", f"Ws{i}", f"Wz{i}"], [Y], domain="com.microsoft")]
    elif kind == "int8/ch DynQuantLinear+MatMulInteger":
        nodes = [
            oh.make_node("DynamicQuantizeLinear", [A], [f"Aq{i}", f"As{i}", f"Azp{i}"]),
            oh.make_node("MatMulInteger", [f"Aq{i}", f"Wq{i}", f"Azp{i}"], [f"Yi{i}"]),
            oh.make_node("Cast", [f"Yi{i}"], [f"Yf{i}"], to=TP.FLOAT),
            oh.make_node("Mul", [f"As{i}", f"Ws{i}"], [f"Sc{i}"]),
            oh.make_node("Mul", [f"Yf{i}", f"Sc{i}"], [Y]),
        ]
    else:
        raise KeyError(kind)
    return nodes, inits, deq8


QUANT_KINDS = [
    "fp32 MatMul",
    "MatMulNBits bits=4 acc=0",
    "MatMulNBits bits=4 acc=4",
    "MatMulNBits bits=8 acc=0",
    "MatMulNBits bits=8 acc=4",
    "int8/ch DequantizeLinear(axis=1)+MatMul",
    "int8/ch DynamicQuantizeMatMul",
    "int8/ch DynQuantLinear+MatMulInteger",
]


def _quant_model(kind, weights):
    K, N = weights[0].shape
    nodes, inits, deqs = [], [], []
    for i, w in enumerate(weights):
        n, ini, d = _quant_variant_nodes(kind, w, i)
        nodes += n
        inits += ini
        deqs.append(d)
    outs = [_vi(f"Y{i}", TP.FLOAT, [1, N]) for i in range(len(weights))]
    return _model(nodes, [_vi("A", TP.FLOAT, [1, K])], outs, inits), deqs


def test_ort_rewrites_int8_patterns():
    """What ORT's optimizer turns the int8 weight-only patterns into."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((576, 256), dtype=np.float32)
    seen = {}
    for kind in ("int8/ch DequantizeLinear(axis=1)+MatMul", "int8/ch DynQuantLinear+MatMulInteger"):
        m, _ = _quant_model(kind, [w])
        so = ort.SessionOptions()
        so.log_severity_level = 3
        with_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"litekv_opt_{os.getpid()}.onnx")
        so.optimized_model_filepath = with_path
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        om = onnx.load(with_path)
        os.remove(with_path)
        seen[kind] = [(n.op_type, {a.name: oh.get_attribute_value(a) for a in n.attribute}) for n in om.graph.node]
        print(f"\n[optimizer] {kind} -> {seen[kind]}")
    dq = seen["int8/ch DequantizeLinear(axis=1)+MatMul"]
    assert [op for op, _ in dq] == ["MatMulNBits"]
    assert dq[0][1]["bits"] == 8 and dq[0][1]["accuracy_level"] == 4
    assert [op for op, _ in seen["int8/ch DynQuantLinear+MatMulInteger"]] == ["DynamicQuantizeMatMul"]


# ----------------------------------------------------------------------------
# cancellation
# ----------------------------------------------------------------------------


def _slow_model(n_layers=400, dim=512):
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "X"
    for i in range(n_layers):
        inits.append(numpy_helper.from_array((rng.standard_normal((dim, dim)) / np.sqrt(dim)).astype(np.float32), f"W{i}"))
        nodes.append(oh.make_node("MatMul", [x, f"W{i}"], [f"H{i}"]))
        nodes.append(oh.make_node("Tanh", [f"H{i}"], [f"T{i}"]))
        x = f"T{i}"
    nodes.append(oh.make_node("Identity", [x], ["Y"]))
    return _model(nodes, [_vi("X", TP.FLOAT, ["N", dim])], [_vi("Y", TP.FLOAT, ["N", dim])], inits)


def test_run_options_terminate():
    sess = _session(_slow_model())
    x = np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32)
    t0 = time.perf_counter()
    full = sess.run(None, {"X": x})[0]
    t_full = time.perf_counter() - t0

    for mode in ("run", "run_with_iobinding"):
        ro = ort.RunOptions()
        timer = threading.Timer(t_full * 0.2, lambda: setattr(ro, "terminate", True))
        timer.start()
        t0 = time.perf_counter()
        with pytest.raises(Exception) as ei:
            if mode == "run":
                sess.run(None, {"X": x}, ro)
            else:
                io = sess.io_binding()
                io.bind_cpu_input("X", x)
                io.bind_output("Y")
                sess.run_with_iobinding(io, ro)
        t_cancel = time.perf_counter() - t0
        timer.join()
        e = ei.value
        print(f"\n[terminate via {mode}] full run {t_full*1e3:.0f} ms, cancelled after {t_cancel*1e3:.0f} ms: "
              f"{type(e).__module__}.{type(e).__name__}: {str(e).strip()[:160]!r}")
        assert t_cancel < t_full * 0.8
        # run -> onnxruntime_pybind11_state.Fail ("[ONNXRuntimeError] : 1 : FAIL : Exiting due to
        # terminate flag being set to true."); run_with_iobinding -> builtins.RuntimeError
        # ("Error in execution: Exiting due to terminate flag being set to true.").
        expected = ort.capi.onnxruntime_pybind11_state.Fail if mode == "run" else RuntimeError
        assert type(e) is expected
        assert "Exiting due to terminate flag being set to true" in str(e)
        # the same RunOptions object stays "terminated" until reset; the session is fine
        with pytest.raises(Exception, match="terminate flag"):
            sess.run(None, {"X": x}, ro)
        ro.terminate = False
        np.testing.assert_allclose(sess.run(None, {"X": x}, ro)[0], full, atol=1e-5)
        np.testing.assert_allclose(sess.run(None, {"X": x})[0], full, atol=1e-5)


# ----------------------------------------------------------------------------
# external data
# ----------------------------------------------------------------------------


def test_external_data(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 128), dtype=np.float32)
    nbits, deq = matmulnbits_model(w, 4)
    nbits.graph.node.append(oh.make_node("MatMul", ["Y", "W2"], ["Z"]))
    w2 = rng.standard_normal((128, 64), dtype=np.float32)
    nbits.graph.initializer.append(numpy_helper.from_array(w2, "W2"))
    nbits.graph.output[0].CopyFrom(_vi("Z", TP.FLOAT, ["M", 64]))
    path = tmp_path / "sub" / "model.onnx"
    path.parent.mkdir()
    onnx.save_model(nbits, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0)
    assert (path.parent / "model.onnx.data").stat().st_size > 0
    assert path.stat().st_size < 2000
    a = rng.standard_normal((2, 256), dtype=np.float32)
    z = _session(str(path)).run(None, {"A": a})[0]
    np.testing.assert_allclose(z, (a.astype(np.float64) @ deq) @ w2, rtol=1e-4, atol=1e-3)
    # loading the proto from bytes fails: external paths are resolved relative
    # to the model file, so always load by path
    with pytest.raises(Exception) as ei:
        _session(onnx.load(str(path), load_external_data=False))
    print("\n[external data from bytes] ->", type(ei.value).__name__, str(ei.value).splitlines()[0][:160])


# ----------------------------------------------------------------------------
# IO binding overhead and pre-bound outputs
# ----------------------------------------------------------------------------


def test_iobinding_overhead_and_prebound_outputs():
    m = _model([oh.make_node("Add", ["X", "One"], ["Y"])], [_vi("X", TP.FLOAT, [1, 8])], [_vi("Y", TP.FLOAT, [1, 8])],
               [numpy_helper.from_array(np.ones((1, 8), np.float32), "One")])
    sess = _session(m)
    x = np.arange(8, dtype=np.float32)[None]
    x_ov = ort.OrtValue.ortvalue_from_numpy(x)
    y = np.zeros((1, 8), np.float32)
    y_ov = ort.OrtValue.ortvalue_from_numpy(y)
    assert y_ov.data_ptr() == y.ctypes.data  # wraps, no copy

    io = sess.io_binding()
    io.bind_ortvalue_input("X", x_ov)
    io.bind_ortvalue_output("Y", y_ov)
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(y, x + 1)  # result landed in OUR numpy buffer
    x[0, 0] = 100.0  # inputs bound via ortvalue_from_numpy alias numpy too
    sess.run_with_iobinding(io)
    assert y[0, 0] == 101.0 and io.get_outputs()[0].data_ptr() == y.ctypes.data

    t_prebound = _bench(lambda: sess.run_with_iobinding(io), 3000)

    io2 = sess.io_binding()
    io2.bind_ortvalue_input("X", x_ov)
    io2.bind_output("Y")  # ORT allocates the output each run
    t_alloc = _bench(lambda: sess.run_with_iobinding(io2), 3000)

    def rebind():
        io.bind_cpu_input("X", x)
        io.bind_ortvalue_output("Y", y_ov)
        sess.run_with_iobinding(io)

    t_rebind = _bench(rebind, 3000)
    t_run = _bench(lambda: sess.run(["Y"], {"X": x}), 3000)
    print(f"\n[trivial graph] run_with_iobinding pre-bound {t_prebound*1e6:.1f} us | ORT-allocated output "
          f"{t_alloc*1e6:.1f} us | re-bind input+output each call {t_rebind*1e6:.1f} us | sess.run {t_run*1e6:.1f} us")
    assert t_prebound < 1e-3


# ----------------------------------------------------------------------------
# DynamicQuantizeMatMul: uint8 weight codes are exact on every CPU
# ----------------------------------------------------------------------------


def _dynamic_quantize_matmul(weights: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None):
    k, n = weights.shape
    inputs = ["A", "B", "S"] + (["Z"] if zero_points is not None else [])
    inits = [numpy_helper.from_array(weights, "B"), numpy_helper.from_array(scales, "S")]
    if zero_points is not None:
        inits.append(numpy_helper.from_array(zero_points, "Z"))
    node = oh.make_node("DynamicQuantizeMatMul", inputs, ["Y"], domain="com.microsoft")
    return _session(_model([node], [_vi("A", TP.FLOAT, ["T", k])], [_vi("Y", TP.FLOAT, ["T", n])], inits), threads=2)


def _uint8_activations(a: np.ndarray) -> tuple[np.ndarray, np.float32, int]:
    """DynamicQuantizeLinear: uint8 codes over [min(a, 0), max(a, 0)], with its scale and zero point."""
    lo, hi = min(float(a.min()), 0.0), max(float(a.max()), 0.0)
    scale = np.float32((hi - lo) / 255.0)
    zero = int(np.clip(np.rint(-lo / scale), 0, 255))
    return np.clip(np.rint(a / scale) + zero, 0, 255).astype(np.int64), scale, zero


def test_dynamic_quantize_matmul_uint8_codes_are_exact():
    """The ONNX emitter stores int8 weights as uint8 codes + 128 with a zero point of 128. MLAS then
    multiplies in its U8U8 kernel, which widens to int16 before multiplying: the product equals the
    integer arithmetic on every CPU. (Signed codes go through vpmaddubsw on CPUs without AVX-512
    VNNI, whose int16 pair sums saturate: 20 % logit errors on an AVX2 machine.) Weights that use
    the whole int8 range and activations with an outlier make saturation likely where it can occur."""
    rng = np.random.default_rng(5)
    k, n = 576, 96
    codes = rng.integers(-127, 128, (k, n)).astype(np.int64)
    codes[:, 0] = 127  # a column of extreme codes
    scales = rng.uniform(0.01, 0.02, n).astype(np.float32)
    a = rng.standard_normal((3, k)).astype(np.float32)
    a[:, 7] = 40.0
    session = _dynamic_quantize_matmul((codes + 128).astype(np.uint8), scales, np.full(n, 128, np.uint8))
    got = session.run(None, {"A": a})[0]
    qa, a_scale, a_zero = _uint8_activations(a)
    expected = ((qa - a_zero) @ codes).astype(np.float64) * a_scale * scales
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
