"""The screened fp32 LM head: an int8 screen picks the rows that can rank among the sampler's
candidates, and those rows come out exactly as the whole head computes them."""
from __future__ import annotations

import numpy as np
import pytest

from conformance import BACKENDS, MAX_CONTEXT, PREFILL_LENGTHS, bundle, checkpoint_dir, scratch_dir
from litekv import native_attention
from litekv.bundle import HEAD_KEEP_INPUT, read_manifest
from litekv.converters.convert import ConvertOptions, convert
from litekv.converters.quantize import head_screen
from litekv.executor import SamplerParams, open_executor
from litekv.sampling import CANDIDATES

pytestmark = pytest.mark.skipif(not native_attention.available(), reason="litekv's kernels are not built")
LOWEST = np.finfo(np.float32).min


def _head(rng: np.random.Generator, out: int = 4096, width: int = 192, spread: float = 1.0) -> np.ndarray:
    """Rows whose logits spread like an LM head's: a shared direction plus row noise."""
    return (rng.standard_normal((out, width)) * 0.05 + spread * rng.standard_normal((out, 1)) *
            rng.standard_normal(width) * 0.02).astype(np.float32)


@pytest.fixture(scope="module")
def kernel():
    k = native_attention.AttentionKernel(64, 4, 256, 2)
    yield k
    k.release()


def test_the_bounds_hold_for_any_input():
    rng = np.random.default_rng(1)
    w = _head(rng, 1024, 96)
    codes, scales, bounds = head_screen(w)
    for x in rng.standard_normal((50, 96)) * np.array([[0.1], [10.0]]).repeat(25, axis=0):
        exact = w.astype(np.float64) @ x
        screened = (codes.astype(np.float64) * scales[:, None]) @ x
        error = np.abs(exact - screened)
        assert (error <= bounds * np.linalg.norm(x)).all()
        assert error.max() > 0.05 * (bounds * np.linalg.norm(x)).max()  # bounds, not far above the error


@pytest.mark.parametrize("keep", [1, 5, CANDIDATES, 700])
def test_the_top_rows_are_the_whole_heads_to_the_bit(kernel, keep):
    rng = np.random.default_rng(keep)
    w = _head(rng)
    screen = head_screen(w)
    for x in rng.standard_normal((8, w.shape[1])).astype(np.float32):
        whole, rows = kernel.run_screened_head(x, w, *screen, 0)
        assert rows == w.shape[0] and (whole > LOWEST).all()
        y, computed = kernel.run_screened_head(x, w, *screen, keep)
        top = np.argsort(-whole, kind="stable")[:keep]
        assert np.array_equal(y[top], whole[top])
        exact = y > LOWEST
        assert exact.sum() == computed and computed < w.shape[0] // 2  # the screen left most rows out
        assert np.array_equal(y[exact], whole[exact])  # every computed row is the whole head's
        # no row left out could have ranked among the top `keep`
        assert whole[~exact].max() < np.sort(whole)[-keep]


def test_near_ties_compute_more_rows_and_stay_exact(kernel):
    rng = np.random.default_rng(5)
    base = rng.standard_normal(128).astype(np.float32)
    w = (base + 1e-3 * rng.standard_normal((2048, 128))).astype(np.float32)  # every logit within a hair
    screen = head_screen(w)
    x = rng.standard_normal(128).astype(np.float32)
    whole, _ = kernel.run_screened_head(x, w, *screen, 0)
    y, computed = kernel.run_screened_head(x, w, *screen, CANDIDATES)
    top = np.argsort(-whole, kind="stable")[:CANDIDATES]
    assert np.array_equal(y[top], whole[top]) and computed > 4 * CANDIDATES
    # without the bounds the screen's own top rows would be taken, and they are not the head's
    codes, scales, _ = screen
    unbounded, _ = kernel.run_screened_head(x, w, codes, scales, np.zeros(2048, np.float32), CANDIDATES)
    assert not np.array_equal(np.sort(np.nonzero(unbounded > LOWEST)[0]), np.sort(top))


def test_keep_outside_the_rows_computes_the_whole_head(kernel):
    rng = np.random.default_rng(2)
    w = _head(rng, 300, 64)
    screen = head_screen(w)
    x = rng.standard_normal(64).astype(np.float32)
    whole, _ = kernel.run_screened_head(x, w, *screen, 0)
    for keep in (-3, 300, 1000):
        y, computed = kernel.run_screened_head(x, w, *screen, keep)
        assert computed == 300 and np.array_equal(y, whole)
    assert np.allclose(whole, w @ x, rtol=1e-5, atol=1e-5)


def test_nan_activations_come_out_as_nan_logits_not_a_token(kernel):
    rng = np.random.default_rng(4)
    w = _head(rng, 500, 64)
    x = rng.standard_normal(64).astype(np.float32)
    x[7] = np.nan  # a diverged model: the whole head's logits are NaN, and so are the screened ones
    y, computed = kernel.run_screened_head(x, w, *head_screen(w), CANDIDATES)
    assert computed == 500 and np.isnan(y).all()


def test_a_head_with_infinite_weights_is_refused_at_conversion():
    from litekv.errors import ConfigError

    w = np.ones((70, 32), np.float32)
    w[3, 4] = np.inf
    with pytest.raises(ConfigError, match="--no-head-screen"):
        head_screen(w)


def _plain_bundle(backend: str):
    options = ConvertOptions(backend=backend, max_context=MAX_CONTEXT, prefill_lengths=PREFILL_LENGTHS,
                             kv_cache="fp32", head_screen=False)
    return convert(checkpoint_dir("llama"), scratch_dir("screen") / f"llama-{backend}-unscreened", options)


def _screened_counts(ex) -> tuple[int, int]:
    kernel = getattr(ex, "_attention_kernel", None) or getattr(ex, "_kernel")
    return kernel.screened_head_counts()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bundles_sample_what_the_unscreened_head_samples(backend):
    screened_path, plain_path = bundle("llama", backend), _plain_bundle(backend)
    decode = [s for s in read_manifest(screened_path).signatures if s.kind in ("decode", "step")]
    assert decode and all(HEAD_KEEP_INPUT in s.inputs for s in decode)
    assert not any(HEAD_KEEP_INPUT in s.inputs for s in read_manifest(plain_path).signatures)
    screened, plain = open_executor(screened_path), open_executor(plain_path)
    prompt = np.random.default_rng(3).integers(3, screened.config.vocab_size, 9)
    samplers = (SamplerParams(), SamplerParams(temperature=1.3, top_p=0.97, seed=11),
                SamplerParams(temperature=0.7, top_k=40, seed=2))
    for sampler in samplers:
        tokens = []
        for ex in (screened, plain):
            kv = ex.create_kv_cache()
            ex.prefill(prompt[:-1], kv)
            tokens.append(ex.sample_tokens(24, [prompt[-1]], kv, sampler=sampler))
        assert np.array_equal(*tokens)
    calls, rows = _screened_counts(screened)
    assert calls >= 3 * 24 and rows < calls * screened.config.vocab_size  # the screen ran and left rows out
    # logits asked for by the caller come from every row
    ours, theirs = screened.create_kv_cache(), plain.create_kv_cache()
    screened.prefill(prompt[:-1], ours)
    plain.prefill(prompt[:-1], theirs)
    logits = screened.step([prompt[-1]], ours)
    assert (logits > LOWEST).all() and np.array_equal(logits, plain.step([prompt[-1]], theirs))


def _onnx_head(w: np.ndarray, screen: tuple[np.ndarray, ...], bounds_rows: int | None = None) -> bytes:
    """A one-node graph, serialized: y = LinearF32Screened(x [1, width], W, the screen, keep), W and
    the screen as initializers (bounds cut to `bounds_rows` to break the contract)."""
    from onnx import TensorProto, helper, numpy_helper

    from litekv.converters.emit_onnx import KERNEL_DOMAIN

    (out, width), (codes, scales, bounds) = w.shape, screen
    names = ("weight", "codes", "row_scales", "bounds")
    arrays = (w, codes, scales, bounds[:bounds_rows or out])
    node = helper.make_node("LinearF32Screened", ["x", *names, "keep"], ["y"], domain=KERNEL_DOMAIN)
    graph = helper.make_graph([node], "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width]),
                                               helper.make_tensor_value_info("keep", TensorProto.INT32, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out])],
                              [numpy_helper.from_array(np.ascontiguousarray(a), n) for n, a in zip(names, arrays)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    model.ir_version = 10
    return model.SerializeToString()


def test_the_onnx_op_gives_the_kernels_rows_and_rejects_a_broken_contract(kernel):
    import onnxruntime as ort

    rng = np.random.default_rng(9)
    w = _head(rng, 1024, 64)
    screen = head_screen(w)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = kernel.onnx_session(_onnx_head(w, screen), options)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    for keep in (0, CANDIDATES):
        got = session.run(None, {"x": x, "keep": np.array([keep], np.int32)})[0][0]
        expected, _ = kernel.run_screened_head(x[0], w, *screen, keep)
        assert np.array_equal(got, expected)
    options = ort.SessionOptions()  # litekv's ops register once per SessionOptions
    options.intra_op_num_threads = 1
    broken = kernel.onnx_session(_onnx_head(w, screen, bounds_rows=1000), options)
    with pytest.raises(Exception, match="LinearF32Screened"):
        broken.run(None, {"x": x, "keep": np.array([CANDIDATES], np.int32)})
