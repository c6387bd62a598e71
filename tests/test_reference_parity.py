"""The numpy reference against transformers (an independent implementation) on tiny random models."""
from __future__ import annotations

import numpy as np
import pytest

from litekv.converters.checkpoint import load_checkpoint
from litekv.reference import ReferenceModel
from model_factory import ARCHITECTURES, make_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DECODE_STEPS = 8


def relative_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_prefill_and_decode_logits_match_transformers(arch, tmp_path):
    path = make_checkpoint(arch, tmp_path / arch, seed=3)
    ckpt = load_checkpoint(path, with_tokenizer=False)
    ref = ReferenceModel(ckpt.config, ckpt.weights)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf.eval()

    prompt = np.random.default_rng(1).integers(3, ckpt.config.vocab_size, size=11)
    cache = ref.new_cache(capacity=64)
    # Chunked prefill (5 + 6 tokens) must equal one uncached pass over the whole prompt.
    ours = np.concatenate([ref.forward(prompt[:5], cache)[0], ref.forward(prompt[5:], cache)[0]])
    with torch.no_grad():
        out = hf(torch.tensor(prompt[None]), use_cache=True)
    theirs = out.logits[0].numpy()
    assert relative_error(ours, theirs) < 1e-4

    past = out.past_key_values
    token = int(theirs[-1].argmax())
    for _ in range(DECODE_STEPS):
        with torch.no_grad():
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        theirs = out.logits[0, -1].numpy()
        ours = ref.forward(np.array([[token]]), cache)[0, -1]
        assert relative_error(ours, theirs) < 1e-4
        token = int(theirs.argmax())
    assert cache.num_tokens == len(prompt) + DECODE_STEPS


def test_sliding_window_is_exercised(tmp_path):
    """Guard: the gemma3 fixture's window is shorter than the parity prompt, so masking is tested."""
    ckpt = load_checkpoint(make_checkpoint("gemma3", tmp_path / "g"), with_tokenizer=False)
    assert ckpt.config.sliding_window == 4
    assert ckpt.config.layer_types == ("sliding", "full", "sliding")
    assert ckpt.config.local_rope is not None and ckpt.config.local_rope.theta == 10000.0
