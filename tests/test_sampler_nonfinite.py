"""In-model sampling refuses logits holding a NaN or an infinity, as the host sampler refuses them:
sample_tokens raises BackendError naming the step, and the KV cache keeps the tokens fed before it.

The sampler graphs return SAMPLER_NON_FINITE for such logits, greedy steps check them on the host,
and without a sampler graph host_sample does the same; a healthy model samples as before.
"""
from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from conformance import BACKENDS, PREFILL_LENGTHS, executor, scratch_dir
from litekv.bundle import MANIFEST, SAMPLER_NON_FINITE
from litekv.converters.checkpoint import load_checkpoint
from litekv.converters.convert import ConvertOptions, convert
from litekv.engine import Engine, SamplerConfig
from litekv.errors import BackendError
from litekv.executor import SamplerParams, open_executor
from litekv.executor.numpy_executor import NumpyExecutor, greedy_token, host_sample
from litekv.sampling import sample_token
from model_factory import make_checkpoint

ARCH = "llama"
GREEDY = SamplerParams()
SAMPLED = SamplerParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)
SAMPLERS = {"greedy": GREEDY, "sampled": SAMPLED}
LOWEST, HIGHEST = np.finfo(np.float32).min, np.finfo(np.float32).max
PROMPT = [5, 17, 42, 99, 7]


def graph_sample(ex, backend: str, logits: np.ndarray, sampler: SamplerParams, seed: int) -> int:
    """What the bundle's sampler graph returns for logits [vocab] float32."""
    if backend == "litert":
        io = ex._io[ex._signature_name("decode", 1, None)]
        io.outputs["logits"][0, 0] = logits  # the buffer the sampler entry point reads
        return ex._sampler.run(io, sampler.graph_inputs(seed))
    buffer = np.ascontiguousarray(logits.reshape(1, 1, -1), np.float32)
    return ex._sampler_io.run(ex._ort.OrtValue.ortvalue_from_numpy(buffer), sampler.graph_inputs(seed))


def non_finite_rows(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    base = (rng.standard_normal(vocab) * 3).astype(np.float32)
    top, low = int(np.argmax(base)), int(np.argmin(base))
    rows = {}
    for name, index, value in (("NaN at the top", top, np.nan), ("NaN at the bottom", low, np.nan),
                               ("+inf", low, np.inf), ("-inf", low, -np.inf), ("-inf at the top", top, -np.inf)):
        row = base.copy()
        row[index] = value
        rows[name] = row
    rows["all NaN"] = np.full(vocab, np.nan, np.float32)
    rows["NaN and +-inf"] = np.where(rng.random(vocab) < 0.5, np.inf, -np.inf).astype(np.float32)
    rows["NaN and +-inf"][::7] = np.nan
    return rows


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sampler_graph_and_the_host_refuse_non_finite_logits(backend):
    ex = executor(ARCH, backend)
    for name, row in non_finite_rows(ex.config.vocab_size).items():
        for seed in (0, 1, 77):
            assert graph_sample(ex, backend, row, SAMPLED, seed) == SAMPLER_NON_FINITE, name
        assert greedy_token(row) == SAMPLER_NON_FINITE, name
        for sampler in (GREEDY, SAMPLED):
            assert host_sample(row[None], sampler, 9).tolist() == [SAMPLER_NON_FINITE], name


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sampler_graph_still_draws_from_finite_extremes(backend):
    """The lowest float (the screened head's rows that cannot rank) and the highest are finite: drawn as
    the host draws them, never refused."""
    ex = executor(ARCH, backend)
    vocab = ex.config.vocab_size
    rng = np.random.default_rng(5)
    screened = np.full(vocab, LOWEST, np.float32)
    kept = rng.choice(vocab, 80, replace=False)
    screened[kept] = rng.standard_normal(80) * 3
    extremes = (rng.standard_normal(vocab) * 3).astype(np.float32)
    extremes[rng.choice(vocab, 3, replace=False)] = HIGHEST
    extremes[rng.choice(vocab, 30, replace=False)] = LOWEST
    drawn = set()
    for row in (screened, extremes):
        for seed in range(30):
            sampler = SamplerParams(temperature=1.0, top_k=int(rng.choice([0, 5, 40])), top_p=0.9, seed=seed)
            token = graph_sample(ex, backend, row, sampler, seed)
            assert token == sample_token(row, 1.0, sampler.top_k, sampler.top_p, seed)
            drawn.add(token)
        assert greedy_token(row) == int(np.argmax(row))
    assert len(drawn) > 5 and min(drawn) >= 0


# ---- a model whose logits overflow float32 -------------------------------------------------------

@lru_cache(maxsize=None)
def overflowing_checkpoint() -> Path:
    """The conformance llama with its final norm's weights at 3e38: finite (the checkpoint loader takes
    them), but the normed hidden state and every logit overflow float32."""
    directory = make_checkpoint(ARCH, scratch_dir("litekv-nonfinite-") / "ckpt", seed=11)
    weights = load_file(str(directory / "model.safetensors"))
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], 3e38)
    save_file(weights, str(directory / "model.safetensors"))
    return directory


@lru_cache(maxsize=None)
def overflowing(backend: str):
    ckpt = overflowing_checkpoint()
    if backend == "numpy":
        loaded = load_checkpoint(ckpt, with_tokenizer=False)
        return NumpyExecutor(loaded.config, loaded.weights, max_context=64)
    options = ConvertOptions(backend=backend, max_context=64, prefill_lengths=PREFILL_LENGTHS, kv_cache="fp32")
    return open_executor(convert(ckpt, ckpt.parent / backend, options))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning",  # the numpy reference's
                            "ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("backend", BACKENDS + ("numpy",))
def test_sample_tokens_raises_on_a_model_whose_logits_overflow(backend, sampler):
    ex = overflowing(backend)
    probe = ex.create_kv_cache()
    ex.prefill(PROMPT, probe)
    assert not np.isfinite(ex.step([3], probe)).any()  # the model really is broken
    cache = ex.create_kv_cache()
    ex.prefill(PROMPT, cache)
    with pytest.raises(BackendError, match=r"logits of sample_tokens step 0 \(position 5, batch row 0\) hold NaN or "
                                           r"infinite values.*the KV cache keeps the 5 tokens before that step.*"
                                           r"Check the model.*reconvert"):
        ex.sample_tokens(4, [3], cache, sampler=SAMPLERS[sampler])
    assert cache.num_tokens == len(PROMPT)


# ---- a step that fails in the middle of a run ------------------------------------------------------

def poison(ex, backend: str, position: int, row: int, value: float, monkeypatch) -> None:
    """Make one logit of the model's run at `position` of batch row `row` `value`."""
    original = ex._run
    if backend == "litert":
        def run(name, tokens, start, kv_cache, r, *rest, **options):
            io = original(name, tokens, start, kv_cache, r, *rest, **options)
            if start == position and r == row:
                io.outputs["logits"][0, 0, 17] = value
            return io
    else:
        def run(tokens, start, kv_cache, r, *rest, **options):
            logits, logits_value = original(tokens, start, kv_cache, r, *rest, **options)
            if start == position and r == row:
                logits[0, 0, 17] = value  # the memory of logits_value, which the sampler graph reads
            return logits, logits_value
    monkeypatch.setattr(ex, "_run", run)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failing_step_keeps_the_tokens_before_it(backend, sampler, value, monkeypatch):
    """Step 6 of 12 sees a non-finite logit: sample_tokens raises, the cache holds the prompt and the
    six tokens fed before that step, and continuing from them gives the run that never failed."""
    ex, params, steps, failing = executor(ARCH, backend), SAMPLERS[sampler], 12, 6
    healthy = ex.create_kv_cache()
    ex.prefill(PROMPT, healthy)
    baseline = ex.sample_tokens(steps, [3], healthy, sampler=params)[0].tolist()
    cache = ex.create_kv_cache()
    ex.prefill(PROMPT, cache)
    with monkeypatch.context() as patch:
        poison(ex, backend, len(PROMPT) + failing, 0, value, patch)
        with pytest.raises(BackendError, match=rf"{backend}: the logits of sample_tokens step {failing} \(position "
                                               rf"{len(PROMPT) + failing}, batch row 0\)"):
            ex.sample_tokens(steps, [3], cache, sampler=params)
    assert cache.num_tokens == len(PROMPT) + failing
    rest = ex.sample_tokens(steps - failing, [baseline[failing - 1]], cache, sampler=params)[0].tolist()
    assert baseline[:failing] + rest == baseline


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_error_names_the_failing_batch_row(backend, sampler, monkeypatch):
    ex = executor(ARCH, backend)
    cache = ex.create_kv_cache(batch_size=3)
    ex.prefill(PROMPT, cache)
    poison(ex, backend, len(PROMPT), 1, np.nan, monkeypatch)
    with pytest.raises(BackendError, match=r"step 0 \(position 5, batch row 1\)"):
        ex.sample_tokens(3, [3, 4, 5], cache, sampler=SAMPLERS[sampler])
    assert cache.num_tokens == len(PROMPT)


# ---- a Session sampling on the host (repetition penalty) -------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_session_sampling_on_the_host_refuses_them_too_and_stays_consistent(backend, temperature):
    """With a repetition penalty the Session samples step()'s logits itself: np.argmax found the first
    NaN and sample_token drew among whatever was finite. Now the step is refused and not committed."""
    engine = Engine(overflowing(backend).bundle_path)
    session = engine.create_session(SamplerConfig(temperature=temperature, repetition_penalty=1.1, seed=3))
    session.prefill(PROMPT)
    with pytest.raises(BackendError, match=r"logits at position 4 hold NaN or infinite values.*keeps its 5 tokens.*"
                                           r"reconvert"):
        next(session.generate(4, ignore_eos=True))
    assert session.tokens == PROMPT
    assert session.kv_cache.num_tokens == len(PROMPT) - 1  # the last prompt token still pending, as before


# ---- bundles converted before their sampler graphs refused such logits ------------------------------

def as_version_18(bundle: Path, directory: Path) -> Path:
    """A copy of `bundle` whose manifest is a version-18 one, written before the sampler graphs refused
    non-finite logits (the field absent)."""
    copy = directory / bundle.name
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    assert manifest.pop("sampler_refuses_non_finite") is True
    (copy / MANIFEST).write_text(json.dumps({**manifest, "version": 18}))
    return copy


def draw_seven(ex, backend: str, monkeypatch) -> None:
    """Stand in for an older sampler graph, which draws an id from any logits."""
    if backend == "litert":
        monkeypatch.setattr(ex._sampler, "run", lambda io, inputs: 7)
    else:
        monkeypatch.setattr(ex, "_sample_on_graph", lambda logits_value, sampler, seed: 7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_older_bundles_logits_are_checked_on_the_host(backend, tmp_path, monkeypatch):
    old = open_executor(as_version_18(overflowing(backend).bundle_path, tmp_path))
    assert not old.manifest.sampler_refuses_non_finite
    draw_seven(old, backend, monkeypatch)
    cache = old.create_kv_cache()
    old.prefill(PROMPT, cache)
    with pytest.raises(BackendError, match=r"step 0 \(position 5, batch row 0\) hold NaN or infinite values"):
        old.sample_tokens(2, [3], cache, sampler=SAMPLED)
    assert cache.num_tokens == len(PROMPT)

    new = overflowing(backend)  # its graph refuses them itself: no second check on the host
    assert new.manifest.sampler_refuses_non_finite
    draw_seven(new, backend, monkeypatch)
    cache = new.create_kv_cache()
    new.prefill(PROMPT, cache)
    assert new.sample_tokens(2, [3], cache, sampler=SAMPLED).tolist() == [[7, 7]]
