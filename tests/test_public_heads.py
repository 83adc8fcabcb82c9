"""Public head checkpoints (SafeAILab EAGLE-1/2 and EAGLE-3, FasterDecoding Medusa) with random weights for
the tiny targets: each converts to exactly the published maths (checked against a plain-torch transcription of
it), gives greedy output equal to plain decoding, loads from a Hugging Face id, and is refused clearly when it
does not fit the target."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import _save_tokenizer
from safetensors.torch import save_file
from test_hub import put_in_cache
from tiny_helpers import GREEDY, run_batched, tiny_prompts

from specdecode import LLM
from specdecode.heads.modules import IncompatibleHeadError
from specdecode.heads.persist import load_head
from specdecode.heads.public import Eagle1Head, Eagle3Head, PublicMedusaHeads
from specdecode.model.load import load_model

D, HEADS, KV, FF = 64, 4, 2, 96  # the tiny targets' shapes (conftest); FF: the head's own MLP width
VOCAB = 320
DRAFT_VOCAB = 96  # a multiple of 16: bf16 runs pack a head's rows for torch's int4 kernel


def _llama_cfg(**kw: object) -> dict[str, object]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": D,
            "intermediate_size": FF, "num_attention_heads": HEADS, "num_key_value_heads": KV,
            "num_hidden_layers": 1, "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "hidden_act": "silu", "max_position_embeddings": 512, "rope_scaling": None, **kw}


def _rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
    return torch.randn(*shape) * scale


def _layer_weights(prefix: str, in_dim: int) -> dict[str, torch.Tensor]:
    hd = D // HEADS
    return {
        f"{prefix}self_attn.q_proj.weight": _rand(HEADS * hd, in_dim), f"{prefix}self_attn.k_proj.weight":
        _rand(KV * hd, in_dim), f"{prefix}self_attn.v_proj.weight": _rand(KV * hd, in_dim),
        f"{prefix}self_attn.o_proj.weight": _rand(D, HEADS * hd), f"{prefix}mlp.gate_proj.weight": _rand(FF, D),
        f"{prefix}mlp.up_proj.weight": _rand(FF, D), f"{prefix}mlp.down_proj.weight": _rand(D, FF),
        f"{prefix}post_attention_layernorm.weight": 1 + _rand(D, scale=0.1),
    }


def write_eagle1(out: Path, seed: int = 0, bin_file: bool = True, own_embed: bool = False, **cfg: object) -> Path:
    """SafeAILab EAGLE-1/2 layout: fc over concat(embedding, feature), layers.0.* without input_layernorm;
    own_embed: the checkpoint carries embed_tokens.weight (EAGLE loads it over the target's)."""
    torch.manual_seed(seed)
    out.mkdir(parents=True)
    hidden = int(cfg.get("hidden_size", D))  # type: ignore[call-overload]
    state = {"fc.weight": _rand(hidden, 2 * hidden), "fc.bias": _rand(hidden), **_layer_weights("layers.0.", D)}
    if own_embed:
        state["embed_tokens.weight"] = _rand(VOCAB, D, scale=1.0)
        state["layers.0.self_attn.rotary_emb.inv_freq"] = 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16)
    (out / "config.json").write_text(json.dumps(_llama_cfg(**cfg)))
    if bin_file:
        torch.save(state, out / "pytorch_model.bin")
    else:
        save_file(state, str(out / "model.safetensors"))
    return out


def write_eagle3(out: Path, layers: list[int] | None, seed: int = 0, vocab: int = VOCAB,
                 layer_prefix: str = "midlayer.") -> Path:
    """SafeAILab EAGLE-3 layout: fc over 3 fused layers, midlayer.* (q/k/v over 2D), norm, own lm_head over a
    draft vocabulary, d2t (target id - draft row) and t2d."""
    torch.manual_seed(seed)
    out.mkdir(parents=True)
    ids = torch.sort(torch.randperm(vocab)[:DRAFT_VOCAB]).values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    state = {"fc.weight": _rand(D, 3 * D), **_layer_weights("midlayer.", 2 * D),
             "midlayer.input_layernorm.weight": 1 + _rand(D, scale=0.1),
             "midlayer.hidden_norm.weight": 1 + _rand(D, scale=0.1), "norm.weight": 1 + _rand(D, scale=0.1),
             "lm_head.weight": _rand(DRAFT_VOCAB, D, scale=1.0), "d2t": ids - torch.arange(DRAFT_VOCAB), "t2d": t2d}
    cfg = _llama_cfg(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=DRAFT_VOCAB, vocab_size=vocab)
    if layers is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layers}
    (out / "config.json").write_text(json.dumps(cfg))
    state = {(layer_prefix + k.removeprefix("midlayer.") if k.startswith("midlayer.") else k): v
             for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"))
    return out


def write_medusa(out: Path, heads: int = 3, layers: int = 1, prefix: str = "", vocab: int = VOCAB,
                 hidden: int = D, seed: int = 0) -> Path:
    """FasterDecoding Medusa: medusa_lm_head.pt with {i}.{j}.linear.* ResBlocks and {i}.{layers}.weight."""
    torch.manual_seed(seed)
    out.mkdir(parents=True)
    state = {}
    for i in range(heads):
        for j in range(layers):
            state[f"{prefix}{i}.{j}.linear.weight"] = _rand(hidden, hidden)
            state[f"{prefix}{i}.{j}.linear.bias"] = _rand(hidden)
        state[f"{prefix}{i}.{layers}.weight"] = _rand(vocab, hidden, scale=1.0)
    (out / "config.json").write_text(json.dumps({"medusa_num_heads": heads, "medusa_num_layers": layers,
                                                 "base_model_name_or_path": "org/tiny"}))
    if prefix:
        save_file(state, str(out / "model.safetensors"))
    else:
        torch.save(state, out / "medusa_lm_head.pt")
    return out


# ---- plain-torch transcriptions of the published maths -------------------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def attention(x: torch.Tensor, s: dict[str, torch.Tensor], p: str, theta: float = 10000.0) -> torch.Tensor:
    """HF Llama attention (rotate_half rope, GQA, causal) over x [T, in]."""
    t, hd = x.shape[0], D // HEADS
    q = (x @ s[f"{p}q_proj.weight"].T).view(t, HEADS, hd).transpose(0, 1)
    k = (x @ s[f"{p}k_proj.weight"].T).view(t, KV, hd).transpose(0, 1)
    v = (x @ s[f"{p}v_proj.weight"].T).view(t, KV, hd).transpose(0, 1)
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(t).float()[:, None] * inv[None]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rot(z: torch.Tensor) -> torch.Tensor:
        return z * cos + torch.cat([-z[..., hd // 2 :], z[..., : hd // 2]], -1) * sin

    q, k = rot(q), rot(k)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd) + torch.full((t, t), float("-inf")).triu(1)
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, HEADS * hd)
    return out @ s[f"{p}o_proj.weight"].T


def mlp(x: torch.Tensor, s: dict[str, torch.Tensor], p: str) -> torch.Tensor:
    return (F.silu(x @ s[f"{p}gate_proj.weight"].T) * (x @ s[f"{p}up_proj.weight"].T)) @ s[f"{p}down_proj.weight"].T


def eagle1_reference(s: dict[str, torch.Tensor], emb: torch.Tensor, feats: torch.Tensor,
                     lm_head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cnets1.Model.forward + topK_genrate's `head(last_hidden)`: (next features, logits)."""
    x = torch.cat([emb, feats], -1) @ s["fc.weight"].T + s["fc.bias"]
    h = x + attention(x, s, "layers.0.self_attn.")  # index 0: no input_layernorm
    h = h + mlp(rms(h, s["layers.0.post_attention_layernorm.weight"]), s, "layers.0.mlp.")
    return h, h @ lm_head.T


def eagle3_reference(s: dict[str, torch.Tensor], emb: torch.Tensor,
                     fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cnets.Model.forward (fc, then LlamaDecoderLayeremb) + `lm_head(norm(h))`: (next features, logits)."""
    h = fused @ s["fc.weight"].T
    x = torch.cat([rms(emb, s["midlayer.input_layernorm.weight"]), rms(h, s["midlayer.hidden_norm.weight"])], -1)
    h = h + attention(x, s, "midlayer.self_attn.")
    h = h + mlp(rms(h, s["midlayer.post_attention_layernorm.weight"]), s, "midlayer.mlp.")
    return h, rms(h, s["norm.weight"]) @ s["lm_head.weight"].T


# ---- fixtures -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_llama_dir: Path):  # noqa: ANN201
    return load_model(str(tiny_llama_dir), "fp32", "cpu").model


@pytest.fixture(scope="module")
def deep_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with 7 layers: EAGLE-3's default layers 2, L//2, L-3 are distinct (2, 3, 4)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("deep_llama")
    vocab = _save_tokenizer(path, VOCAB)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=D, intermediate_size=128, num_hidden_layers=7,
                      num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=512,
                      rms_norm_eps=1e-6, initializer_range=0.25, eos_token_id=2, bos_token_id=0, pad_token_id=0)
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    return path


def _spec(head: Path | str, method: str = "eagle", **kw: object) -> dict[str, object]:
    return {"method": method, "model": str(head), "num_speculative_tokens": 3, **kw}


# ---- EAGLE-1/2 ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("own_embed", [False, True])
def test_eagle1_matches_published_maths(target, tmp_path: Path, own_embed: bool) -> None:  # noqa: ANN001
    path = write_eagle1(tmp_path / "eagle", own_embed=own_embed)
    head = load_head(path, target, kind="eagle")
    assert isinstance(head, Eagle1Head) and head.config.feature_layers == []
    assert (head.own_embed is not None) == own_embed
    s = torch.load(path / "pytorch_model.bin", weights_only=True)
    torch.manual_seed(1)
    t = 7
    feats, toks = torch.randn(t, D), torch.randint(0, VOCAB, (t,))
    with torch.no_grad():
        out = head(feats[None], toks[None], torch.arange(t)[None])[0]
        logits = head.full_logits(out)
    emb = (s["embed_tokens.weight"] if own_embed else target.model.embed_tokens.weight)[toks]
    want_h, want_logits = eagle1_reference(s, emb, feats, target.lm_head.weight)
    torch.testing.assert_close(out, want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bin_file", [True, False])
def test_eagle1_greedy_equals_plain(plain_tiny, tiny_llama_dir: Path, tmp_path: Path, bin_file: bool) -> None:  # noqa: ANN001
    base, want = plain_tiny
    path = write_eagle1(tmp_path / "eagle", bin_file=bin_file)
    for width in (None, 1):
        llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=_spec(path, draft_tree_width=width))
        assert isinstance(llm.head, Eagle1Head)
        outs = llm.generate(tiny_prompts(base), GREEDY)
        assert [o.token_ids for o in outs] == want
        assert outs[0].metrics["draft_tokens"] > 0


def test_eagle1_without_fc_bias(target, tmp_path: Path) -> None:  # noqa: ANN001
    path = write_eagle1(tmp_path / "eagle", bias=False)
    state = torch.load(path / "pytorch_model.bin", weights_only=True)
    del state["fc.bias"]
    torch.save(state, path / "pytorch_model.bin")
    head = load_head(path, target)
    assert torch.equal(head.fc.bias, torch.zeros(D))


# ---- EAGLE-3 --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layer_prefix", ["midlayer.", "layers.0."])  # SafeAILab's name, vLLM/speculators'
def test_eagle3_matches_published_maths(target, tmp_path: Path, layer_prefix: str) -> None:  # noqa: ANN001
    path = write_eagle3(tmp_path / "eagle3", layers=[0, 1, 2], layer_prefix=layer_prefix)
    head = load_head(path, target, kind="eagle")
    assert isinstance(head, Eagle3Head) and head.config.feature_layers == [0, 1, 2]
    from safetensors.torch import load_file

    s = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
         for k, v in load_file(str(path / "model.safetensors")).items()}
    assert torch.equal(head.d2t, s["d2t"] + torch.arange(DRAFT_VOCAB))
    assert torch.equal(head.d2t, torch.nonzero(s["t2d"])[:, 0])
    torch.manual_seed(2)
    t = 6
    fused, toks = torch.randn(t, 3 * D), torch.randint(0, VOCAB, (t,))
    with torch.no_grad():
        out = head(head.input_features(fused)[None], toks[None], torch.arange(t)[None])[0]
        small = head.draft_logits(out)
        full = head.full_logits(out)
    want_h, want_logits = eagle3_reference(s, target.model.embed_tokens.weight[toks], fused)
    torch.testing.assert_close(out, want_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(small, want_logits, rtol=1e-5, atol=1e-4)
    # Draft row i is target id i + d2t[i]; every other target id is never proposed.
    assert torch.equal(full[:, head.d2t], small)
    assert torch.isinf(full).sum() == t * (VOCAB - DRAFT_VOCAB)


def test_eagle3_greedy_equals_plain_with_default_layers(deep_llama_dir: Path, tmp_path: Path) -> None:
    plain = LLM(str(deep_llama_dir), dtype="fp32")
    prompts = tiny_prompts(plain)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    path = write_eagle3(tmp_path / "eagle3", layers=None)  # EAGLE-3's own choice: inputs of layers 2, 3, 4
    for width in (None, 1):
        llm = LLM(str(deep_llama_dir), dtype="fp32", speculative_config=_spec(path, draft_tree_width=width))
        assert isinstance(llm.head, Eagle3Head)
        assert llm.target.model.capture_layers == (2, 3, 4)
        outs = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in outs] == want
        assert outs[0].metrics["draft_tokens"] > 0


def test_eagle3_on_a_target_too_shallow_for_its_layers_is_refused(target, tmp_path: Path) -> None:  # noqa: ANN001
    path = write_eagle3(tmp_path / "eagle3", layers=None)  # 2-layer target: EAGLE-3's rule finds 1 layer
    with pytest.raises(IncompatibleHeadError, match=r"fc takes 192 features.*layers \[1\] \(of 2\)"):
        load_head(path, target)


# ---- Medusa ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("prefix", "layers"), [("", 1), ("medusa_lm_head.", 2), ("medusa_head.", 1)])
def test_medusa_matches_published_maths(target, tmp_path: Path, prefix: str, layers: int) -> None:  # noqa: ANN001
    path = write_medusa(tmp_path / "medusa", heads=3, layers=layers, prefix=prefix)
    head = load_head(path, target, kind="medusa")
    assert isinstance(head, PublicMedusaHeads) and len(head.blocks) == 3
    files = list(path.glob("*.pt")) + list(path.glob("*.safetensors"))
    if files[0].suffix == ".pt":
        s = torch.load(files[0], weights_only=True)
    else:
        from safetensors.torch import load_file

        s = load_file(str(files[0]))
    s = {k.removeprefix(prefix): v for k, v in s.items()}
    x = torch.randn(D)
    with torch.no_grad():
        got = head.draft_logits(head(x))
    for i in range(3):
        h = x
        for j in range(layers):
            h = h + F.silu(h @ s[f"{i}.{j}.linear.weight"].T + s[f"{i}.{j}.linear.bias"])
        torch.testing.assert_close(got[i], h @ s[f"{i}.{layers}.weight"].T, rtol=1e-5, atol=1e-4)


def test_medusa_greedy_equals_plain(plain_tiny, tiny_llama_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    base, want = plain_tiny
    path = write_medusa(tmp_path / "medusa", heads=3)
    for width in (None, 1):
        llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=_spec(path, "medusa", draft_tree_width=width))
        assert isinstance(llm.head, PublicMedusaHeads)
        outs = llm.generate(tiny_prompts(base), GREEDY)
        assert [o.token_ids for o in outs] == want
        assert outs[0].metrics["draft_tokens"] > 0


def test_public_heads_in_continuous_batching(plain_tiny, tiny_llama_dir: Path, tmp_path: Path) -> None:  # noqa: ANN001
    base, want = plain_tiny
    for path, method in ((write_eagle1(tmp_path / "eagle"), "eagle"), (write_medusa(tmp_path / "medusa"), "medusa")):
        llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=_spec(path, method))
        seqs = run_batched(llm, tiny_prompts(base), GREEDY)
        assert [s.output_ids for s in seqs] == want


# ---- from a Hugging Face id; refusals --------------------------------------------------------------------------


def test_public_head_from_hub_id(plain_tiny, tiny_llama_dir: Path, tmp_path: Path,  # noqa: ANN001
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    put_in_cache(tmp_path / "hub", "org/tiny-eagle", write_eagle1(tmp_path / "eagle"))
    put_in_cache(tmp_path / "hub", "org/tiny-medusa", write_medusa(tmp_path / "medusa"))
    base, want = plain_tiny
    for repo, method, cls in (("org/tiny-eagle", "eagle", Eagle1Head), ("org/tiny-medusa", "medusa",
                                                                         PublicMedusaHeads)):
        llm = LLM(str(tiny_llama_dir), dtype="fp32", speculative_config=_spec(repo, method))
        assert isinstance(llm.head, cls)
        assert [o.token_ids for o in llm.generate(tiny_prompts(base), GREEDY)] == want


def test_heads_that_do_not_fit_the_target_are_refused(target, tmp_path: Path) -> None:  # noqa: ANN001
    cases = [
        (write_eagle1(tmp_path / "wide", hidden_size=32), r"EAGLE head has hidden size 32 but the target has 64"),
        (write_eagle1(tmp_path / "vocab", vocab_size=500), r"vocabulary size 500 but the target has 320"),
        (write_eagle1(tmp_path / "deep", num_hidden_layers=2), r"2 decoder layers is not supported"),
        (write_eagle1(tmp_path / "rope", rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_scaling"),
        (write_eagle1(tmp_path / "gelu", hidden_act="gelu"), "hidden_act 'gelu'"),
        (write_medusa(tmp_path / "m_vocab", vocab=500), r"Medusa head has vocabulary size 500 but the target has 320"),
        (write_medusa(tmp_path / "m_wide", hidden=32), r"Medusa head has hidden size 32 but the target has 64"),
        (write_eagle3(tmp_path / "e3_vocab", layers=[0, 1, 2], vocab=500), r"vocabulary size 500 .* 320"),
    ]
    for path, msg in cases:
        with pytest.raises(IncompatibleHeadError, match=msg):
            load_head(path, target)
    with pytest.raises(IncompatibleHeadError, match="public medusa head, not a eagle head"):
        load_head(write_medusa(tmp_path / "kind"), target, kind="eagle")
    no_bias = write_medusa(tmp_path / "m_nobias")
    state = torch.load(no_bias / "medusa_lm_head.pt", weights_only=True)
    del state["1.0.linear.bias"]
    torch.save(state, no_bias / "medusa_lm_head.pt")
    with pytest.raises(IncompatibleHeadError, match=r"lacks \['1\.0\.linear\.bias'\]"):
        load_head(no_bias, target)
    junk = tmp_path / "junk"
    junk.mkdir()
    save_file({"something.weight": torch.zeros(2)}, str(junk / "model.safetensors"))
    with pytest.raises(IncompatibleHeadError, match="unrecognised head checkpoint"):
        load_head(junk, target)


def test_cli_head_shorthand_reads_the_kind_of_public_heads(tmp_path: Path) -> None:
    import argparse

    from specdecode.cli_args import add_model_args, speculative_config_from_args

    p = argparse.ArgumentParser()
    add_model_args(p)
    for path, kind in ((write_eagle1(tmp_path / "e1"), "eagle"), (write_eagle3(tmp_path / "e3", [0, 1, 2]), "eagle"),
                       (write_medusa(tmp_path / "m"), "medusa"), (write_medusa(tmp_path / "m2", prefix="medusa_head."),
                                                                  "medusa")):
        cfg = speculative_config_from_args(p.parse_args(["--head", str(path)]))
        assert cfg == {"method": kind, "model": str(path)}


def test_public_heads_run_in_bf16(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The default precision: the heads' linears take this CPU's draft formats (int4 / int8 / bf16 packing)."""
    from specdecode import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for path, method in ((write_eagle1(tmp_path / "e1"), "eagle"), (write_eagle3(tmp_path / "e3", [0, 1, 2]), "eagle"),
                         (write_medusa(tmp_path / "m"), "medusa")):
        llm = LLM(str(tiny_llama_dir), dtype="bf16", speculative_config=_spec(path, method))
        out = llm.generate("def add(a, b):", params)[0]
        assert len(out.token_ids) == 12 and out.metrics["draft_tokens"] > 0
