"""The checks a bundle read from disk gets apply however its pieces are made: a Manifest or ModelConfig built
in code is checked as one read from a manifest, and no file a bundle opens (its tokenizer, the external data
its ONNX graphs name) leads outside the bundle directory."""
from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import onnx
import pytest
from onnx.external_data_helper import uses_external_data

from fake_executor import tiny_config
from litekv import Engine
from litekv.bundle import BundleError, Manifest, check_onnx_graph, read_manifest
from litekv.errors import ConfigError
from litekv.executor import open_executor
from litekv.onnx_external_data import external_tensors
from test_executors import write_peft_adapter
from test_manifest_validation import LORA_RANK, copy_bundle, move_out_and_link

# ---- a Manifest built in code --------------------------------------------------------------------------

# (field, value, a phrase of the error): one per kind of check, the field's own and the fields' agreement
CODE_CASES = [
    ("max_context", "64", "max_context must be a positive integer, got '64'"),
    ("model_file", "/etc/hostname", "model_file must be a file name inside the bundle directory"),
    ("sampler_file", "../sampler.onnx", "sampler_file must be a file name inside the bundle directory"),
    ("kv_dtype", "bfloat16", "unknown KV cache dtype 'bfloat16'"),
    ("prefill_lengths", (4, 128), "prefill_lengths [4, 128] go past max_context 64"),
    ("bos_token_id", 10**6, "bos_token_id 1000000 is not below the vocab_size"),
    ("fingerprint", "../../x", "fingerprint must be a hex digest"),
    ("lora_rank", None, "lora_rank is null, yet the manifest has LoRA"),
]


@pytest.mark.parametrize("field, value, phrase", CODE_CASES, ids=[c[0] for c in CODE_CASES])
def test_a_manifest_built_in_code_is_checked_like_one_read_from_a_bundle(field, value, phrase, tmp_path):
    manifest = read_manifest(copy_bundle("onnx", tmp_path))
    with pytest.raises(BundleError) as caught:
        dataclasses.replace(manifest, **{field: value})
    message = str(caught.value)
    assert phrase in message and message.startswith("a Manifest built in code: "), message
    assert "reconvert the model" in message


def test_a_manifest_built_in_code_with_a_bad_signature_or_config_is_refused(tmp_path):
    manifest = read_manifest(copy_bundle("litert", tmp_path))
    misnamed = dataclasses.replace(manifest.signatures[0], name="prefill_four")
    with pytest.raises(BundleError, match="does not match its name"):
        dataclasses.replace(manifest, signatures=(misnamed, *manifest.signatures[1:]))
    # ModelConfig checks how its fields agree and leaves their types to its builders; the manifest checks those
    config = dataclasses.replace(manifest.config, norm_eps=float("nan"))
    with pytest.raises(BundleError, match="config.norm_eps must be a finite positive number, got nan"):
        dataclasses.replace(manifest, config=config)


def test_a_manifest_built_in_code_is_the_one_reading_it_back_gives(tmp_path):
    """Its fields normalized as reading normalizes them (lists to tuples): built either way, manifests compare."""
    path = copy_bundle("litert", tmp_path)
    manifest = read_manifest(path)
    built = Manifest(**{**manifest.__dict__, "prefill_lengths": list(manifest.prefill_lengths),
                        "eos_token_ids": list(manifest.eos_token_ids)})
    assert built == manifest and isinstance(built.prefill_lengths, tuple)
    assert Manifest.from_json(built.to_json(), "again") == manifest


# ---- ModelConfig ---------------------------------------------------------------------------------------

def test_model_config_refuses_an_odd_head_dim_and_a_bos_past_the_vocabulary():
    config = tiny_config(vocab_size=32)
    with pytest.raises(ConfigError, match=r"llama config.head_dim must be even \(rotary embeddings turn pairs of "
                                          r"dimensions\), got 7"):
        dataclasses.replace(config, head_dim=7)
    with pytest.raises(ConfigError, match="llama config.bos_token_id must be below vocab_size 32, got 32"):
        dataclasses.replace(config, bos_token_id=32)
    assert dataclasses.replace(config, bos_token_id=31).bos_token_id == 31
    with pytest.raises(ConfigError, match="head_dim must be even"):  # however it is built
        type(config).from_dict({**config.to_dict(), "head_dim": 9})


# ---- the tokenizer -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, what", [("tokenizer.json", "tokenizer"),
                                        ("tokenizer_meta.json", "tokenizer metadata")])
def test_a_tokenizer_file_linked_out_of_the_bundle_is_refused(name, what, tmp_path):
    path = copy_bundle("litert", tmp_path)
    move_out_and_link(path, name, tmp_path / "elsewhere")
    with pytest.raises(BundleError, match=f"the {what} {name} leads outside the bundle directory"):
        Engine(path)  # read_manifest refuses it, before Tokenizer.load reads it


def test_tokenizer_files_linked_within_the_bundle_are_accepted(tmp_path):
    path = copy_bundle("litert", tmp_path)
    for name in ("tokenizer.json", "tokenizer_meta.json"):
        (path / name).rename(path / f"linked-{name}")
        os.symlink(f"linked-{name}", path / name)
    assert Engine(path).tokenizer.encode("hello")


# ---- the external data of ONNX graphs --------------------------------------------------------------------

def relocate(graph: Path, location: str | None) -> str:
    """Point the first external tensor of the ONNX file `graph` at `location` (None: name no location);
    returns the tensor's name."""
    model = onnx.load(str(graph), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if uses_external_data(t))
    entries = [e for e in tensor.external_data if e.key != "location"]
    del tensor.external_data[:]
    tensor.external_data.extend(entries)
    if location is not None:
        tensor.external_data.add(key="location", value=location)
    graph.write_bytes(model.SerializeToString())
    return tensor.name


def outside_copy(path: Path) -> Path:
    """A copy of the bundle's weight file outside the bundle, which ONNX Runtime would read happily."""
    (path.parent / "elsewhere").mkdir(exist_ok=True)
    return Path(shutil.copy(path / "model.onnx.data", path.parent / "elsewhere" / "model.onnx.data"))


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink", "missing", "none"])
def test_external_data_outside_the_bundle_is_refused_before_onnxruntime_opens_it(kind, tmp_path):
    path = copy_bundle("onnx", tmp_path)
    location, phrase = {
        "absolute": (str(outside_copy(path)), "must be a file name inside the bundle directory"),
        "dotdot": ("../elsewhere/model.onnx.data", "must be a file name inside the bundle directory"),
        "symlink": ("linked.data", "linked.data leads outside the bundle directory"),
        "missing": ("gone.data", "gone.data is missing"),
        "none": (None, "must be a non-empty string, got None"),
    }[kind]
    if kind == "dotdot":
        outside_copy(path)
    if kind == "symlink":
        os.symlink(outside_copy(path), path / "linked.data")
    tensor = relocate(path / "model.onnx", location)
    with pytest.raises(BundleError) as caught:
        open_executor(path)
    message = str(caught.value)
    assert phrase in message and repr(tensor) in message and "reconvert the model" in message, message
    assert "model.onnx" in message


def test_the_lora_graph_external_data_is_checked_when_the_first_adapter_loads(tmp_path):
    path = copy_bundle("onnx", tmp_path)
    tensor = relocate(path / "model_lora.onnx", str(outside_copy(path)))
    executor = open_executor(path)  # the plain graph is fine; the LoRA graph opens with the first adapter
    write_peft_adapter(tmp_path / "adapter", executor.config, LORA_RANK, 8, seed=0)
    with pytest.raises(BundleError, match=f"model_lora.onnx: the external data location of tensor {tensor!r}"):
        executor.load_lora(tmp_path / "adapter")


def test_a_graph_that_is_not_a_protobuf_is_refused(tmp_path):
    path = copy_bundle("onnx", tmp_path)
    (path / "sampler.onnx").write_bytes(b"\x0a\xff\xff\xff")  # field 1, a length past the end
    with pytest.raises(BundleError, match="the sampler graph is not a readable ONNX model"):
        open_executor(path)


def test_the_reader_finds_what_onnx_finds(tmp_path):
    """litekv's protobuf reader against onnx's own, on the converter's graphs; they all pass the check."""
    path = copy_bundle("onnx", tmp_path)
    for name in ("model.onnx", "model_lora.onnx", "sampler.onnx"):
        model = onnx.load(str(path / name), load_external_data=False)
        expected = [(t.name, next(e.value for e in t.external_data if e.key == "location"))
                    for t in model.graph.initializer if uses_external_data(t)]
        assert external_tensors(path / name) == expected
        assert check_onnx_graph(path, name, "graph") == path / name
    assert external_tensors(path / "model.onnx")  # the converter's weights are external
