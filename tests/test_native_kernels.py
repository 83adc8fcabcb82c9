"""The AVX512 kernels (specdecode.model.native_gemm: weight-only int8 / int4, and bf16; native_kernels: the decoder
ops) and their use by the linears.

Parity with the dequantized weights uses the bounds of test_quantized_linears, for our kernel and for
torch's (the fallback) alike. A row's output must not depend on the other rows of the forward: that is
what makes speculative verification on a weight-only target give the tokens of plain decoding.
"""

from __future__ import annotations

import pytest
import torch
from linear_helpers import BF16_HALF_ULP, FP32_ULP, bf16_linear, check_bound, inputs

from specdecode.model import native_kernels, native_layouts
from specdecode.model.bf16_linear import BF16Linear
from specdecode.model.f32_linear import F32Linear
from specdecode.model.int4_linear import Int4WeightLinear
from specdecode.model.int8_linear import Int8WeightLinear

needs_native = pytest.mark.skipif(not native_kernels.available(), reason="no AVX512-BF16 CPU or no C compiler")
KERNELS = [pytest.param(True, id="native", marks=needs_native), pytest.param(False, id="torch")]
CLASSES = {"int8": Int8WeightLinear, "int4": Int4WeightLinear, "bf16": BF16Linear}


def test_pack_int4_layout() -> None:
    q = (torch.arange(256) * 7 % 16).to(torch.uint8).reshape(1, 256)  # two groups of 128
    packed = native_layouts.pack_int4(q)
    assert packed.shape == (1, 128)
    assert torch.equal(native_layouts.unpack_int4(packed), q)
    for group in range(2):
        for i in range(32):
            word = int(packed[0, group * 64 + 2 * i]) | int(packed[0, group * 64 + 2 * i + 1]) << 8
            for nibble in range(4):
                assert (word >> 4 * nibble) & 0xF == int(q[0, group * 128 + i + 32 * nibble])


def test_tile_rows_layout() -> None:
    """Blocks of 16 rows, 64-byte chunks, chunk c of a block's rows together; zero padding; exact inverse."""
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (20, 70), generator=g, dtype=torch.int8)  # 2 blocks (of 16), 2 chunks (of 64)
    tiles = native_layouts.tile_rows(w)
    assert tiles.shape == (2, 2, 16, 64) and tiles.dtype == torch.uint8
    for n in (0, 15, 16, 19):
        for k in (0, 63, 64, 69):
            assert int(tiles[n // 16, k // 64, n % 16, k % 64].view(torch.int8)) == int(w[n, k])
    assert not tiles[1, :, 4:].any() and not tiles[:, 1, :, 6:].any()  # padding rows and bytes are zero
    assert torch.equal(native_layouts.untile_rows(tiles, 20, 70, torch.int8), w)
    wb = torch.randn(37, 200, generator=g).bfloat16()  # 2 bytes a weight: 400 bytes a row, 7 chunks
    tiles = native_layouts.tile_rows(wb)
    assert tiles.shape == (3, 7, 16, 64)
    assert torch.equal(native_layouts.untile_rows(tiles, 37, 200, torch.bfloat16), wb)
    tiles = native_layouts.tile_rows(w, rows_per_tile=4)  # the int4 kernel's tiles
    assert tiles.shape == (5, 2, 4, 64)
    assert int(tiles[4, 1, 3, 5].view(torch.int8)) == int(w[19, 69])
    assert torch.equal(native_layouts.untile_rows(tiles, 20, 70, torch.int8), w)


@needs_native
@pytest.mark.parametrize("rows", [1, 3])
def test_int4_partial_last_tile(rows: int) -> None:
    """102 output channels: the last 4-row tile holds 2 rows and 2 of zero padding, never written out."""
    lin = bf16_linear(102, 256, seed=11)
    module = Int4WeightLinear(lin, native=True)
    assert module.packed.shape == (26, 2, native_layouts.INT4_TILE_ROWS, 64)
    x = inputs(rows, 256, seed=12).bfloat16()
    check_bound(module(x), x.double(), module.dequantized(), lin.bias.detach(), BF16_HALF_ULP)


@pytest.mark.parametrize("native", KERNELS)
@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_parity_with_dequantized_weights(native: bool, fmt: str, rows: int) -> None:
    """bf16 in and out, then fp32 in and out (only our kernel keeps fp32: torch's rounds to bf16)."""
    lin = bf16_linear(256, 512, seed=rows)
    module = CLASSES[fmt](lin, native=native)
    w, b = module.dequantized(), lin.bias.detach()
    x = inputs(rows, 512, seed=100 + rows).bfloat16()
    check_bound(module(x), x.double(), w, b, BF16_HALF_ULP)
    with pytest.raises(AssertionError, match="the bound"):  # the bound sees the quantization
        check_bound(module(x), x.double(), lin.weight.detach(), b, BF16_HALF_ULP)
    if native:
        y = module(x.float())
        assert y.dtype == torch.float32
        # int4: sums of x * (128 + q) minus 128 * sum(x): fp32 slack for products up to ~16x |x * w|.
        rel = 4 * FP32_ULP if fmt == "int8" else 64 * FP32_ULP
        check_bound(y, x.double(), w, b, rel)


@needs_native
@pytest.mark.parametrize("fmt", ["int8", "int4", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rows_are_independent(fmt: str, dtype: torch.dtype) -> None:
    """Every row of a forward as large as a tree's verification equals that row alone, bit for bit."""
    # 102: not a multiple of the 4- or 16-row tiles
    module = CLASSES[fmt](bf16_linear(102, 256, seed=3), native=True)
    rows = 70
    x = inputs(rows, 256, seed=4).to(dtype)
    x[5] *= 50  # one token with much larger activations
    full = module(x)
    for i in (0, 1, 5, 33, rows - 1):
        assert torch.equal(module(x[i : i + 1]), full[i : i + 1])
    assert torch.equal(module(x[3:8]), full[3:8])


@needs_native
def test_int8_input_width_not_a_multiple_of_16() -> None:
    lin = bf16_linear(37, 40, seed=5)
    module = Int8WeightLinear(lin, native=True)
    x = inputs(3, 40, seed=6).bfloat16()
    check_bound(module(x), x.double(), module.dequantized(), lin.bias.detach(), BF16_HALF_ULP)


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 5, 9])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_bf16_kernel_parity(rows: int, bias: bool) -> None:
    """The model's own weights, fp32 accumulation, one rounding to bf16 (the bias is added before it);
    input width 200 is not a multiple of the 32 products of one instruction, 37 outputs not one of the tiles."""
    lin = bf16_linear(37, 200, seed=rows, bias=bias)
    module = BF16Linear(lin, native=True)
    b = None if lin.bias is None else lin.bias.detach()
    x = inputs(rows, 200, seed=100 + rows).bfloat16()
    check_bound(module(x), x.double(), lin.weight.detach(), b, BF16_HALF_ULP)
    y = module(x.float())  # fp32 in: rounded to bf16 first, fp32 out
    assert y.dtype == torch.float32
    check_bound(y, x.double(), lin.weight.detach(), b, 4 * FP32_ULP)


@needs_native
@pytest.mark.parametrize("fmt", ["bf16", "f32"])
def test_prefill_rows_are_independent(fmt: str) -> None:
    """A prefill's rows (here in several superblocks of output channels) equal the rows alone, bit for bit, and
    the products within the bound; fp32 in the fp32 format."""
    lin = bf16_linear(202, 2048, seed=9)
    w, b = lin.weight.detach(), lin.bias.detach()
    if fmt == "f32":
        lin = lin.float()
        module, x, rel = F32Linear(lin), inputs(130, 2048, seed=10), 4 * FP32_ULP
    else:
        module, x, rel = BF16Linear(lin, native=True), inputs(130, 2048, seed=10).bfloat16(), BF16_HALF_ULP
    with torch.inference_mode():
        full = module(x)
        for i in (0, 1, 47, 48, 96, 129):
            assert torch.equal(module(x[i : i + 1]), full[i : i + 1])
        assert torch.equal(module(x[45:100]), full[45:100])
    check_bound(full, x.double(), w.float() if fmt == "f32" else w, b, rel)


def test_int4_kernel_needs_whole_groups_of_128() -> None:
    assert Int4WeightLinear(bf16_linear(16, 96, seed=1)).native is False  # torch's kernel, groups of 32
    with pytest.raises(ValueError, match="multiple of the int4 group"):
        Int4WeightLinear(bf16_linear(16, 192, seed=1), native=True)


def test_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDECODE_NATIVE_KERNELS", "0")
    native_kernels._avx512_library.cache_clear()
    native_kernels.avx2_library.cache_clear()
    try:
        assert not native_kernels.available()
        assert not Int8WeightLinear(bf16_linear(16, 64, seed=1)).native
        with pytest.raises(ValueError, match="not available"):
            Int4WeightLinear(bf16_linear(16, 128, seed=1), native=True)
    finally:  # no cached None for later tests: they look the libraries up again once the variable is restored
        native_kernels._avx512_library.cache_clear()
        native_kernels.avx2_library.cache_clear()


def test_convert_linears_picks_the_kernels() -> None:
    from specdecode.model.fast_linear import convert_linears
    from specdecode.model.int4_linear import Int4HybridLinear

    model = torch.nn.Sequential(bf16_linear(16, 128, seed=1), bf16_linear(16, 128, seed=2))
    convert_linears(model, "int4-hybrid", native=False)
    assert all(isinstance(m, Int4HybridLinear) and not m.int4.native for m in model)
    model = torch.nn.Sequential(bf16_linear(16, 128, seed=1))
    convert_linears(model, "int8", native=False)
    assert not model[0].native


# ---- RMSNorm and attention for a few rows -------------------------------------------------------


@needs_native
@pytest.mark.parametrize("dim", [1536, 200])
def test_rms_norm_kernel_matches_torch(dim: int) -> None:
    """Inference in bf16 takes the kernel; under autograd the module keeps torch's ops. Same roundings in
    the same order, the sum of squares aside: at most one bf16 step apart, nearly always equal."""
    from specdecode.model.transformer import RMSNorm

    g = torch.Generator().manual_seed(dim)
    norm = RMSNorm(dim, 1e-6).bfloat16()
    norm.weight.data = (torch.rand(dim, generator=g) + 0.5).bfloat16()
    x = (torch.randn(7, dim, generator=g) * 3).bfloat16()
    x[:, 5] *= 50  # an outlier channel, as real activations have
    with torch.inference_mode():
        fast = norm(x)
    with torch.enable_grad():
        ref = norm(x).detach()
    assert fast.dtype == ref.dtype == torch.bfloat16 and fast.shape == ref.shape
    close = (fast.float() - ref.float()).abs() <= 2**-7 * ref.float().abs()
    assert bool(close.all()) and (fast == ref).float().mean() > 0.99
    with torch.inference_mode():  # each row alone gives the same row
        assert torch.equal(norm(x[3:4]), fast[3:4])


@needs_native
def test_rope_and_cache_write_kernel_gives_torchs_bits() -> None:
    """The fused rope + cache write: the queries and the cached keys and values of the torch path, bit for
    bit, at scattered slots of a 2-row batch (a tree's verification writes such slots)."""
    from specdecode.model.config import ModelConfig
    from specdecode.model.kv_cache import KVCache
    from specdecode.model.transformer import apply_rope, rope_tables

    g = torch.Generator().manual_seed(3)
    b, t, h, kvh, hd, max_len = 2, 3, 4, 2, 64, 40
    cfg = ModelConfig(arch="qwen2", vocab_size=10, hidden_size=h * hd, intermediate_size=8, num_layers=1,
                      num_heads=h, num_kv_heads=kvh, head_dim=hd, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=max_len, attention_bias=True, tie_word_embeddings=False)
    cos_t, sin_t = rope_tables(cfg, max_len, "cpu")
    positions = torch.tensor([[7, 8, 8], [20, 21, 22]])
    slots = torch.tensor([[30, 31, 33], [2, 3, 4]])
    cos = cos_t[positions].bfloat16().unsqueeze(1)  # [B, 1, T, hd]
    sin = sin_t[positions].bfloat16().unsqueeze(1)
    qkv = (torch.randn(b, t, (h + 2 * kvh) * hd, generator=g) * 3).bfloat16()
    fast, ref = KVCache(1, b, kvh, max_len, hd, torch.bfloat16), KVCache(1, b, kvh, max_len, hd, torch.bfloat16)
    q = native_kernels.rope_qkv(qkv, cos, sin, slots, 34, *fast.layer(0), heads=h)
    q_ref, k_ref, v_ref = qkv.split([h * hd, kvh * hd, kvh * hd], dim=-1)
    q_ref = apply_rope(q_ref.reshape(b, t, h, hd).transpose(1, 2), cos, sin)
    k_ref = apply_rope(k_ref.reshape(b, t, kvh, hd).transpose(1, 2), cos, sin)
    ref.write(0, slots, k_ref, v_ref.reshape(b, t, kvh, hd).transpose(1, 2))
    assert torch.equal(q, q_ref)
    assert torch.equal(fast.k, ref.k) and torch.equal(fast.v, ref.v)


@needs_native
def test_silu_mul_kernel_matches_torch() -> None:
    """silu(gate) * up in bf16: equal to torch's bits nearly everywhere (its exp may differ in the last fp32
    bit), never more than one bf16 step apart; rows are computed on their own."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(9, 2 * 200, generator=g) * 4).bfloat16()  # 200: not a multiple of 16 lanes
    x[0, :200] = torch.linspace(-100, 100, 200).bfloat16()  # saturating tails of the sigmoid
    fast = native_kernels.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert fast.shape == ref.shape and fast.dtype == torch.bfloat16
    assert bool(((fast.float() - ref.float()).abs() <= 2**-7 * ref.float().abs()).all())
    assert (fast == ref).float().mean() > 0.999
    assert torch.equal(native_kernels.silu_mul(x[4:5]), fast[4:5])


def _attention_inputs(t: int, s: int, tree: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(10 * t + s)
    h, kvh, hd, max_len = 12, 2, 128, 64
    kc = torch.randn(1, kvh, max_len, hd, generator=g).bfloat16()  # a cache: views of its first s slots
    vc = torch.randn(1, kvh, max_len, hd, generator=g).bfloat16()
    q = (torch.randn(1, h, t, hd, generator=g) * 2).bfloat16()
    mask = torch.arange(s).view(1, s) <= torch.arange(s - t, s).view(t, 1)  # causal over the last t slots
    if tree:  # node i sees the prefix and its ancestors: here its parent chain skips every other node
        mask[:, s - t :] &= (torch.arange(t).view(1, t) % 2 == torch.arange(t).view(t, 1) % 2)
    return q, kc, vc, mask.view(1, 1, t, s)


ATTENTION_CLASSES = ["best", "avx2"]
"""The attention kernel of this CPU's class (AVX512) and, forced with SPECDECODE_ISA, the AVX2 one."""


def _attention_class(monkeypatch: pytest.MonkeyPatch, cls: str) -> None:
    if cls != "best":
        monkeypatch.setenv("SPECDECODE_ISA", cls)
    if native_kernels.glue_library() is None:
        pytest.skip(f"no attention kernel of class {cls} here")


@pytest.mark.parametrize("cls", ATTENTION_CLASSES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,tree", [(1, False), (5, False), (6, True)])
def test_attention_kernel_matches_torch(monkeypatch: pytest.MonkeyPatch, cls: str, dtype: torch.dtype, t: int,
                                        tree: bool) -> None:
    from specdecode.model.transformer import small_attention

    _attention_class(monkeypatch, cls)
    s = 45
    q, kc, vc, mask = (x.to(dtype) for x in _attention_inputs(t, s, tree))
    mask = mask.bool()
    keys, values = kc[:, :, :s], vc[:, :, :s]
    m = None if t == 1 else mask
    with torch.inference_mode():
        fast = native_kernels.attend(q, keys, values, m, 128**-0.5)  # [1, t, H * hd]
    ref = small_attention(q, keys, values, m).transpose(1, 2).reshape(1, t, -1)
    assert fast.shape == ref.shape and fast.dtype == dtype
    # fp32 inside, one bf16 rounding at the end: a step of bf16 at most (sums in another order).
    assert bool(((fast.float() - ref.float()).abs() <= 2**-7 * ref.float().abs() + 1e-5).all())


@pytest.mark.parametrize("cls", ATTENTION_CLASSES)
def test_attention_rows_equal_single_queries(monkeypatch: pytest.MonkeyPatch, cls: str) -> None:
    """A verification row equals the single query at its own cache length, bit for bit: masked slots
    add exact zeros, so the longer cache of a verification forward changes nothing."""
    _attention_class(monkeypatch, cls)
    s, t = 45, 5
    q, kc, vc, mask = _attention_inputs(t, s, tree=False)
    with torch.inference_mode():
        rows = native_kernels.attend(q, kc[:, :, :s], vc[:, :, :s], mask, 128**-0.5)
        for i in range(t):
            n = s - t + i + 1
            single = native_kernels.attend(q[:, :, i : i + 1], kc[:, :, :n], vc[:, :, :n], None, 128**-0.5)
            assert torch.equal(single[0, 0], rows[0, i])


@needs_native
@pytest.mark.parametrize("k", [6, 24])  # 24: a tree of more than 16 nodes
def test_bf16_verification_rows_equal_single_token_forwards(tiny_qwen_dir, monkeypatch, k: int) -> None:  # noqa: ANN001
    """With the native linears, norms and attention, a bf16 target's verification forward of k tokens
    gives, bit for bit, the hidden states of k single-token forwards: greedy speculative decoding of a
    bf16 target then reproduces plain decoding exactly, not only up to rounding.

    On a model this small torch's own ops happen to agree as well (on the real 1.5B target they differed
    by up to one bf16 step, ours did not), so the kernel tests above pin the property; this one checks
    that a bf16 forward really routes through the native kernels (the layers in one call, `native_stack`) and
    that together they keep it."""
    from specdecode.model import native_stack
    from specdecode.model.fast_linear import convert_linears
    from specdecode.model.load import load_model

    calls = {"rms_norm": 0, "run": 0}
    for module, name in ((native_kernels, "rms_norm"), (native_stack, "run")):
        def spy(*args, _name=name, _real=getattr(module, name)):  # noqa: ANN002, ANN202
            calls[_name] += 1
            return _real(*args)
        monkeypatch.setattr(module, name, spy)
    model = load_model(tiny_qwen_dir, "bf16", "cpu").model
    convert_linears(model, "bf16")
    assert all(m.native for m in model.modules() if isinstance(m, BF16Linear))
    ids = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(k))
    ctx = 10
    with torch.inference_mode():
        hidden = []
        for step in (k, 1):  # one forward of k rows, then k forwards of one row
            cache = model.new_cache(1, 48)
            model(ids[:, :ctx], torch.arange(ctx)[None], cache)
            cache.set_length(0, ctx)
            rows = []
            for start in range(ctx, ctx + k, step):
                pos = torch.arange(start, start + step)[None]
                rows.append(model(ids[:, start : start + step], pos, cache)[0])
                cache.set_length(0, start + step)
            hidden.append(torch.cat(rows))
    assert calls["rms_norm"] > 0 and calls["run"] == 2 + 1 + k  # two prefills of 10 rows, k rows, k single rows
    assert torch.equal(hidden[0], hidden[1])


@pytest.mark.parametrize("cls", ATTENTION_CLASSES)
def test_attention_of_a_tree_node_equals_its_path_laid_out_in_a_row(monkeypatch: pytest.MonkeyPatch,
                                                                     cls: str) -> None:
    """A tree node sees its ancestors at scattered slots; after acceptance, plain decoding would see the
    same keys at consecutive slots. The kernel attends over the seen slots only, in slot order, so both
    give the same bits (the verified path then matches plain decoding exactly)."""
    _attention_class(monkeypatch, cls)
    s, t = 45, 6
    q, kc, vc, mask = _attention_inputs(t, s, tree=True)  # node i sees nodes j <= i with j = i (mod 2)
    with torch.inference_mode():
        rows = native_kernels.attend(q, kc[:, :, :s], vc[:, :, :s], mask, 128**-0.5)
        for i in range(t):
            seen = mask[0, 0, i].nonzero().flatten()
            k_row, v_row = kc[:, :, seen].contiguous(), vc[:, :, seen].contiguous()  # the path, consecutive
            single = native_kernels.attend(q[:, :, i : i + 1], k_row, v_row, None, 128**-0.5)
            assert torch.equal(single[0, 0], rows[0, i])

