"""Tests for litekv/litert_capi.py: LiteRT's C API through ctypes.

Models are built with the TFLite writer. Besides checking the binding, these tests
pin down the runtime facts it relies on: rank-N zero-copy host buffers, in-place KV
updates through a prefix view, cancellation between ops (not inside an XNNPACK
partition), CPU options passed as opaque TOML options.
"""
from __future__ import annotations

import gc
import os
import threading
import time

import numpy as np
import pytest

from litekv import litert_capi
from litekv.converters.tflite_writer import TFLiteModelWriter
from litekv.errors import (
    AcceleratorUnavailable,
    BackendError,
    BindingError,
    Cancelled,
    LitekvError,
)
from litekv.litert_capi import (
    ALIGNMENT,
    CompiledTFLiteModel,
    HostTensorBuffer,
    aligned_zeros,
    default_environment,
)

RNG = np.random.default_rng(7)


def per_call_us(fn, n: int, repeats: int = 5) -> float:
    """Best-of-``repeats`` mean time per call (the machine may be loaded)."""
    for _ in range(min(n, 50)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def buffers(**arrays) -> dict[str, HostTensorBuffer]:
    return {name: HostTensorBuffer(a) for name, a in arrays.items()}


# ------------------------------------------------------------------ models


def fc_add_model(path, W, b, x_shape):
    w = TFLiteModelWriter()
    weight = w.add_constant(W, "fc.weight")
    sg = w.add_signature("main")
    x = sg.add_input("x", x_shape)
    h = sg.tensor("h", (*x_shape[:-1], W.shape[0]))
    y = sg.tensor("y", (*x_shape[:-1], W.shape[0]))
    sg.op("FULLY_CONNECTED", [x, sg.use(weight), -1], [h], keep_num_dims=True)
    sg.op("ADD", [h, sg.const(b)], [y])
    sg.add_output("y", y)
    w.write(path)
    return path


def kv_model(path, capacities, heads, dim):
    """step_s<S>: writes ``new`` into row ``pos`` of the cache ``kv`` [1,S,H,D] in place.

    Outputs: ``kv`` (the DYNAMIC_UPDATE_SLICE result, bound to the input's buffer) and
    ``kv_sum``, the sum of the updated cache, which shows the graph read the rows that
    earlier calls left in the bound memory.
    """
    w = TFLiteModelWriter()
    for S in capacities:
        sg = w.add_signature(f"step_s{S}")
        kv = sg.add_input("kv", (1, S, heads, dim))
        new = sg.add_input("new", (1, 1, heads, dim))
        pos = sg.add_input("pos", (1,), "int32")
        zero = sg.const(np.zeros(1, np.int32))
        start = sg.tensor("start", (4,), "int32")
        sg.op("CONCATENATION", [zero, pos, zero, zero], [start], axis=0)
        out = sg.tensor("kv_out", (1, S, heads, dim))
        sg.op("DYNAMIC_UPDATE_SLICE", [kv, new, start], [out])
        total = sg.tensor("kv_sum", (1,))
        sg.op("SUM", [out, sg.const(np.arange(4, dtype=np.int32))], [total])
        sg.add_output("kv", out)
        sg.add_output("kv_sum", total)
    w.write(path)
    return path


def fc_chain_model(path, W, rows, layers, split):
    """``layers`` FULLY_CONNECTED ops sharing W. With ``split``, an identity GATHER (an
    op XNNPACK does not take) follows each FC, so every FC is its own XNNPACK partition
    and the cancellation callback is polled between them; without, XNNPACK runs the
    whole chain as one delegated op."""
    n = W.shape[0]
    w = TFLiteModelWriter()
    weight = w.add_constant(W, "w")
    sg = w.add_signature("main")
    h = sg.add_input("x", (rows, n))
    identity = sg.const(np.arange(rows, dtype=np.int32))
    for i in range(layers):
        y = sg.tensor(f"fc{i}", (rows, n))
        sg.op("FULLY_CONNECTED", [h, sg.use(weight), -1], [y])
        h = y
        if split:
            g = sg.tensor(f"gather{i}", (rows, n))
            sg.op("GATHER", [h, identity], [g], axis=0)
            h = g
    sg.add_output("y", h)
    w.write(path)
    return path


def chain_model(path, op, n_ops, shape):
    """``n_ops`` small ops in a row (CUMSUM: not delegated, so one callback poll per op)."""
    w = TFLiteModelWriter()
    sg = w.add_signature("main")
    h = sg.add_input("x", shape)
    axis = sg.const(np.array(len(shape) - 1, np.int32))
    for i in range(n_ops):
        y = sg.tensor(f"y{i}", shape)
        sg.op(op, [h, axis] if op == "CUMSUM" else [h, h], [y])
        h = y
    sg.add_output("y", h)
    w.write(path)
    return path


# ------------------------------------------------------------------- tests


def test_aligned_zeros():
    for shape, dtype, expected in [((3, 5), np.float32, (3, 5)),
                                   ((1, 7, 2, 3), np.float16, (1, 7, 2, 3)),
                                   (5, np.int32, (5,))]:
        a = aligned_zeros(shape, dtype)
        assert a.ctypes.data % ALIGNMENT == 0 and a.flags.c_contiguous
        assert a.shape == expected and a.dtype == dtype and not a.any()


def test_fc_add_matches_numpy_and_signature_introspection(tmp_path):
    W = RNG.standard_normal((16, 8)).astype(np.float32)
    b = RNG.standard_normal(16).astype(np.float32)
    path = fc_add_model(tmp_path / "fc.tflite", W, b, (1, 3, 8))

    with CompiledTFLiteModel(path) as model:
        sig = model.signature("main")
        assert list(model.signatures) == ["main"] and sig.index == 0
        assert sig.input_names == ("x",) and sig.output_names == ("y",)
        assert sig.inputs[0].shape == (1, 3, 8) and sig.inputs[0].dtype == np.float32
        assert sig.outputs[0].shape == (1, 3, 16) and sig.outputs[0].dtype == np.float32
        assert model.fully_accelerated  # FC and ADD both run on XNNPACK

        x, y = aligned_zeros((1, 3, 8)), aligned_zeros((1, 3, 16))
        bx, by = HostTensorBuffer(x), HostTensorBuffer(y)  # rank-3, zero-copy
        for _ in range(3):  # new inputs are written into the bound array, no copies
            x[:] = RNG.standard_normal(x.shape)
            model.run("main", {"x": bx}, {"y": by})
            np.testing.assert_allclose(y, x @ W.T + b, rtol=1e-5, atol=1e-5)

        step = model.bind("main", {"x": bx}, {"y": by})
        x[:] = 1.0
        step()
        np.testing.assert_allclose(y, x @ W.T + b, rtol=1e-5, atol=1e-5)


def test_in_place_kv_cache_prefix_view_then_full_capacity(tmp_path):
    S_SMALL, S_MAX, H, D = 8, 16, 2, 4
    path = kv_model(tmp_path / "kv.tflite", [S_SMALL, S_MAX], H, D)
    model = CompiledTFLiteModel(path)
    assert model.signature("step_s8").inputs[0].shape == (1, 8, 2, 4)
    assert model.signature("step_s16").outputs[0].shape == (1, 16, 2, 4)

    cache = aligned_zeros((1, S_MAX, H, D), np.float32)  # allocated once, at max capacity
    address = cache.ctypes.data
    prefix = cache[:, :S_SMALL]  # contiguous view of the first S_SMALL positions
    assert np.shares_memory(prefix, cache) and prefix.ctypes.data == address
    kv_small, kv_full = HostTensorBuffer(prefix), HostTensorBuffer(cache)
    assert kv_full.array is cache and kv_small.shape == (1, 8, 2, 4)

    new, pos, total = aligned_zeros((1, 1, H, D)), aligned_zeros((1,), np.int32), aligned_zeros((1,))
    step = buffers(new=new, pos=pos)
    kv_sum = HostTensorBuffer(total)
    expected = np.zeros_like(cache)

    def check(p):
        np.testing.assert_array_equal(cache, expected)  # numpy sees the update, no read()
        assert total[0] == pytest.approx(expected.sum(), rel=1e-5)  # graph saw old rows

    for p in range(S_SMALL):  # short context: small signature on the prefix view
        pos[0], new[:] = p, RNG.standard_normal(new.shape)
        model.run("step_s8", {"kv": kv_small, **step}, {"kv": kv_small, "kv_sum": kv_sum})
        expected[0, p] = new[0, 0]
        check(p)
    big = model.bind("step_s16", {"kv": kv_full, **step}, {"kv": kv_full, "kv_sum": kv_sum})
    for p in range(S_SMALL, S_MAX):  # longer context: big signature, same memory
        pos[0], new[:] = p, RNG.standard_normal(new.shape)
        big()
        expected[0, p] = new[0, 0]
        check(p)

    assert cache.ctypes.data == address and kv_full.array is cache  # never reallocated
    assert np.all(cache != 0)  # all 16 rows written in place
    model.close()


def test_binding_errors(tmp_path):
    path = kv_model(tmp_path / "kv.tflite", [8], 2, 4)
    model = CompiledTFLiteModel(path)
    cache = aligned_zeros((1, 8, 2, 4))
    ok = buffers(kv=cache, new=aligned_zeros((1, 1, 2, 4)), pos=aligned_zeros((1,), np.int32))
    outs = {"kv": ok["kv"], "kv_sum": HostTensorBuffer(aligned_zeros((1,)))}
    model.run("step_s8", ok, outs)  # the valid binding works

    raw = aligned_zeros(8 * 2 * 4 + 16)
    with pytest.raises(BindingError, match="aligned"):
        HostTensorBuffer(raw[1:1 + 64].reshape(1, 8, 2, 4))  # 4 bytes off
    with pytest.raises(BindingError, match="C-contiguous"):
        HostTensorBuffer(aligned_zeros((1, 8, 4, 2)).transpose(0, 1, 3, 2))
    with pytest.raises(BindingError, match="C-contiguous"):
        HostTensorBuffer(aligned_zeros((1, 16, 2, 4))[:, ::2])
    with pytest.raises(BindingError, match="dtype complex64"):
        HostTensorBuffer(aligned_zeros((2,), np.complex64))
    with pytest.raises(BindingError, match="numpy array"):
        HostTensorBuffer([1.0, 2.0])

    with pytest.raises(BindingError, match=r"'pos'.*int32\[1\].*float32\[1\]"):
        model.run("step_s8", {**ok, "pos": HostTensorBuffer(aligned_zeros((1,)))}, outs)
    with pytest.raises(BindingError, match=r"'kv'.*float32\[1, 8, 2, 4\].*float32\[1, 16, 2, 4\]"):
        big = HostTensorBuffer(aligned_zeros((1, 16, 2, 4)))
        model.run("step_s8", {**ok, "kv": big}, {**outs, "kv": big})
    with pytest.raises(BindingError, match=r"missing inputs \['pos'\]"):
        model.run("step_s8", {"kv": ok["kv"], "new": ok["new"]}, outs)
    with pytest.raises(BindingError, match=r"missing outputs \['kv_sum'\]"):
        model.run("step_s8", ok, {"kv": ok["kv"]})
    with pytest.raises(BindingError, match=r"unknown inputs \['position'\]"):
        model.run("step_s8", {**ok, "position": ok["pos"]}, outs)
    with pytest.raises(BindingError, match="no signature 'step_s16'"):
        model.run("step_s16", ok, outs)
    read_only = aligned_zeros((1,))
    read_only.flags.writeable = False
    with pytest.raises(BindingError, match="read-only"):
        model.run("step_s8", ok, {**outs, "kv_sum": HostTensorBuffer(read_only)})
    with pytest.raises(BindingError, match="HostTensorBuffer"):
        model.run("step_s8", {**ok, "pos": np.zeros(1, np.int32)}, outs)

    ok["pos"].close()  # closing a buffer of a cached binding invalidates it
    with pytest.raises(BindingError, match="closed"):
        model.run("step_s8", ok, outs)
    ok["pos"] = HostTensorBuffer(aligned_zeros((1,), np.int32))
    model.run("step_s8", ok, outs)
    model.close()
    with pytest.raises(BackendError, match="closed"):
        model.run("step_s8", ok, outs)
    assert all(issubclass(e, LitekvError) for e in (BindingError, BackendError))


def test_backend_errors_carry_status_and_message(tmp_path):
    w = TFLiteModelWriter()
    sg = w.add_signature("lookup")
    idx = sg.add_input("idx", (1,), "int32")
    row = sg.tensor("row", (1, 4))
    sg.op("GATHER", [sg.const(np.arange(12, dtype=np.float32).reshape(3, 4)), idx], [row], axis=0)
    sg.add_output("row", row)
    path = tmp_path / "gather.tflite"
    w.write(path)

    model = CompiledTFLiteModel(path)
    i, out = aligned_zeros((1,), np.int32), aligned_zeros((1, 4))
    ins, outs = buffers(idx=i), buffers(row=out)
    i[0] = 2
    model.run("lookup", ins, outs)
    np.testing.assert_array_equal(out, [[8, 9, 10, 11]])
    i[0] = 7  # out of range: the GATHER kernel fails at run time
    with pytest.raises(BackendError, match="kLiteRtStatusErrorRuntimeFailure.*gather index out of bounds") as e:
        model.run("lookup", ins, outs)
    assert e.value.status == 3
    i[0] = 0  # the model still works, and the old error message is not repeated
    model.run("lookup", ins, outs)
    np.testing.assert_array_equal(out, [[0, 1, 2, 3]])

    with pytest.raises(BackendError, match="not found"):
        CompiledTFLiteModel(tmp_path / "missing.tflite")
    (tmp_path / "garbage.tflite").write_bytes(b"not a flatbuffer" * 8)
    with pytest.raises(BackendError, match="LiteRtCreateModelFromFile.*identifier") as e:
        CompiledTFLiteModel(tmp_path / "garbage.tflite")  # the message quotes LiteRT's log
    assert e.value.status not in (None, 0)


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """Orthogonal W keeps the activations' norm over many layers; ~0.1-0.5 s per run."""
    n, rows, layers = 256, 1024, 100
    W = np.linalg.qr(RNG.standard_normal((n, n)))[0].astype(np.float32)
    x = aligned_zeros((rows, n))
    x[:] = RNG.standard_normal(x.shape)
    ref = x.astype(np.float64)
    for _ in range(layers):
        ref = ref @ W.T
    d = tmp_path_factory.mktemp("chains")
    return {"split": fc_chain_model(d / "split.tflite", W, rows, layers, split=True),
            "fused": fc_chain_model(d / "fused.tflite", W, rows, layers, split=False),
            "x": x, "ref": ref}


def test_cancel_from_another_thread_stops_between_ops(chains):
    model = CompiledTFLiteModel(chains["split"], num_threads=1)
    assert not model.fully_accelerated  # one XNNPACK partition per FC
    x, y = chains["x"], aligned_zeros(chains["x"].shape)
    run = model.bind("main", buffers(x=x), buffers(y=y))
    t0 = time.perf_counter()
    run()
    full = time.perf_counter() - t0
    np.testing.assert_allclose(y, chains["ref"], rtol=1e-3, atol=1e-3)
    print(f"\n100 FC [1024,256]x[256,256] + GATHER: {full * 1e3:.0f} ms per run")

    for attempt in range(3):
        y[:] = np.nan
        timer = threading.Timer(full / 5, model.cancel)
        t0 = time.perf_counter()
        timer.start()
        with pytest.raises(Cancelled):
            run()
        stopped = time.perf_counter() - t0
        timer.join()
        assert np.isnan(y).all()  # the last FC never ran: stopped mid-graph
        assert stopped < 0.8 * full, (stopped, full)
        assert not model.cancel_requested  # consumed by the raise
        run()  # the next run is complete and correct
        np.testing.assert_allclose(y, chains["ref"], rtol=1e-3, atol=1e-3)
        print(f"cancel after {full / 5 * 1e3:.0f} ms: Cancelled after {stopped * 1e3:.0f} ms")

    model.cancel()  # with no run in progress, the next run is cancelled at its first op
    y[:] = np.nan
    t0 = time.perf_counter()
    with pytest.raises(Cancelled):
        run()
    assert time.perf_counter() - t0 < full / 4 and np.isnan(y).all()
    model.cancel()
    model.clear_cancel()  # a dropped request does not cancel anything
    run()
    np.testing.assert_allclose(y, chains["ref"], rtol=1e-3, atol=1e-3)
    model.close()


def test_cancel_waits_for_a_running_xnnpack_partition(chains):
    """The callback is polled between ops; XNNPACK runs the whole fused FC chain as one
    op, so a cancel during it is seen only by the next run."""
    model = CompiledTFLiteModel(chains["fused"], num_threads=1)
    assert model.fully_accelerated  # a single delegated op
    x, y = chains["x"], aligned_zeros(chains["x"].shape)
    run = model.bind("main", buffers(x=x), buffers(y=y))
    t0 = time.perf_counter()
    run()
    full = time.perf_counter() - t0

    y[:] = np.nan
    timer = threading.Timer(full / 3, model.cancel)
    timer.start()
    run()  # not interrupted: the partition finishes
    timer.join()
    np.testing.assert_allclose(y, chains["ref"], rtol=1e-3, atol=1e-3)
    assert model.cancel_requested  # still pending...
    with pytest.raises(Cancelled):  # ...so the next run stops before its first op
        run()
    run()
    np.testing.assert_allclose(y, chains["ref"], rtol=1e-3, atol=1e-3)
    model.close()


class _NoCancellation(CompiledTFLiteModel):
    """Baseline for the overhead measurement: the callback is never installed."""

    def _install_cancellation(self, lib) -> None:
        pass


def test_per_call_overhead_and_cancellation_poll_cost(tmp_path):
    add = chain_model(tmp_path / "add.tflite", "ADD", 1, (1,))
    small_ops = chain_model(tmp_path / "cumsum200.tflite", "CUMSUM", 200, (1, 4, 8))
    results = {}
    for label, cls in (("without callback", _NoCancellation), ("with callback", CompiledTFLiteModel)):
        for name, path, shape in (("1 ADD", add, (1,)), ("200 CUMSUM", small_ops, (1, 4, 8))):
            model = cls(path, num_threads=1)
            x, y = aligned_zeros(shape), aligned_zeros(shape)
            ins, outs = buffers(x=x), buffers(y=y)
            bound = model.bind("main", ins, outs)
            c_args = bound._binding.args  # the bare C call, for comparison
            c_run = litert_capi._run_unchecked
            results[label, name, "C call"] = per_call_us(lambda: c_run(*c_args), 3000)
            results[label, name, "bind()()"] = per_call_us(bound, 3000)
            results[label, name, "run()"] = per_call_us(lambda: model.run("main", ins, outs), 3000)
            x[...] = 1.0
            model.run("main", ins, outs)
            expected = x.copy()
            for _ in range(200 if name == "200 CUMSUM" else 1):
                expected = np.cumsum(expected, axis=-1) if name == "200 CUMSUM" else expected * 2
            np.testing.assert_allclose(y, expected, rtol=1e-5)
            model.close()
    print()
    for (label, name, how), us in results.items():
        print(f"{name:>10s}, {label:16s}: {how:9s} {us:6.2f} us/call")
    poll_cost = (results["with callback", "200 CUMSUM", "bind()()"]
                 - results["without callback", "200 CUMSUM", "bind()()"]) / 200
    print(f"cancellation poll: {poll_cost * 1e3:.1f} ns per op")
    assert poll_cost < 0.1  # a Python callback costs ~0.2 us per op (and the GIL)
    assert results["with callback", "1 ADD", "run()"] < 100


def test_gpu_and_npu_raise_accelerator_unavailable(tmp_path):
    registered = default_environment().accelerators()
    path = fc_add_model(tmp_path / "fc.tflite", np.eye(4, dtype=np.float32),
                        np.zeros(4, np.float32), (1, 4))
    for accelerator in ("gpu", "npu"):
        if any(accelerator in kinds for kinds in registered.values()):
            continue  # this machine has one: nothing to check for it
        with pytest.raises(AcceleratorUnavailable) as e:
            CompiledTFLiteModel(path, accelerator=accelerator)
        assert e.value.accelerator == accelerator
        assert e.value.reason and "kLiteRtStatus" in e.value.reason
        assert accelerator.upper() in e.value.reason
        print(f"\n{accelerator}: {e.value.reason}")
    assert "cpu" in set().union(*registered.values())
    with pytest.raises(ValueError, match="accelerator must be one of"):
        CompiledTFLiteModel(path, accelerator="tpu")


def test_thread_count_sets_xnnpack_pool_size(tmp_path):
    W = RNG.standard_normal((64, 32)).astype(np.float32)
    path = fc_add_model(tmp_path / "fc.tflite", W, np.zeros(64, np.float32), (4, 32))
    default_environment()
    gc.collect()  # models of earlier tests must not exit their pools meanwhile

    def os_threads() -> int:
        return len(os.listdir("/proc/self/task"))

    for threads, extra in ((1, 0), (3, 2)):  # the pool adds threads - 1 workers
        before = os_threads()
        model = CompiledTFLiteModel(path, num_threads=threads)
        x, y = aligned_zeros((4, 32)), aligned_zeros((4, 64))
        x[:] = RNG.standard_normal(x.shape)
        model.run("main", buffers(x=x), buffers(y=y))
        np.testing.assert_allclose(y, x @ W.T, rtol=1e-4, atol=1e-4)
        assert os_threads() - before == extra
        model.close()
        assert os_threads() == before
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match="num_threads"):
            CompiledTFLiteModel(path, num_threads=bad)


def test_weight_cache_file_is_created_and_reused(tmp_path):
    W = RNG.standard_normal((128, 64)).astype(np.float32)
    path = fc_add_model(tmp_path / "fc.tflite", W, np.zeros(128, np.float32), (2, 64))
    cache = tmp_path / "cache" / "fc.xnnpack_cache"
    cache.parent.mkdir()
    x, y = aligned_zeros((2, 64)), aligned_zeros((2, 128))
    x[:] = RNG.standard_normal(x.shape)
    for load in range(2):  # the first load writes the cache, the second one maps it
        with CompiledTFLiteModel(path, weight_cache_path=cache) as model:
            model.run("main", buffers(x=x), buffers(y=y))
        np.testing.assert_allclose(y, x @ W.T, rtol=1e-4, atol=1e-4)
        assert cache.is_file() and cache.stat().st_size >= W.nbytes
        if load == 0:
            first = cache.stat()
    assert cache.stat().st_size == first.st_size
    with pytest.raises(ValueError, match="directory"):
        CompiledTFLiteModel(path, weight_cache_path=tmp_path)


def test_concurrent_runs_are_serialized(tmp_path):
    W = RNG.standard_normal((32, 16)).astype(np.float32)
    model = CompiledTFLiteModel(fc_add_model(tmp_path / "fc.tflite", W,
                                             np.zeros(32, np.float32), (8, 16)))
    failures = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        x, y = aligned_zeros((8, 16)), aligned_zeros((8, 32))
        ins, outs = buffers(x=x), buffers(y=y)
        for _ in range(300):
            x[:] = rng.standard_normal(x.shape)
            model.run("main", ins, outs)
            if not np.allclose(y, x @ W.T, rtol=1e-4, atol=1e-4):
                failures.append(seed)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    model.close()


def test_dropped_model_is_freed_without_gc(tmp_path):
    """run() caches bindings without a reference cycle, so a dropped model (and its
    XNNPACK thread pool, weights) goes away at once, not at the next GC."""
    path = fc_add_model(tmp_path / "fc.tflite", np.eye(4, dtype=np.float32),
                        np.zeros(4, np.float32), (1, 4))
    gc.collect()
    gc.disable()
    try:
        before = len(os.listdir("/proc/self/task"))
        model = CompiledTFLiteModel(path, num_threads=2)
        model.run("main", buffers(x=aligned_zeros((1, 4))), buffers(y=aligned_zeros((1, 4))))
        assert len(os.listdir("/proc/self/task")) == before + 1
        del model
        assert len(os.listdir("/proc/self/task")) == before
    finally:
        gc.enable()


def test_handles_are_released(tmp_path):
    path = fc_add_model(tmp_path / "fc.tflite", np.eye(4, dtype=np.float32),
                        np.zeros(4, np.float32), (1, 4))
    with HostTensorBuffer(aligned_zeros((1, 4))) as buf:
        assert not buf.closed
    assert buf.closed and buf.handle is None
    buf.close()  # idempotent
    for _ in range(50):  # dropped without close(): __del__ releases them
        model = CompiledTFLiteModel(path)
        x = HostTensorBuffer(aligned_zeros((1, 4)))
        model.run("main", {"x": x}, {"y": HostTensorBuffer(aligned_zeros((1, 4)))})
        del model, x
    gc.collect()
    with CompiledTFLiteModel(path) as model:
        pass
    with pytest.raises(BackendError, match="closed"):
        model.fully_accelerated
