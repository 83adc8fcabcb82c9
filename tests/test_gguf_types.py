"""GGUF tensor types: every listed type loads to exactly gguf's own dequantization; unsupported types,
truncated files and headers that lie are refused with errors naming the tensor and the problem."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_helpers import LISTED, add, add_tokenizer, encode, finish, llama_meta

from specdecode.model.config import UnsupportedModelError
from specdecode.model.gguf_loader import CorruptModelError, _unpermute, iter_state_dict, open_gguf
from specdecode.model.gguf_types import check_gguf_tensors
from specdecode.model.load import load_model

HIDDEN = 256  # one K-quant block per row


def _one_tensor_gguf(path: Path, qtype: str, rows: int = 8, seed: int = 0) -> np.ndarray:
    """A GGUF holding blk.0.ffn_up.weight [rows, 256] in qtype (plus what a config needs); gguf's reference."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((rows, HIDDEN)).astype(np.float32)
    data, ref = encode(values, qtype, rng)
    w = gguf.GGUFWriter(str(path), "llama")
    llama_meta(w, HIDDEN, rows, 1, 4, 4)
    add(w, "token_embd.weight", np.zeros((4, HIDDEN), dtype=np.float32), "F32")
    add(w, "blk.0.ffn_up.weight", data, qtype)
    finish(w)
    return ref


@pytest.mark.parametrize("qtype", LISTED)
def test_every_listed_type_loads_to_ggufs_dequantization(tmp_path: Path, qtype: str) -> None:
    from specdecode.model.gguf_loader import config_from_gguf_file

    path = tmp_path / f"{qtype}.gguf"
    ref = _one_tensor_gguf(path, qtype)
    entries = check_gguf_tensors(path)
    assert [gguf.GGMLQuantizationType(e.type_id).name for e in entries] == ["F32", qtype]
    cfg = config_from_gguf_file(path)
    got = dict(iter_state_dict(open_gguf(path), cfg, torch.float32))
    up = got["model.layers.0.mlp.up_proj.weight"]
    assert up.dtype == torch.float32 and tuple(up.shape) == ref.shape
    assert torch.equal(up, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32)))
    assert torch.isfinite(up).all() and up.abs().sum() > 0


def test_tiny_llama_gguf_with_every_type_loads_exactly(tiny_llama_dir: Path, home: Path) -> None:
    """A whole model whose tensors use all 13 types: load_model's weights equal gguf's dequantization."""
    rng = np.random.default_rng(1)
    path = home / "models" / "mixed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    vocab = add_tokenizer(w, tiny_llama_dir)
    llama_meta(w, HIDDEN, HIDDEN, 2, 4, 2)
    names = {"token_embd.weight": (vocab, "model.embed_tokens.weight"), "output.weight": (vocab, "lm_head.weight")}
    for i in range(2):
        for g, h, rows in (("attn_q", "self_attn.q_proj", 256), ("attn_k", "self_attn.k_proj", 128),
                           ("attn_v", "self_attn.v_proj", 128), ("attn_output", "self_attn.o_proj", 256),
                           ("ffn_gate", "mlp.gate_proj", 256), ("ffn_up", "mlp.up_proj", 256),
                           ("ffn_down", "mlp.down_proj", 256)):
            names[f"blk.{i}.{g}.weight"] = (rows, f"model.layers.{i}.{h}.weight")
    refs: dict[str, np.ndarray] = {}
    used = set()
    for j, (name, (rows, hf)) in enumerate(names.items()):
        qtype = LISTED[j % len(LISTED)]
        used.add(qtype)
        data, ref = encode((rng.standard_normal((rows, HIDDEN)) * 0.05).astype(np.float32), qtype, rng)
        add(w, name, data, qtype)
        if name.endswith("attn_q.weight"):
            ref = _unpermute(ref, 4)
        elif name.endswith("attn_k.weight"):
            ref = _unpermute(ref, 2)
        refs[hf] = ref
    for i in range(2):
        for g in ("attn_norm", "ffn_norm"):
            add(w, f"blk.{i}.{g}.weight", np.ones(HIDDEN, dtype=np.float32), "F32")
    add(w, "output_norm.weight", np.ones(HIDDEN, dtype=np.float32), "F32")
    finish(w)
    assert used == set(LISTED)

    lm = load_model(str(path), "fp32", "cpu")
    assert lm.config.vocab_size == vocab and lm.config.num_layers == 2
    state = {k: v for k, v in lm.model.state_dict().items()}
    for hf, ref in refs.items():
        if "proj" in hf and "mlp" not in hf and "o_proj" not in hf:
            i = hf.split(".")[2]
            qkv = state.get(f"model.layers.{i}.self_attn.qkv_proj.weight")
            if qkv is not None:
                off = {"q_proj": 0, "k_proj": 256, "v_proj": 384}[hf.split(".")[4]]
                got = qkv[off : off + ref.shape[0]]
            else:
                got = state[hf]
        elif "gate_proj" in hf or "up_proj" in hf:
            i = hf.split(".")[2]
            fused = f"model.layers.{i}.mlp.gate_up_proj.weight"
            if fused in state:
                got = state[fused][:256] if "gate_proj" in hf else state[fused][256:]
            else:
                got = state[hf]
        else:
            got = state[hf]
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32))), hf
    ids = lm.tokenizer.encode("def add(a, b):")
    hidden = lm.model(torch.tensor([ids]), torch.arange(len(ids))[None], lm.model.new_cache(1, 32))
    assert torch.isfinite(lm.model.compute_logits(hidden)).all()


# ---- refused: unsupported types, damaged files ------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["IQ4_XS", "TQ1_0", "I32"])
def test_unsupported_type_is_refused_naming_tensor_and_type(home: Path, qtype: str) -> None:
    path = home / "models" / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    llama_meta(w, HIDDEN, 8, 1, 4, 4)
    add(w, "token_embd.weight", np.zeros((4, HIDDEN), dtype=np.float32), "F32")
    t = gguf.GGMLQuantizationType[qtype]
    block, size = gguf.GGML_QUANT_SIZES[t]
    if qtype == "I32":
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((8, HIDDEN), dtype=np.int32))
    else:
        w.add_tensor("blk.0.ffn_up.weight", np.zeros((8, HIDDEN // block * size), dtype=np.uint8), raw_dtype=t)
    finish(w)
    with pytest.raises(UnsupportedModelError, match=rf"blk\.0\.ffn_up\.weight.*{qtype}") as info:
        load_model(str(path), "fp32", "cpu")
    assert "Q4_K" in str(info.value)  # says what is supported
    assert path.exists()  # unsupported is not damaged


def _good(path: Path) -> Path:
    _one_tensor_gguf(path, "Q4_K")
    return path


def _tensor_info_offset(data: bytes, name: str) -> int:
    """Byte offset of a tensor's info record (its name length field) in the header."""
    key = name.encode()
    i = data.index(len(key).to_bytes(8, "little") + key, 24)
    return i


def test_truncated_tensor_data_is_refused(home: Path) -> None:
    path = _good(home / "models" / "cut.gguf")
    raw = path.read_bytes()
    path.write_bytes(raw[:-100])
    with pytest.raises(CorruptModelError, match=r"blk\.0\.ffn_up\.weight.*truncated") as info:
        load_model(str(path), "fp32", "cpu")
    assert "bytes" in str(info.value)
    assert not path.exists()  # a damaged file in our cache is removed so the next run fetches it again


def test_bad_magic_is_refused(tmp_path: Path) -> None:
    path = _good(tmp_path / "m.gguf")
    raw = bytearray(path.read_bytes())
    raw[:4] = b"GGUX"
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptModelError, match="magic"):
        load_model(str(path), "fp32", "cpu")
    assert path.exists()  # a user's own file is never deleted


def test_header_that_lies_about_a_shape_is_refused(tmp_path: Path) -> None:
    path = _good(tmp_path / "lie.gguf")
    raw = bytearray(path.read_bytes())
    i = _tensor_info_offset(bytes(raw), "blk.0.ffn_up.weight") + 8 + len("blk.0.ffn_up.weight")
    assert int.from_bytes(raw[i : i + 4], "little") == 2  # n_dims
    raw[i + 4 + 8 : i + 4 + 16] = (64).to_bytes(8, "little")  # 8 rows -> 64 rows: data past the end
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptModelError, match=r"blk\.0\.ffn_up\.weight.*needs bytes"):
        load_model(str(path), "fp32", "cpu")


def test_row_length_not_a_whole_block_is_refused(tmp_path: Path) -> None:
    path = _good(tmp_path / "rows.gguf")
    raw = bytearray(path.read_bytes())
    i = _tensor_info_offset(bytes(raw), "blk.0.ffn_up.weight") + 8 + len("blk.0.ffn_up.weight")
    raw[i + 4 : i + 12] = (200).to_bytes(8, "little")  # 256 values a row -> 200: not a Q4_K block
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptModelError, match=r"blk\.0\.ffn_up\.weight.*not a whole number"):
        load_model(str(path), "fp32", "cpu")


def test_overlapping_tensors_are_refused(tmp_path: Path) -> None:
    path = _good(tmp_path / "overlap.gguf")
    raw = bytearray(path.read_bytes())
    name = "blk.0.ffn_up.weight"
    i = _tensor_info_offset(bytes(raw), name) + 8 + len(name) + 4 + 16 + 4  # its data offset
    raw[i : i + 8] = (0).to_bytes(8, "little")  # now starts where token_embd's data starts
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptModelError, match="overlap"):
        load_model(str(path), "fp32", "cpu")


def test_unknown_type_id_is_corrupt(tmp_path: Path) -> None:
    path = _good(tmp_path / "tid.gguf")
    raw = bytearray(path.read_bytes())
    name = "blk.0.ffn_up.weight"
    i = _tensor_info_offset(bytes(raw), name) + 8 + len(name) + 4 + 16
    raw[i : i + 4] = (9999).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptModelError, match=r"blk\.0\.ffn_up\.weight.*type id 9999"):
        load_model(str(path), "fp32", "cpu")


def test_shape_that_contradicts_the_metadata_is_refused(tmp_path: Path) -> None:
    """Tensor table consistent with the file, but the shapes do not fit the model the metadata describes."""
    path = tmp_path / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    llama_meta(w, HIDDEN, HIDDEN, 1, 4, 4)
    add(w, "token_embd.weight", np.zeros((4, HIDDEN), dtype=np.float32), "F32")
    add(w, "blk.0.ffn_up.weight", np.zeros((8, HIDDEN), dtype=np.float32), "F32")  # 8 rows, metadata says 256
    finish(w)
    from specdecode.model import load as load_mod

    with pytest.raises(CorruptModelError, match=r"up_proj.*\[8, 256\].*\[256, 256\]"):
        load_mod._convert_gguf(path, torch.float32, tmp_path / "out")
