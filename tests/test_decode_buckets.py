"""One-token entry points have their own, finer capacity buckets than prefill chunks (LiteRT)."""
from __future__ import annotations

import numpy as np
import pytest

from conformance import MAX_CONTEXT, PREFILL_LENGTHS, checkpoint_dir, reference, relative_error, scratch_dir
from litekv.converters.convert import ConvertOptions, convert, tflite_signatures
from litekv.errors import ConfigError
from litekv.executor import open_executor

PREFILL_BUCKETS = (32, 64)
DECODE_BUCKETS = (8, 16, 24, 32, 48, 64)


def test_kernel_bundles_decode_and_prefill_at_max_context_only():
    """The kernels read only the slots a row sees: one decode entry point, one prefill entry point per
    chunk length; builtin-op prefill keeps its capacity buckets."""
    options = ConvertOptions(max_context=4096, prefill_lengths=(32, 512))
    assert options.one_token_buckets() == options.prefill_buckets() == (4096,)
    names = {s.name for s in tflite_signatures(options)}
    assert names == {"prefill_32", "prefill_512", "decode", "sampler"}
    graph_prefill = ConvertOptions(max_context=4096, prefill_lengths=(32, 512), prefill_attention="graph")
    assert graph_prefill.one_token_buckets() == (4096,)
    names = {s.name for s in tflite_signatures(graph_prefill)}
    assert {"prefill_32_s256", "prefill_512_s1024", "prefill_512", "decode"} <= names
    assert not [n for n in names if n.startswith("decode_s")]
    graph_decode = ConvertOptions(max_context=4096, prefill_lengths=(32, 512), decode_attention="graph")
    assert graph_decode.prefill_buckets() == (4096,)
    assert graph_decode.one_token_buckets() == (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def test_default_decode_buckets_refine_the_prefill_buckets():
    options = ConvertOptions(max_context=4096, prefill_lengths=(32, 512), decode_attention="graph",
                             prefill_attention="graph")
    assert options.prefill_buckets() == (256, 512, 1024, 2048, 4096)
    assert options.one_token_buckets() == (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
    names = {s.name for s in tflite_signatures(options)}
    assert {"decode_s128", "decode_s384", "decode_s3072", "prefill_32_s256", "prefill_512", "sampler"} <= names
    assert not {"prefill_32_s128", "prefill_32_s384", "prefill_512_s256"} & names
    assert not [n for n in names if n.startswith("sample_")]  # one sampler serves every bucket


def test_explicit_buckets_are_kept_for_every_entry_point():
    options = ConvertOptions(max_context=64, prefill_lengths=(8,), kv_buckets=(16, 64))
    assert options.one_token_buckets() == options.prefill_buckets() == (16, 64)
    split = ConvertOptions(max_context=64, prefill_lengths=(8,), kv_buckets=(16, 64), decode_buckets=(24, 64))
    assert split.buckets() == (16, 24, 64)
    assert ConvertOptions(backend="onnx", max_context=64, prefill_lengths=(8,)).buckets() == (64,)


def test_decode_buckets_must_end_at_the_max_context():
    with pytest.raises(ConfigError, match="decode buckets must increase and end at the max context 64"):
        ConvertOptions(max_context=64, prefill_lengths=(8,), decode_buckets=(16, 32))


@pytest.mark.parametrize("field", ["kv_buckets", "decode_buckets"])
def test_empty_bucket_lists_are_refused(field):
    """An empty list would convert a bundle without decode entry points."""
    with pytest.raises(ConfigError, match="must increase and end at the max context 64, got \\[\\]"):
        ConvertOptions(max_context=64, prefill_lengths=(8,), **{field: ()})


@pytest.mark.parametrize("field", ["kv_buckets", "decode_buckets"])
def test_bucket_options_are_refused_for_onnx(field):
    with pytest.raises(ConfigError, match="buckets are a LiteRT option"):
        ConvertOptions(backend="onnx", max_context=64, prefill_lengths=(8,), **{field: (16, 64)})


def test_attention_kinds_and_their_defaults():
    """LiteRT attends in litekv's kernels by default, and so does ONNX over a float32 or int8 cache,
    whatever runs its linears; ONNX keeps GroupQueryAttention for its float16 cache. Quantized ONNX
    weights default to an int8 cache (not with LoRA inputs). Either kernel may be chosen where it
    reads the cache; a bundle whose steps and chunks run one graph attends one way."""
    assert ConvertOptions(max_context=64, prefill_lengths=(8,)).attention_kind == "kernel"
    onnx = dict(backend="onnx", max_context=64, prefill_lengths=(8,))
    int4 = ConvertOptions(**onnx, quantize="int4")
    assert (int4.linears_kind, int4.attention_kind, int4.prefill_attention_kind) == ("kernel", "kernel", "kernel")
    assert int4.kv_format == "int8"  # read by the ops' Int8 forms
    for quantize, cache in (("fp32", "fp32"), ("int8", "int8")):
        own = ConvertOptions(**onnx, quantize=quantize)
        assert (own.linears_kind, own.attention_kind, own.prefill_attention_kind) == ("graph", "kernel", "kernel")
        assert own.kv_format == cache
    lora = ConvertOptions(**onnx, quantize="int4", lora_rank=4)  # graph linears, a float32 cache
    assert (lora.linears_kind, lora.attention_kind, lora.kv_format) == ("graph", "kernel", "fp32")
    assert ConvertOptions(**onnx, decode_attention="graph").prefill_attention_kind == "graph"  # one graph
    assert ConvertOptions(**onnx, prefill_attention="graph").attention_kind == "graph"
    with pytest.raises(ConfigError, match="attends one way"):
        ConvertOptions(**onnx, decode_attention="kernel", prefill_attention="graph")
    split = ConvertOptions(**onnx, quantize="int4", decode_attention="kernel", prefill_attention="graph")
    assert (split.attention_kind, split.prefill_attention_kind) == ("kernel", "graph")  # int4: a decode graph
    int8 = ConvertOptions(**onnx, quantize="int4", kv_cache="int8")  # GroupQueryAttention's codes and scales
    assert int8.attention_kind == int8.prefill_attention_kind == "kernel"
    half = ConvertOptions(**onnx, quantize="int4", kv_cache="fp16")
    assert half.attention_kind == half.prefill_attention_kind == "graph"
    for flag in ("decode_attention", "prefill_attention"):
        with pytest.raises(ConfigError, match="kernel on ONNX reads a float32 or int8 cache"):
            ConvertOptions(**onnx, kv_cache="fp16", **{flag: "kernel"})
    with pytest.raises(ConfigError, match="unknown decode attention 'fast'"):
        ConvertOptions(max_context=64, prefill_lengths=(8,), decode_attention="fast")
    assert ConvertOptions(max_context=64, prefill_lengths=(8,)).prefill_attention_kind == "kernel"
    with pytest.raises(ConfigError, match="unknown prefill attention 'fast'"):
        ConvertOptions(max_context=64, prefill_lengths=(8,), prefill_attention="fast")


@pytest.mark.parametrize("drop", ["every decode entry point", "the max-context decode entry point"])
def test_a_manifest_without_a_decode_bucket_for_every_length_is_refused(drop):
    """A step must always find a bucket; a hand-edited or truncated manifest is caught at load (one built in
    code, as here, when it is built: before the executor's own check of its buckets)."""
    import dataclasses

    from conformance import bundle
    from litekv.bundle import BundleError, read_manifest
    from litekv.executor.litert_executor import LiteRTExecutor

    path = bundle("llama", "litert")
    manifest = read_manifest(path)
    if drop == "every decode entry point":
        kept = [s for s in manifest.signatures if s.kind != "decode"]
        message = "no decode entry point"
    else:
        kept = [s for s in manifest.signatures if s.name != "decode"]
        message = "no decode entry point at max_context 64"
    with pytest.raises(BundleError, match=message):
        LiteRTExecutor(path, dataclasses.replace(manifest, signatures=tuple(kept)))


@pytest.fixture(scope="module", params=[(arch, attention) for arch in ("llama", "gemma3")
                                        for attention in ("kernel", "graph")], ids=lambda p: "-".join(p))
def split_bucket_executor(request):
    """Both attention forms: litekv's kernels (the default) and builtin ops only."""
    arch, attention = request.param
    options = ConvertOptions(backend="litert", max_context=MAX_CONTEXT, prefill_lengths=PREFILL_LENGTHS,
                             kv_buckets=PREFILL_BUCKETS, decode_buckets=DECODE_BUCKETS, decode_attention=attention,
                             prefill_attention=attention, kv_cache="fp32")  # exact: the buckets alone differ
    path = convert(checkpoint_dir(arch), scratch_dir("litekv-decode-buckets-") / f"{arch}-{attention}", options)
    return arch, open_executor(path)


def test_steps_run_in_the_smallest_one_token_bucket(split_bucket_executor):
    _, ex = split_bucket_executor
    assert ex._signature_name("decode", 17, None) == "decode_s24"
    assert ex._signature_name("decode", 49, None) == "decode"
    assert ex._signature_name("prefill", 12, None, tokens=8) == "prefill_8_s32"  # no 16-slot prefill


def test_split_buckets_match_the_reference_across_every_boundary(split_bucket_executor):
    arch, ex = split_bucket_executor
    ref = reference(arch)
    prompt = np.random.default_rng(5).integers(3, ex.config.vocab_size, 6)  # 4 + 1 chunks, then steps
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    ex.prefill(prompt, ours)
    ref.prefill(prompt, theirs)
    token = int(prompt[-1])
    while ours.num_tokens < MAX_CONTEXT - 1:  # through the 8, 16, 24, 32 and 48-slot buckets
        expected = ref.step([token], theirs)
        assert relative_error(ex.step([token], ours), expected) < 1e-4, ours.num_tokens
        token = int(np.argmax(expected[0]))
    prompt = np.random.default_rng(6).integers(3, ex.config.vocab_size, 30)  # a prefill after short steps
    ours, theirs = ex.create_kv_cache(), ref.create_kv_cache()
    for t in prompt[:3]:
        ex.step([int(t)], ours)
        ref.step([int(t)], theirs)
    ex.prefill(prompt[3:-1], ours)
    ref.prefill(prompt[3:-1], theirs)
    assert relative_error(ex.step([int(prompt[-1])], ours), ref.step([int(prompt[-1])], theirs)) < 1e-4


def test_attention_stats_count_every_layers_call(split_bucket_executor):
    """The kernel's counters, as bench/attention_threads.py reads them: one call per layer and
    decode step (prefill chunks run the prefill op, which they do not count); a bundle without the
    kernel has none."""
    arch, ex = split_bucket_executor
    if ex.manifest.decode_attention != "kernel":
        assert ex.attention_stats() is None
        return
    cache = ex.create_kv_cache()
    ex.prefill(np.arange(3, 9), cache)
    before = ex.attention_stats()
    for token in (3, 4, 5):
        ex.step([token], cache)
    after = ex.attention_stats()
    assert after.calls - before.calls == 3 * ex.config.num_layers
    assert after.seconds > before.seconds


def test_the_attention_kernel_takes_its_own_thread_count():
    """attention_threads=1 beside XNNPACK's 2: calls of several chunks, none for a helper."""
    from litekv.bundle import read_manifest
    from litekv.executor.litert_executor import LiteRTExecutor

    options = ConvertOptions(backend="litert", max_context=512, prefill_lengths=(64,))
    path = convert(checkpoint_dir("llama"), scratch_dir("litekv-attention-threads-") / "llama", options)
    ex = LiteRTExecutor(path, read_manifest(path), threads=2, attention_threads=1)
    cache = ex.create_kv_cache()
    ex.prefill(np.arange(500) % 50 + 3, cache)
    for token in (3, 4, 5):
        ex.step([token], cache)
    stats = ex.attention_stats()
    assert stats.calls == 3 * ex.config.num_layers
    assert stats.chunks == 3 * stats.calls  # 501-503 live slots of a float cache: three 192-slot chunks a call
    assert stats.helper_chunks == 0
