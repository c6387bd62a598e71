"""An adapter built in code (a LoraAdapter, not a PEFT directory) is checked against the model before
the executor keeps it: a wrong one is a LoraError and changes nothing."""
from __future__ import annotations

import numpy as np
import pytest

from conformance import checkpoint_dir
from litekv.converters.checkpoint import load_checkpoint
from litekv.executor import LoraAdapter, LoraError
from litekv.executor.lora import projection_shape
from litekv.executor.numpy_executor import NumpyExecutor

MODEL_RANK = 4


@pytest.fixture(scope="module")
def ckpt():
    return load_checkpoint(checkpoint_dir("llama"), with_tokenizer=False)


@pytest.fixture
def ex(ckpt) -> NumpyExecutor:
    return NumpyExecutor(ckpt.config, ckpt.weights, max_context=64, lora_rank=MODEL_RANK)


def good_factors(cfg, seed: int = 0) -> dict:
    rng, factors = np.random.default_rng(seed), {}
    for layer in range(cfg.num_layers):
        for target in ("q", "v"):
            out_dim, in_dim = projection_shape(cfg, target)
            factors[(layer, target)] = ((0.1 * rng.standard_normal((MODEL_RANK, in_dim))).astype(np.float32),
                                        (0.1 * rng.standard_normal((out_dim, MODEL_RANK))).astype(np.float32))
    return factors


def logits(ex, lora_id=None) -> np.ndarray:
    cache = ex.create_kv_cache()
    ex.prefill([1, 2, 3], cache, lora_id=lora_id)
    return ex.step([4], cache, lora_id=lora_id).copy()


def test_a_prepared_adapter_that_fits_loads_and_changes_the_logits(ex):
    plain = logits(ex)
    lora_id = ex.load_lora(LoraAdapter("mine", 2, good_factors(ex.config)))
    assert not np.allclose(logits(ex, lora_id), plain)


def test_factors_below_the_models_rank_equal_them_padded_with_zeros(ex):
    """A [r, in] and B [out, r] with r below the model's LoRA rank run as if padded with zeros."""
    full = good_factors(ex.config, seed=1)
    own = {key: (a[:2].copy(), b[:, :2].copy()) for key, (a, b) in full.items()}
    padded = {key: (np.concatenate([a, np.zeros_like(a)]), np.concatenate([b, np.zeros_like(b)], axis=1))
              for key, (a, b) in own.items()}
    low, high = ex.load_lora(LoraAdapter("own", 2, own)), ex.load_lora(LoraAdapter("padded", 2, padded))
    np.testing.assert_allclose(logits(ex, low), logits(ex, high), rtol=1e-5, atol=1e-5)


def test_an_adapter_of_empty_factors_is_a_no_op(ex):
    lora_id = ex.load_lora(LoraAdapter("zeros", 1, {}))
    np.testing.assert_array_equal(logits(ex, lora_id), logits(ex))


def broken(cfg) -> dict[str, LoraAdapter]:
    factors = good_factors(cfg)
    a, b = factors[(0, "q")]
    cases = {
        "rank above the model's": LoraAdapter("x", MODEL_RANK + 1, factors),
        "rank not an int": LoraAdapter("x", 2.5, factors),
        "layer past the model": LoraAdapter("x", 2, {**factors, (cfg.num_layers, "q"): (a, b)}),
        "unknown target": LoraAdapter("x", 2, {**factors, (0, "gate"): (a, b)}),
        "A and B of different ranks": LoraAdapter("x", 2, {**factors, (0, "q"): (a[:2], b)}),
        "B transposed": LoraAdapter("x", 2, {**factors, (0, "q"): (a, b.T.copy())}),
        "float64 factors": LoraAdapter("x", 2, {**factors, (0, "q"): (a.astype(np.float64), b)}),
        "NaN": LoraAdapter("x", 2, {**factors, (0, "q"): (a, np.full_like(b, np.nan))}),
        "not a pair": LoraAdapter("x", 2, {**factors, (0, "q"): a}),
    }
    return cases


@pytest.mark.parametrize("case", [
    "rank above the model's", "rank not an int", "layer past the model", "unknown target",
    "A and B of different ranks", "B transposed", "float64 factors", "NaN", "not a pair"])
def test_a_prepared_adapter_that_does_not_fit_is_refused_and_changes_nothing(ex, case):
    before = logits(ex)
    with pytest.raises(LoraError):
        ex.load_lora(broken(ex.config)[case])
    assert ex._adapters == {}
    np.testing.assert_array_equal(logits(ex), before)


@pytest.mark.parametrize("layout", ["out_in", "in_out"])
def test_converted_models_lora_inputs_pad_factors_below_their_rank_with_zeros(ex, layout):
    """The fixed-shape LoRA inputs of LiteRT and ONNX bundles (group_factors) take factors of any
    rank up to theirs, as the numpy executor does."""
    from litekv.executor.lora import lora_inputs

    full = good_factors(ex.config, seed=2)
    own = {key: (a[:2].copy(), b[:, :2].copy()) for key, (a, b) in full.items()}
    padded = {key: (np.concatenate([a, np.zeros_like(a)]), np.concatenate([b, np.zeros_like(b)], axis=1))
              for key, (a, b) in own.items()}
    groups = {"qkv": [["q", "k", "v"], ["q", "v"]]}
    got = lora_inputs(LoraAdapter("own", 2, own), ex.config, groups, MODEL_RANK, layout)
    want = lora_inputs(LoraAdapter("padded", 2, padded), ex.config, groups, MODEL_RANK, layout)
    assert got.keys() == want.keys()
    for name in got:
        np.testing.assert_array_equal(got[name], want[name])
