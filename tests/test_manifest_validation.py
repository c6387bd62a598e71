"""Damaged or hand-edited bundle manifests: every defect is a BundleError naming the manifest and the
field, before any executor runs; the files a manifest names stay inside the bundle directory."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conformance import bundle
from litekv.bundle import MANIFEST, BundleError, read_manifest

LORA_RANK = 4  # LoRA-ready bundles, so the LoRA fields are there to break


def converted(backend: str) -> Path:
    return bundle("llama", backend, lora_rank=LORA_RANK)


def copy_bundle(backend: str, where: Path) -> Path:
    """A private copy of the tiny converted bundle (its files are under 1 MB)."""
    target = where / f"bundle-{backend}"
    shutil.copytree(converted(backend), target)
    return target


def with_manifest(backend: str, where: Path, change) -> Path:
    """A copy of the bundle whose manifest `change` (a function of the parsed JSON) has edited."""
    target = copy_bundle(backend, where)
    data = json.loads((target / MANIFEST).read_text())
    change(data)
    (target / MANIFEST).write_text(json.dumps(data))
    return target


def put(*path_and_value):
    """An edit setting data[k1][k2]... = value."""
    *keys, value = path_and_value

    def change(data):
        for key in keys[:-1]:
            data = data[key]
        data[keys[-1]] = value
    return change


def drop(*keys):
    def change(data):
        for key in keys[:-1]:
            data = data[key]
        del data[keys[-1]]
    return change


def drop_signatures(*names):
    def change(data):
        data["signatures"] = [s for s in data["signatures"] if s["name"] not in names]
    return change


def rename_signature(old, new):
    def change(data):
        next(s for s in data["signatures"] if s["name"] == old)["name"] = new
    return change


def lora_off(data):  # a bundle without LoRA, but its entry points and groups kept
    data["lora_rank"] = None


# (id, backend, edit, a phrase of the error)
CASES = [
    # the reviewer's cases
    ("config-list", "onnx", put("config", []), "config must be a JSON object, got []"),
    ("max-context-string", "onnx", put("max_context", "64"), "max_context must be a positive integer, got '64'"),
    ("model-file-absolute", "onnx", put("model_file", "/etc/hostname"),
     "model_file must be a file name inside the bundle directory, got '/etc/hostname'"),
    ("model-file-dotdot", "litert", put("model_file", "../elsewhere/model.tflite"),
     "model_file must be a file name inside the bundle directory"),
    # the format and its version
    ("version-newer", "onnx", put("version", 10_000), "written by a newer litekv: upgrade litekv"),
    ("version-older", "onnx", put("version", 2), "reconvert the model with this litekv"),
    ("version-string", "onnx", put("version", "18"), "version must be an integer, got '18'"),
    ("version-float", "onnx", put("version", 3.0), "version must be an integer, got 3.0"),
    ("unknown-field", "onnx", put("fast_mode", True), "the manifest has unknown fields fast_mode"),
    ("missing-fingerprint", "onnx", drop("fingerprint"), "the manifest is incomplete (no fingerprint)"),
    # scalars
    ("backend-unknown", "onnx", put("backend", "tpu"), "backend must be one of 'litert', 'onnx', got 'tpu'"),
    ("max-context-bool", "onnx", put("max_context", True), "max_context must be a positive integer, got True"),
    ("max-context-zero", "litert", put("max_context", 0), "max_context must be a positive integer, got 0"),
    ("max-context-below-buckets", "litert", put("max_context", 32),
     "kv_buckets [16, 32, 64] must end at max_context 32"),
    ("max-context-past-the-model", "onnx", put("max_context", 1024),
     "max_context 1024 is above config.max_position 512"),
    ("lora-rank-string", "onnx", put("lora_rank", "4"), "lora_rank must be a positive integer, got '4'"),
    ("fingerprint-path", "litert", put("fingerprint", "../../../x"), "fingerprint must be a hex digest"),
    ("lm-head-kernel-string", "litert", put("lm_head_kernel", "yes"), "lm_head_kernel must be true or false"),
    ("row-scales-int", "litert", put("kv_row_scales", 0), "kv_row_scales must be true or false, got 0"),
    ("chat-template-number", "onnx", put("chat_template", 5), "chat_template must be a string, got 5"),
    ("bos-beyond-vocab", "onnx", put("bos_token_id", 10**6), "bos_token_id 1000000 is not below the vocab_size"),
    ("eos-string", "onnx", put("eos_token_ids", "2"), "eos_token_ids must be a JSON list, got '2'"),
    ("eos-negative", "onnx", put("eos_token_ids", [-1]), "eos_token_ids[0] must be a non-negative integer"),
    ("file-sizes-string", "onnx", put("file_sizes", "model.onnx.data", "big"),
     "file_sizes['model.onnx.data'] must be a non-negative integer"),
    ("source-list", "onnx", put("source", []), "source must be a JSON object"),
    ("sampler-file-absolute", "onnx", put("sampler_file", "/etc/hostname"),
     "sampler_file must be a file name inside the bundle directory"),
    ("decode-model-file-dotdot", "onnx", put("decode_model_file", "../model.onnx"),
     "decode_model_file must be a file name inside the bundle directory"),
    ("model-file-nul", "onnx", put("model_file", "model.onnx\0.txt"), "model_file must be a file name inside"),
    # known values
    ("kv-dtype-unknown", "onnx", put("kv_dtype", "bfloat16"), "unknown KV cache dtype 'bfloat16'"),
    ("kv-layout-other-backend", "onnx", put("kv_layout", "BSHD"), "KV layout 'BSHD' is not one of the 'onnx'"),
    ("attention-unknown", "litert", put("decode_attention", "gpu"), "unknown decode_attention 'gpu'"),
    ("quantization-list", "onnx", put("quantization", []), "quantization must be a JSON object"),
    ("quantization-unknown-format", "onnx", put("quantization", "weights", "int3"),
     "quantization.weights must be one of 'fp32', 'int8', 'int4', got 'int3'"),
    ("quantization-embedding", "litert", put("quantization", "embedding", "int4"),
     "quantization.embedding must be one of"),
    ("quantization-odd-block", "onnx", put("quantization", "block_size", 33),
     "quantization.block_size must be a positive even integer, got 33"),
    ("quantization-incomplete", "onnx", drop("quantization", "lm_head"), "quantization is incomplete (no lm_head)"),
    ("lora-layout-unknown", "onnx", put("lora_layout", "rows"), "lora_layout must be one of 'out_in', 'in_out'"),
    # the model config
    ("config-layers-string", "onnx", put("config", "num_layers", "2"),
     "config.num_layers must be a positive integer"),
    ("config-heads-bool", "litert", put("config", "num_heads", True), "config.num_heads must be a positive integer"),
    ("config-eps-nan", "onnx", put("config", "norm_eps", float("nan")),
     "config.norm_eps must be a finite positive number"),
    ("config-eps-infinite", "onnx", put("config", "norm_eps", float("inf")), "config.norm_eps must be a finite"),
    ("config-embed-scale-zero", "onnx", put("config", "embed_scale", 0),
     "config.embed_scale must be a finite positive"),
    ("config-tied-string", "onnx", put("config", "tie_embeddings", "false"),
     "config.tie_embeddings must be true or false"),
    ("config-rope-list", "onnx", put("config", "rope", [1]), "config.rope must be a JSON object, got [1]"),
    ("config-rope-theta", "onnx", put("config", "rope", "theta", -1), "config.rope.theta must be a finite positive"),
    ("config-rope-kind", "litert", put("config", "rope", "kind", "yarn"), "config.rope.kind must be one of"),
    ("config-rope-unknown", "onnx", put("config", "rope", "beta", 2), "config.rope has unknown fields beta"),
    ("config-head-dim-odd", "onnx", put("config", "head_dim", 15), "config.head_dim must be even"),
    ("config-kv-heads", "onnx", put("config", "num_kv_heads", 3), "config is inconsistent"),
    ("config-activation", "onnx", put("config", "activation", "relu"), "config.activation must be one of"),
    ("config-layer-types", "litert", put("config", "layer_types", "ff"), "config.layer_types must be a JSON list"),
    ("config-layer-kind", "onnx", put("config", "layer_types", ["full", "local"]),
     "config.layer_types[1] must be one of"),
    ("config-sliding-window", "onnx", put("config", "sliding_window", -4),
     "config.sliding_window must be a positive integer"),
    ("config-bos", "onnx", put("config", "bos_token_id", 320), "config.bos_token_id must be below vocab_size 320"),
    ("config-missing", "onnx", drop("config", "vocab_size"), "config is incomplete (no vocab_size)"),
    # lists of lengths and capacities
    ("prefill-none", "onnx", put("prefill_lengths", None), "prefill_lengths must be a JSON list, got None"),
    ("prefill-empty", "litert", put("prefill_lengths", []),
     "prefill_lengths must be a non-empty list of increasing"),
    ("prefill-unsorted", "litert", put("prefill_lengths", [8, 4]),
     "prefill_lengths must be a non-empty list of increasing"),
    ("prefill-zero", "onnx", put("prefill_lengths", [0, 4]), "prefill_lengths[0] must be a positive integer"),
    ("prefill-past-context", "onnx", put("prefill_lengths", [4, 128]),
     "prefill_lengths [4, 128] go past max_context 64"),
    ("buckets-unsorted", "litert", put("kv_buckets", [16, 64, 32]),
     "kv_buckets must be a non-empty list of increasing"),
    ("buckets-float", "litert", put("kv_buckets", [16, 32, 64.0]), "kv_buckets[2] must be a positive integer"),
    ("buckets-short", "onnx", put("kv_buckets", [32]), "kv_buckets [32] must end at max_context 64"),
    # entry points
    ("signatures-string", "onnx", put("signatures", "abc"), "signatures must be a JSON list, got 'abc'"),
    ("signatures-empty", "onnx", put("signatures", []), "signatures must be a non-empty list of entry points"),
    ("signature-duplicate", "litert", rename_signature("decode_s16", "decode"), "with distinct names"),
    ("signature-incomplete", "onnx", drop("signatures", 0, "inputs"), "signatures[0] is incomplete (no inputs)"),
    ("signature-capacity", "onnx", put("signatures", 0, "capacity", 10**9), "which is not one of kv_buckets [64]"),
    ("signature-tokens", "litert", put("signatures", 0, "tokens", 0),
     "signatures[0].tokens must be a positive integer, or -1"),
    ("signature-kind", "onnx", put("signatures", 0, "kind", "prefill"), "which onnx bundles do not have"),
    ("signature-lora-flag", "litert", put("signatures", 0, "lora", "no"), "signatures[0].lora must be true or false"),
    ("signature-inputs", "onnx", put("signatures", 0, "inputs", [1, 2]),
     "signatures[0].inputs[0] must be a non-empty"),
    ("signature-misnamed", "litert", rename_signature("prefill_4", "prefill_four"), "does not match its name"),
    ("no-decode", "litert", drop_signatures("decode", "decode_lora"), "no decode entry point at max_context"),
    ("no-prefill", "litert", drop_signatures("prefill_8", "prefill_8_lora"), "no prefill_8 entry point at max_context"),
    ("no-lora-twin", "litert", drop_signatures("decode_s32_lora"),
     "no decode_s32_lora entry point beside decode_s32"),
    # LoRA
    ("lora-targets-unknown", "onnx", put("lora_targets", ["q", "gate"]), "lora_targets[1] must be one of"),
    ("lora-targets-repeated", "onnx", put("lora_targets", ["q", "q", "k", "v", "o"]), "a list without repeats"),
    ("lora-rank-null", "litert", lora_off, "lora_rank is null, yet the manifest has LoRA"),
    ("lora-groups-target", "onnx", put("lora_groups", "qkv", [["q", "k", "v"], ["z"]]),
     "lora_groups.qkv[1][0] must be one of"),
    ("lora-groups-outside-parts", "onnx", put("lora_groups", "o", [["o"], ["q"]]), "some of its projections ['o']"),
    ("lora-groups-name", "onnx", put("lora_groups", "../x", [["o"], ["o"]]), "lora_groups key must be lower-case"),
    ("lora-groups-missing", "litert", drop("lora_groups", "o"), "and the targets of lora_groups ['k', 'q', 'v']"),
]


@pytest.mark.parametrize("case_id, backend, change, phrase", CASES, ids=[c[0] for c in CASES])
def test_a_malformed_manifest_is_refused_naming_the_file_and_field(case_id, backend, change, phrase, tmp_path):
    path = with_manifest(backend, tmp_path, change)
    with pytest.raises(BundleError) as caught:
        read_manifest(path)
    message = str(caught.value)
    assert phrase in message, message
    assert str(path / MANIFEST) in message
    assert "reconvert the model" in message or "upgrade litekv" in message


@pytest.mark.parametrize("backend", ["litert", "onnx"])
def test_valid_manifests_still_load(backend, tmp_path):
    path = copy_bundle(backend, tmp_path)
    manifest = read_manifest(path)
    assert (manifest.backend, manifest.max_context, manifest.lora_rank) == (backend, 64, LORA_RANK)
    rewritten = with_manifest(backend, tmp_path / "again", lambda data: None)
    assert read_manifest(rewritten) == manifest  # parsing what it writes gives the same manifest


def test_engine_refuses_a_string_max_context_before_opening_the_model(tmp_path):
    from litekv import Engine

    path = with_manifest("onnx", tmp_path, put("max_context", "64"))
    with pytest.raises(BundleError, match="max_context must be a positive integer"):
        Engine(path)


def test_manifest_that_is_not_an_object_or_not_text(tmp_path):
    path = copy_bundle("onnx", tmp_path)
    (path / MANIFEST).write_text("[]")
    with pytest.raises(BundleError, match="not a litekv bundle manifest"):
        read_manifest(path)
    (path / MANIFEST).write_bytes(b'{"format": "\xff"}')
    with pytest.raises(BundleError, match="not UTF-8 text"):
        read_manifest(path)


# ---- the files a manifest names ----------------------------------------------------------------------

def move_out_and_link(path: Path, name: str, outside: Path) -> Path:
    """Move a bundle file out of the bundle, leaving a symlink to it in its place."""
    outside.mkdir(exist_ok=True)
    shutil.move(path / name, outside / name)
    os.symlink(outside / name, path / name)
    return outside / name


@pytest.mark.parametrize("backend, name, what", [
    ("litert", "model.tflite", "model file"),
    ("onnx", "model.onnx", "model file"),
    ("onnx", "sampler.onnx", "sampler graph"),
    ("onnx", "model.onnx.data", "weight file"),
    ("onnx", "model_lora.onnx", "LoRA graph"),
])
def test_a_symlink_out_of_the_bundle_is_refused(backend, name, what, tmp_path):
    path = copy_bundle(backend, tmp_path)
    move_out_and_link(path, name, tmp_path / "elsewhere")
    with pytest.raises(BundleError, match=f"the {what} {name} leads outside the bundle directory"):
        read_manifest(path)


def test_a_symlink_within_the_bundle_is_accepted(tmp_path):
    path = copy_bundle("litert", tmp_path)
    (path / "model.tflite").rename(path / "weights.tflite")
    os.symlink("weights.tflite", path / "model.tflite")
    assert read_manifest(path).model_file == "model.tflite"


def test_a_symlink_loop_is_refused(tmp_path):
    path = copy_bundle("litert", tmp_path)
    (path / "model.tflite").unlink()
    os.symlink("model.tflite", path / "model.tflite")
    with pytest.raises(BundleError, match="model file model.tflite cannot be resolved"):
        read_manifest(path)


def test_a_named_file_that_is_a_directory_or_missing_is_refused(tmp_path):
    path = copy_bundle("onnx", tmp_path)
    (path / "sampler.onnx").unlink()
    with pytest.raises(BundleError, match="the sampler graph sampler.onnx is missing"):
        read_manifest(path)
    (path / "sampler.onnx").mkdir()
    with pytest.raises(BundleError, match="the sampler graph sampler.onnx is not a regular file"):
        read_manifest(path)
    (path / "sampler.onnx").rmdir()
    shutil.copy(converted("onnx") / "sampler.onnx", path)
    (path / "model_lora.onnx").unlink()  # a LoRA-ready ONNX bundle opens it for its first adapter
    with pytest.raises(BundleError, match="the LoRA graph model_lora.onnx is missing"):
        read_manifest(path)


# ---- the manifest's known values follow the converter's ------------------------------------------------

def test_known_values_match_the_converter():
    from litekv.bundle import LORA_TARGETS, QUANTIZATION_FORMATS, ROPE_KINDS
    from litekv.converters.graph_ops import LORA_TARGETS as CONVERTER_LORA_TARGETS
    from litekv.converters.quantize import EMBEDDING_FORMATS, WEIGHT_FORMATS
    from litekv.errors import ConfigError
    from litekv.models.config import RopeConfig

    assert QUANTIZATION_FORMATS == {"weights": WEIGHT_FORMATS, "lm_head": WEIGHT_FORMATS,
                                    "embedding": EMBEDDING_FORMATS, "block_size": None}
    assert LORA_TARGETS == CONVERTER_LORA_TARGETS
    for kind in ROPE_KINDS:
        assert RopeConfig(theta=10000.0, kind=kind).kind == kind
    with pytest.raises(ConfigError):
        RopeConfig(theta=10000.0, kind="yarn")
