"""Damaged and crafted checkpoints: each ends in a litekv error naming the file, before any tensor is read."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from litekv.converters.checkpoint import load_checkpoint
from litekv.errors import CheckpointError, CheckpointNotFound, ConfigError
from model_factory import make_checkpoint, make_gguf
from real_models import smollm2_gguf

TESTS = Path(__file__).parent


@pytest.fixture
def llama_dir(tmp_path):
    return make_checkpoint("llama", tmp_path / "llama", seed=3)


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def safetensors_parts(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def write_safetensors(path: Path, header_text: str, data: bytes) -> None:
    encoded = header_text.encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def gguf_u32_offset(path: Path, key: str) -> int:
    """Where the value of a UINT32 metadata field starts in the file."""
    import gguf

    field = gguf.GGUFReader(path).fields[key]
    assert field.types == [gguf.GGUFValueType.UINT32]
    return field.offset + 8 + len(key.encode()) + 4


def patch_gguf_u32(path: Path, key: str, value: int) -> None:
    data = bytearray(path.read_bytes())
    struct.pack_into("<I", data, gguf_u32_offset(path, key), value)
    path.write_bytes(bytes(data))


def load_in_subprocess(path: Path, memory_limit: int | None = None, timeout: float = 60) -> str:
    """Load `path` in a fresh interpreter (optionally with its address space capped); its output."""
    script = textwrap.dedent(f"""
        import resource, sys
        if {memory_limit!r}:
            resource.setrlimit(resource.RLIMIT_AS, ({memory_limit!r}, {memory_limit!r}))
        from litekv.converters.checkpoint import load_checkpoint
        from litekv.errors import LitekvError
        try:
            load_checkpoint(sys.argv[1], with_tokenizer=False)
        except LitekvError as e:
            print("LITEKV", type(e).__name__, e)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                          timeout=timeout, cwd=TESTS)
    return done.stdout + done.stderr


# ---- safetensors files and shard indexes --------------------------------------------------------

def test_a_safetensors_header_naming_a_tensor_twice_is_refused(llama_dir):
    weights = llama_dir / "model.safetensors"
    header, data = safetensors_parts(weights)
    first = next(name for name in header if name != "__metadata__")
    entries = [f"{json.dumps(name)}: {json.dumps(meta)}" for name, meta in header.items()]
    entries.append(f"{json.dumps(first)}: {json.dumps(header[first])}")
    write_safetensors(weights, "{" + ", ".join(entries) + "}", data)
    with pytest.raises(CheckpointError, match=f"{weights}: safetensors header names '{first}' twice"):
        load_checkpoint(llama_dir, with_tokenizer=False)


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_a_shard_index_pointing_outside_the_directory_is_refused(llama_dir, tmp_path, where):
    other = make_checkpoint("llama", tmp_path / "other", seed=4)
    shard = "../other/model.safetensors" if where == "relative" else str(other / "model.safetensors")
    header, _ = safetensors_parts(other / "model.safetensors")
    (llama_dir / "model.safetensors").unlink()
    index = llama_dir / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {name: shard for name in header if name != "__metadata__"}}))
    with pytest.raises(CheckpointError, match="outside the model directory"):
        load_checkpoint(llama_dir, with_tokenizer=False)


@pytest.mark.parametrize("index", ["[]", '{"weight_map": []}', '{"weight_map": {"a": 3}}'])
def test_a_malformed_shard_index_is_refused(llama_dir, index):
    (llama_dir / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        load_checkpoint(llama_dir, with_tokenizer=False)


def test_a_tensor_stored_in_two_shards_is_refused(llama_dir):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(llama_dir / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    save_file({name: tensors[name] * 2}, str(llama_dir / "extra.safetensors"))
    weight_map = {n: "model.safetensors" for n in tensors} | {name: "extra.safetensors"}
    (llama_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"holds layers\.0\.up\.weight twice"):
        load_checkpoint(llama_dir, with_tokenizer=False)


@pytest.mark.parametrize("content", ["{not json", "[2]"])
def test_a_damaged_generation_config_is_refused(llama_dir, content):
    config = json.loads((llama_dir / "config.json").read_text())
    del config["eos_token_id"]  # so the loader reads generation_config.json
    (llama_dir / "config.json").write_text(json.dumps(config))
    (llama_dir / "generation_config.json").write_text(content)
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_checkpoint(llama_dir, with_tokenizer=False)


def test_a_config_json_that_is_not_utf8_is_refused(llama_dir):
    (llama_dir / "config.json").write_bytes(b'{"model_type": "llama\xff"}')
    with pytest.raises(CheckpointError, match="config.json: cannot be read as JSON"):
        load_checkpoint(llama_dir, with_tokenizer=False)


def test_a_weight_holding_nan_is_refused(llama_dir):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(llama_dir / "model.safetensors"))
    tensors["model.layers.1.self_attn.v_proj.weight"][3, 5] = np.nan
    save_file(tensors, str(llama_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"v_proj\.weight holds NaN or infinite values"):
        load_checkpoint(llama_dir, with_tokenizer=False)


def test_an_untied_head_missing_from_the_weights_is_refused_not_tied(llama_dir):
    from safetensors.numpy import load_file, save_file

    assert json.loads((llama_dir / "config.json").read_text())["tie_word_embeddings"] is False
    tensors = load_file(str(llama_dir / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(llama_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match="no lm_head.weight"):
        load_checkpoint(llama_dir, with_tokenizer=False)
    edit_config(llama_dir, tie_word_embeddings=True)  # said so, the embedding serves as the head
    assert load_checkpoint(llama_dir, with_tokenizer=False).config.tie_embeddings


def test_head_counts_that_do_not_divide_name_the_config_file(llama_dir):
    edit_config(llama_dir, num_key_value_heads=3)
    with pytest.raises(ConfigError, match=f"{llama_dir / 'config.json'}: .*multiple of num_kv_heads"):
        load_checkpoint(llama_dir, with_tokenizer=False)


# ---- refused before the heavy work ----------------------------------------------------------------

def drop_tensor(directory: Path) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"))


def rename_gguf_tensor(directory: Path) -> Path:
    path = make_gguf(directory, directory / "m.gguf")
    data = path.read_bytes()
    assert data.count(b"blk.1.ffn_up.weight") == 1
    path.write_bytes(data.replace(b"blk.1.ffn_up.weight", b"blk.1.ffn_uq.weight"))
    return path


@pytest.mark.parametrize("damage, error, message", [
    (drop_tensor, CheckpointError, r"missing: layers\.1\.down\.weight"),
    (lambda d: edit_config(d, intermediate_size=100), CheckpointError, "has shape"),
    (lambda d: (d / "tokenizer.json").unlink(), CheckpointNotFound, "tokenizer.json does not exist"),
    (rename_gguf_tensor, CheckpointError, r"missing: layers\.1\.up\.weight"),
], ids=["missing weight", "shape", "no tokenizer", "gguf missing tensor"])
def test_bad_checkpoints_are_refused_before_any_tensor_is_read(llama_dir, damage, error, message):
    source = damage(llama_dir) or llama_dir
    read: list[str] = []
    with pytest.raises(error, match=message):
        load_checkpoint(source, progress=lambda done, total, name: read.append(name))
    assert read == []


# ---- layer counts that would allocate gigabytes -------------------------------------------------

def test_a_billion_layers_in_config_json_is_refused_without_allocating(llama_dir):
    edit_config(llama_dir, num_hidden_layers=10**9)
    out = load_in_subprocess(llama_dir, memory_limit=3 << 30)
    assert f"LITEKV CheckpointError {llama_dir / 'config.json'}: num_hidden_layers is 1000000000" in out, out


def test_a_billion_blocks_in_gguf_metadata_are_refused_without_allocating(llama_dir):
    path = make_gguf(llama_dir, llama_dir / "m.gguf")
    patch_gguf_u32(path, "llama.block_count", 10**9)
    out = load_in_subprocess(path, memory_limit=3 << 30)
    assert f"LITEKV CheckpointError {path}: llama.block_count is 1000000000" in out, out


# ---- damaged GGUF files -------------------------------------------------------------------------

def test_a_gguf_array_longer_than_the_file_is_refused_at_once(tmp_path):
    import gguf

    path = tmp_path / "array.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_array("test.bytes", [1, 2, 3])
    writer.add_tensor("x", np.zeros(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(path.read_bytes())
    at = data.index(b"test.bytes") + len(b"test.bytes") + 4  # past the key and the ARRAY value type
    struct.pack_into("<IQ", data, at, int(gguf.GGUFValueType.UINT8), 10**12)  # 10**12 one-byte items
    path.write_bytes(bytes(data))
    try:
        out = load_in_subprocess(path, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("reading a 200-byte GGUF file did not finish in 30 s")
    assert f"LITEKV CheckpointError {path}: metadata field test.bytes declares 1000000000000 entries" in out, out


@pytest.mark.parametrize("size, message", [
    (1_000_000, "metadata field tokenizer.ggml.merges declares 48900 entries, more than the file can hold"),
    (2_000_000, "tensor token_embd.weight's data ends at byte 31866688, past the end of the file"),
], ids=["in metadata", "in tensor data"])
def test_a_truncated_gguf_says_where_it_ends(tmp_path, size, message):
    path = tmp_path / "smol.gguf"
    with open(smollm2_gguf(), "rb") as f:
        path.write_bytes(f.read(size))
    with pytest.raises(CheckpointError, match=f"{path}: {message}.*truncated"):
        load_checkpoint(path)


def test_a_gguf_tensor_offset_past_the_end_of_the_file_is_refused(llama_dir):
    import gguf

    path = make_gguf(llama_dir, llama_dir / "m.gguf")
    norm = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_norm.weight")
    data = bytearray(path.read_bytes())
    struct.pack_into("<Q", data, gguf_offset_at(norm), 2**40)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path}: tensor blk.0.attn_norm.weight's data ends at byte "
                                              r"\d+, past the end of the file"):
        load_checkpoint(path, with_tokenizer=False)


def gguf_offset_at(tensor) -> int:
    """Where a tensor's data offset (relative to the data section) sits in its GGUF file."""
    return tensor.field.offset + 8 + len(tensor.name) + 4 + 8 * len(tensor.shape) + 4


def test_gguf_tensors_whose_data_overlap_are_refused(llama_dir):
    import gguf

    path = make_gguf(llama_dir, llama_dir / "m.gguf")
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    attn, ffn = tensors["blk.0.attn_norm.weight"], tensors["blk.0.ffn_norm.weight"]
    data = bytearray(path.read_bytes())
    (ffn_offset,) = struct.unpack_from("<Q", data, gguf_offset_at(ffn))
    struct.pack_into("<Q", data, gguf_offset_at(attn), ffn_offset + 4)  # inside the other norm's bytes
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{path}: the data of tensors blk.0.ffn_norm.weight and "
                                              r"blk.0.attn_norm.weight overlap .*damaged"):
        load_checkpoint(path, with_tokenizer=False)


@pytest.mark.parametrize("key, value, message", [
    ("llama.attention.head_count_kv", 3, "multiple of num_kv_heads"),
    ("llama.attention.head_count", 0, ""),
])
def test_gguf_head_counts_that_do_not_fit_are_config_errors_naming_the_file(llama_dir, key, value, message):
    path = make_gguf(llama_dir, llama_dir / "m.gguf")
    patch_gguf_u32(path, key, value)
    with pytest.raises(ConfigError, match=f"{path}: .*{message}"):
        load_checkpoint(path, with_tokenizer=False)


# ---- int8 KV calibration -----------------------------------------------------------------------

def test_int8_kv_calibration_that_overflows_is_refused(llama_dir):
    from litekv.converters.kv_calibration import int8_kv_scales

    ckpt = load_checkpoint(llama_dir)
    weights = dict(ckpt.weights)
    weights["layers.0.k.weight"] = weights["layers.0.k.weight"] * np.float32(1e36)  # finite, keys ~1e36
    with np.errstate(over="ignore", invalid="ignore"), pytest.raises(CheckpointError, match="overflowed float32"):
        int8_kv_scales(ckpt.config, weights, ckpt.tokenizer, texts=("Hello world.",))
