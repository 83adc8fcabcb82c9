"""The decoder layers in one native call (specdecode.model.native_stack): the same bits as the module-by-module
forward, for every native linear format, one token and trees of several rows, one row and a batch."""

from __future__ import annotations

import pytest
import torch

from specdecode.model import native_kernels, native_stack
from specdecode.model.config import ModelConfig
from specdecode.model.fast_linear import convert_linears
from specdecode.model.transformer import Transformer

pytestmark = pytest.mark.skipif(not native_kernels.available(), reason="no AVX512-BF16 CPU or no C compiler")


def random_model(seed: int = 0) -> Transformer:
    """A random bf16 Qwen2-style model whose widths every native kernel takes (int4: multiples of 128)."""
    cfg = ModelConfig(arch="qwen2", vocab_size=97, hidden_size=128, intermediate_size=256, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6,
                      max_position_embeddings=256, tie_word_embeddings=False, attention_bias=True)
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        for layer in model.model.layers:
            layer.input_layernorm.weight.normal_(1.0, 0.2)
            layer.post_attention_layernorm.weight.normal_(1.0, 0.2)
    return model.fuse_projections().to(torch.bfloat16).eval()


def forward_both(model: Transformer, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor | None,
                 mask: torch.Tensor | None, prefix: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hidden states and caches of the native stack and of the module-by-module forward, after the same
    prefix (prefill) in each cache."""
    b = tokens.shape[0]
    out, caches = [], []
    for use_stack in (True, False):
        cache = model.new_cache(b, 64)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, model.config.vocab_size, (b, prefix), generator=gen)
        model(ids, torch.arange(prefix).expand(b, prefix), cache)  # prefill (> 16 rows): module by module
        native_stack.set_enabled(model, use_stack)
        out.append(model(tokens, positions, cache, slots, mask))
        assert (model._native_stack[2] is not None) == use_stack
        caches.append(cache)
    native_stack.set_enabled(model, True)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
    return out[0], out[1], caches[0].k


def assert_stack_bits_one_token_and_tree(model: Transformer) -> None:
    """The stack's hidden states equal the module-by-module forward's for one token and for a tree."""
    assert native_stack.build(model) is not None
    # one token
    a, b, _ = forward_both(model, torch.tensor([[5]]), torch.tensor([[20]]), None, None, prefix=20)
    assert torch.equal(a, b)
    # a tree of 5 nodes at scattered slots, with its mask over the prefix and the ancestors
    parents = [-1, 0, 0, 1, 2]
    mask = torch.zeros(1, 5, 26, dtype=torch.bool)
    mask[0, :, :20] = True
    for i, p in enumerate(parents):
        mask[0, i, 20 + i] = True
        while p >= 0:
            mask[0, i, 20 + p] = True
            p = parents[p]
    depth = torch.tensor([[0, 1, 1, 2, 2]])
    a, b, _ = forward_both(model, torch.tensor([[5, 9, 11, 3, 4]]), 20 + depth, 20 + torch.arange(5)[None], mask,
                           prefix=20)
    assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["bf16", "int8-dynamic", "int8", "int4", "int4-hybrid"])
def test_stack_gives_the_module_forwards_bits(fmt: str) -> None:
    model = random_model()
    convert_linears(model, fmt)  # type: ignore[arg-type]
    assert_stack_bits_one_token_and_tree(model)


def test_stack_takes_a_batch_and_chains() -> None:
    model = random_model(seed=1)
    convert_linears(model, "int8-dynamic")
    tokens = torch.tensor([[5, 6, 7], [8, 9, 10]])
    positions = torch.tensor([[12, 13, 14], [12, 13, 14]])
    a, b, _ = forward_both(model, tokens, positions, None, None, prefix=12)
    assert torch.equal(a, b)


@torch.inference_mode()  # as Transformer.forward runs: the native glue never takes autograd tensors
def test_stack_is_left_for_unsupported_forwards() -> None:
    model = random_model()
    x = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    cache = model.new_cache(1, 8)
    assert native_stack.stack_for(model, x, cache) is None  # nn.Linear: no native path
    convert_linears(model, "bf16")
    assert native_stack.stack_for(model, x, cache) is not None  # rebuilt after the conversion
    assert native_stack.stack_for(model, x, model.new_cache(1, 8, torch.float32)) is None  # fp32 cache
    # Every bf16 kernel takes any row count (Transformer.forward keeps the stack to decode / verification steps).
    assert native_stack.stack_for(model, torch.zeros(1, 70, 128, dtype=torch.bfloat16), cache) is not None
    model = random_model()
    convert_linears(model, "int4-hybrid")
    assert native_stack.stack_for(model, torch.zeros(1, 9, 128, dtype=torch.bfloat16), cache) is None  # > 8 rows
    assert native_stack.stack_for(model, torch.zeros(1, 8, 128, dtype=torch.bfloat16), cache) is not None


def test_stack_writes_through_a_row_view_of_a_larger_cache() -> None:
    """The batch engine runs the target over `cache.rows(a, b)`: a view whose rows are not contiguous across
    layers. The stack writes and reads it as the module-by-module forward does."""
    model = random_model(seed=2)
    convert_linears(model, "bf16")
    out, caches = [], []
    for use_stack in (True, False):
        owner = model.new_cache(3, 32)
        view = owner.rows(1, 3)
        native_stack.set_enabled(model, use_stack)
        ids = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]])
        out.append(model(ids, torch.arange(4).expand(2, 4), view))
        assert (model._native_stack[2] is not None) == use_stack
        caches.append(owner)
    assert torch.equal(out[0], out[1])
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize("layers", [(0, 2), (1, 3), (0, 1, 2, 3)])
def test_stack_captures_the_layers_a_fused_head_reads(layers: tuple[int, ...]) -> None:
    """With capture layers the stack runs in stretches between them; output, caches and the captured residual
    streams [B, T, len * D] are the module-by-module forward's bits (layer 3 = after the last of 3)."""
    model = random_model(seed=3)
    convert_linears(model, "bf16")
    model.capture_layers = layers
    tokens, positions = torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([[12, 13, 14], [12, 13, 14]])
    captured = []
    for use_stack in (True, False):
        native_stack.set_enabled(model, use_stack)
        cache = model.new_cache(2, 64)
        model(torch.ones(2, 12, dtype=torch.long), torch.arange(12).expand(2, 12), cache)
        out = model(tokens, positions, cache)
        captured.append((out, model.captured, cache.k.clone()))
    native_stack.set_enabled(model, True)
    (a, ca, ka), (b, cb, kb) = captured
    assert ca.shape == (2, 3, 128 * len(layers))
    assert torch.equal(a, b) and torch.equal(ca, cb) and torch.equal(ka, kb)
    model.capture_layers = ()
    plain = model(tokens, positions, model.new_cache(2, 64))
    assert model.captured is None and plain.shape == a.shape
