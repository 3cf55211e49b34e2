"""Our model is the paper's: equal to PyTorch's reference modules given the same weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_mt.config import ModelConfig
from transformer_mt.model import (
    MultiHeadAttention,
    ScaleNorm,
    Transformer,
    causal_mask,
    padding_mask,
)
from transformer_mt.vocab import BOS, PAD

D, H, FF, V = 32, 4, 64, 50


def small_cfg(**kw) -> ModelConfig:
    base = dict(
        d_model=D,
        heads=H,
        encoder_layers=2,
        decoder_layers=2,
        d_ff=FF,
        dropout=0.0,
        max_positions=64,
    )
    return ModelConfig(**{**base, **kw})


def random_ids(B, T, lens, generator):
    """(B, T) ids in [4, V) with PAD after each row's length."""
    ids = torch.randint(4, V, (B, T), generator=generator)
    for b, n in enumerate(lens):
        ids[b, n:] = PAD
    return ids


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


# --------------------------------------------------------------------------- attention


def copy_into_reference(ours: MultiHeadAttention, ref: nn.MultiheadAttention) -> None:
    with torch.no_grad():
        if ours.cross:
            ref.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.kv_proj.weight]))
            ref.in_proj_bias.copy_(torch.cat([ours.q_proj.bias, ours.kv_proj.bias]))
        else:
            ref.in_proj_weight.copy_(ours.qkv_proj.weight)
            ref.in_proj_bias.copy_(ours.qkv_proj.bias)
        ref.out_proj.weight.copy_(ours.out_proj.weight)
        ref.out_proj.bias.copy_(ours.out_proj.bias)


@pytest.mark.parametrize("use_padding", [False, True])
@pytest.mark.parametrize("use_causal", [False, True])
def test_self_attention_matches_nn_multihead_attention(gen, use_padding, use_causal):
    torch.manual_seed(0)
    ours = MultiHeadAttention(D, H).eval()
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    copy_into_reference(ours, ref)
    B, T = 3, 7
    x = torch.randn(B, T, D, generator=gen)
    ids = random_ids(B, T, [7, 5, 3] if use_padding else [7, 7, 7], gen)
    mask = padding_mask(ids)  # (B, 1, 1, T), True = attend
    if use_causal:
        mask = mask & causal_mask(T)
    ref_out, _ = ref(
        x,
        x,
        x,
        key_padding_mask=(ids == PAD) if use_padding else None,
        attn_mask=~causal_mask(T) if use_causal else None,
        need_weights=False,
    )
    out, _ = ours(x, mask=mask)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_cross_attention_matches_nn_multihead_attention(gen):
    torch.manual_seed(0)
    ours = MultiHeadAttention(D, H, cross=True).eval()
    ref = nn.MultiheadAttention(D, H, batch_first=True).eval()
    copy_into_reference(ours, ref)
    x, memory = torch.randn(2, 4, D, generator=gen), torch.randn(2, 6, D, generator=gen)
    src = random_ids(2, 6, [6, 2], gen)
    ref_out, _ = ref(x, memory, memory, key_padding_mask=src == PAD, need_weights=False)
    out, _ = ours(x, mask=padding_mask(src), memory=memory)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- whole stacks


def reference_transformer(model: Transformer, norm: str) -> nn.Transformer:
    """nn.Transformer with our weights; the paper's post-norm stack has no final LayerNorm."""
    cfg = model.cfg
    ref = nn.Transformer(
        cfg.d_model,
        cfg.heads,
        cfg.encoder_layers,
        cfg.decoder_layers,
        cfg.d_ff,
        dropout=0.0,
        activation=cfg.activation,
        batch_first=True,
        norm_first=norm == "pre",
    ).eval()
    with torch.no_grad():
        for o, r in zip(model.encoder.layers, ref.encoder.layers):
            copy_into_reference(o.self_attn, r.self_attn)
            for a, b in (
                (o.ff.w1, r.linear1),
                (o.ff.w2, r.linear2),
                (o.norm1, r.norm1),
                (o.norm2, r.norm2),
            ):
                b.load_state_dict(a.state_dict())
        for o, r in zip(model.decoder.layers, ref.decoder.layers):
            copy_into_reference(o.self_attn, r.self_attn)
            copy_into_reference(o.cross_attn, r.multihead_attn)
            for a, b in (
                (o.ff.w1, r.linear1),
                (o.ff.w2, r.linear2),
                (o.norm1, r.norm1),
                (o.norm2, r.norm2),
                (o.norm3, r.norm3),
            ):
                b.load_state_dict(a.state_dict())
        if norm == "pre":
            ref.encoder.norm.load_state_dict(model.encoder.norm.state_dict())
            ref.decoder.norm.load_state_dict(model.decoder.norm.state_dict())
        else:
            ref.encoder.norm, ref.decoder.norm = nn.Identity(), nn.Identity()
    return ref


@pytest.mark.parametrize("norm, activation", [("post", "relu"), ("pre", "relu"), ("post", "gelu")])
def test_encoder_decoder_matches_nn_transformer(gen, norm, activation):
    torch.manual_seed(0)
    model = Transformer(small_cfg(norm=norm, activation=activation), V, V, joint_vocab=True).eval()
    # Perturb the LayerNorm parameters so that copying them is actually tested.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    ref = reference_transformer(model, norm)
    B, S, T = 3, 9, 6
    src_ids = random_ids(B, S, [9, 6, 2], gen)
    x, y = torch.randn(B, S, D, generator=gen), torch.randn(B, T, D, generator=gen)
    # Grad mode on keeps nn.Transformer off its fused fast path, which zeroes padded rows.
    memory = model.encoder(x, padding_mask(src_ids))
    ref_memory = ref.encoder(x, src_key_padding_mask=src_ids == PAD)
    real = src_ids != PAD
    torch.testing.assert_close(memory[real], ref_memory[real], atol=1e-5, rtol=1e-5)
    out = model.decoder(y, memory, padding_mask(src_ids))
    ref_out = ref.decoder(
        y, memory, tgt_mask=~causal_mask(T), memory_key_padding_mask=src_ids == PAD
    )
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)


def test_bf16_output_layer_keeps_the_rest_fp32_and_agrees_with_fp32(gen):
    """output_dtype (precision bf16-output): only the (B, T, V) projection runs in bf16; logits and
    gradients agree with fp32 within bf16's 8-bit mantissa, and the weights' gradients stay fp32."""
    torch.manual_seed(0)
    model = Transformer(small_cfg(), V, V, joint_vocab=True)
    src, tgt = random_ids(3, 7, [7, 5, 2], gen), random_ids(3, 6, [6, 6, 3], gen)
    ref = model(src, tgt)
    ref.float().square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    model.output_dtype = torch.bfloat16
    out = model(src, tgt)
    assert (
        out.dtype == torch.bfloat16 and model.decode(tgt, *model.encode(src)).dtype == torch.float32
    )
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.02)
    out.float().square().mean().backward()
    for n, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, ref_grads[n], atol=2e-3, rtol=0.05, msg=n)


def test_swiglu_is_the_gated_product_of_shazeer_2020(gen):
    """FFN_SwiGLU(x) = (Swish(xW) * xV) W2, each product with its bias, written out here from the
    paper's formula; W and V are the two halves of our one input projection."""
    ff = Transformer(small_cfg(activation="swiglu"), V, V, joint_vocab=True).encoder.layers[0].ff
    x = torch.randn(3, 5, D, generator=gen)
    (W, V_), (b, c) = ff.w1.weight.split(FF), ff.w1.bias.split(FF)
    xw, xv = x @ W.T + b, x @ V_.T + c  # (3, 5, FF) each
    want = (xw * torch.sigmoid(xw) * xv) @ ff.w2.weight.T + ff.w2.bias
    torch.testing.assert_close(ff(x), want, atol=1e-5, rtol=1e-5)
    # d_ff is the gate's width: each layer has one more (d_model + 1) x d_ff product than relu's
    cfg = small_cfg()
    relu = Transformer(cfg, V, V, joint_vocab=True).num_parameters()
    swiglu = Transformer(small_cfg(activation="swiglu"), V, V, joint_vocab=True).num_parameters()
    assert swiglu - relu == (cfg.encoder_layers + cfg.decoder_layers) * (D + 1) * FF


def test_parameter_count_matches_formula():
    """3+3 layers, d 256, FFN 1024, pre-norm, joint tied vocab of 8001: the peers' kit counts
    7,578,880."""
    cfg = ModelConfig(
        d_model=256, heads=4, encoder_layers=3, decoder_layers=3, d_ff=1024, norm="pre"
    )
    assert Transformer(cfg, 8001, 8001, joint_vocab=True).num_parameters() == 7_578_880


def test_scale_norm_is_g_times_the_unit_vector(gen):
    """ScaleNorm (Nguyen & Salazar, 2019): every position becomes g * x / ||x||, so its length is
    g, starting at sqrt(d); the one scalar g is learned."""
    norm = ScaleNorm(D)
    x = torch.randn(3, 5, D, generator=gen) * 7.0
    torch.testing.assert_close(norm(x), D**0.5 * F.normalize(x, dim=-1))
    with torch.no_grad():
        norm.g.fill_(2.5)
    torch.testing.assert_close(norm(x).norm(dim=-1), torch.full((3, 5), 2.5))
    norm(x).sum().backward()
    assert [n for n, _ in norm.named_parameters()] == ["g"] and norm.g.grad is not None


def test_scale_norm_replaces_every_layer_norm():
    """model.norm_type: scale puts ScaleNorm wherever LayerNorm was, the pre-norm stacks' final
    norms included: 12 of them in 2+2 layers, one parameter each."""
    model = Transformer(small_cfg(norm="pre", norm_type="scale"), V, V, joint_vocab=True)
    kinds = [type(m) for m in model.modules() if isinstance(m, (nn.LayerNorm, ScaleNorm))]
    assert kinds == [ScaleNorm] * (2 * 2 + 2 * 3 + 2)
    layer = Transformer(small_cfg(norm="pre"), V, V, joint_vocab=True)
    # each LayerNorm holds 2 * D parameters, each ScaleNorm 1
    assert layer.num_parameters() - model.num_parameters() == 12 * (2 * D - 1)


def test_tied_embeddings_share_one_matrix():
    model = Transformer(small_cfg(), V, V, joint_vocab=True)
    assert model.src_embed.lut.weight is model.tgt_embed.lut.weight is model.generator.weight
    separate = Transformer(small_cfg(), V, V + 7, joint_vocab=False)
    assert separate.src_embed.lut.weight is not separate.tgt_embed.lut.weight
    assert separate.tgt_embed.lut.weight is separate.generator.weight
    untied = Transformer(small_cfg(tie_embeddings=False), V, V, joint_vocab=True)
    assert untied.generator.weight is not untied.tgt_embed.lut.weight


def test_embeddings_are_scaled_and_positions_sinusoidal():
    model = Transformer(small_cfg(), V, V, joint_vocab=True)
    ids = torch.tensor([[5, 6]])
    torch.testing.assert_close(model.src_embed(ids), model.src_embed.lut(ids) * D**0.5)
    pe = model.pos.pe
    # PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(pos / 10000^(2i/d))
    for pos, i in ((0, 0), (3, 0), (7, 5), (20, 15)):
        angle = torch.tensor(pos / 10000 ** (2 * i / D))
        torch.testing.assert_close(pe[pos, 2 * i], torch.sin(angle))
        torch.testing.assert_close(pe[pos, 2 * i + 1], torch.cos(angle))


# --------------------------------------------------------------------------- decoding and padding


@pytest.mark.parametrize("norm, norm_type", [("post", "layer"), ("pre", "layer"), ("pre", "scale")])
def test_kv_cache_matches_full_forward_at_every_step(gen, norm, norm_type):
    torch.manual_seed(0)
    model = Transformer(small_cfg(norm=norm, norm_type=norm_type), V, V, joint_vocab=True).eval()
    src = random_ids(3, 8, [8, 5, 2], gen)
    tgt_in = torch.cat([torch.full((3, 1), BOS), random_ids(3, 6, [6, 6, 6], gen)], dim=1)  # (3, 7)
    with torch.no_grad():
        full = model(src, tgt_in)  # (3, 7, V) logits
        memory, src_mask = model.encode(src)
        cache = model.new_cache()
        for t in range(tgt_in.size(1)):
            step = model.decode_step(tgt_in[:, t : t + 1], memory, src_mask, cache)  # (3, V)
            torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)
        assert cache.length == tgt_in.size(1)


def test_kv_cache_reorder_follows_rows(gen):
    torch.manual_seed(0)
    model = Transformer(small_cfg(), V, V, joint_vocab=True).eval()
    src = random_ids(3, 5, [5, 4, 3], gen)
    tgt_in = torch.cat([torch.full((3, 1), BOS), random_ids(3, 3, [3, 3, 3], gen)], dim=1)
    index = torch.tensor([2, 0, 0])  # reorder and duplicate, as beam search does
    with torch.no_grad():
        full = model(src[index], tgt_in[index])
        memory, src_mask = model.encode(src)
        cache = model.new_cache()
        model.decode_step(tgt_in[:, :1], memory, src_mask, cache)
        cache.reorder(index)
        memory, src_mask = memory[index], src_mask[index]
        for t in range(1, tgt_in.size(1)):
            step = model.decode_step(tgt_in[index, t : t + 1], memory, src_mask, cache)
            torch.testing.assert_close(step, full[:, t], atol=1e-5, rtol=1e-5)


def test_padding_does_not_change_outputs(gen):
    torch.manual_seed(0)
    model = Transformer(small_cfg(), V, V, joint_vocab=True).eval()
    src = random_ids(2, 9, [9, 4], gen)
    # row 1: 4 real
    tgt_in = torch.cat([torch.full((2, 1), BOS), random_ids(2, 7, [7, 3], gen)], dim=1)
    with torch.no_grad():
        batched = model(src, tgt_in)
        alone = model(src[1:, :4], tgt_in[1:, :4])
        torch.testing.assert_close(batched[1, :4], alone[0], atol=1e-5, rtol=1e-5)
        # Other ids under the target padding: causality keeps the real positions unchanged.
        noisy = tgt_in.clone()
        noisy[1, 4:] = torch.randint(4, V, (4,), generator=gen)
        torch.testing.assert_close(model(src, noisy)[1, :4], batched[1, :4], atol=1e-6, rtol=1e-6)
        # Other vectors under the source padding (mask unchanged): real encoder outputs unchanged.
        x = torch.randn(2, 9, D, generator=gen)
        mask = padding_mask(src)
        x2 = x.clone()
        x2[1, 4:] = torch.randn(5, D, generator=gen) * 10
        real = src != PAD
        torch.testing.assert_close(
            model.encoder(x2, mask)[real], model.encoder(x, mask)[real], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize("p", [0.1, 0.3])
def test_dropout_drops_at_its_rate_and_keeps_the_mean(p):
    from transformer_mt.model import Dropout

    drop = Dropout(p).train()
    x = torch.ones(400, 500)
    torch.manual_seed(0)
    y = drop(x)
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - p) < 0.01
    assert abs(y.mean().item() - 1.0) < 0.01  # inverted dropout keeps the expectation
    values = torch.unique(y).tolist()
    assert len(values) == 2 and values[0] == 0.0 and values[1] == pytest.approx(1 / (1 - p))
    torch.manual_seed(0)
    assert torch.equal(drop(x), y)  # reproducible from torch's seed
    assert torch.equal(drop.eval()(x), x)


@pytest.mark.parametrize("p", [0.001, 0.1, 0.3])
def test_dropout_rate_is_exact_not_rounded_to_256ths(p):
    """Defect 6: the byte-mask dropout rounded p to k/256 (0.1 -> 0.1016) and dropped nothing below
    1/512. Enough elements that the measured rate has a relative standard error of 0.2%: a 1% error
    in the rate lands 2.5 standard errors outside the 0.5% tolerance."""
    from transformer_mt.model import Dropout

    n = int((1 - p) / (p * 0.002**2))  # relative standard error sqrt((1 - p) / (p n)) = 0.2%
    drop, chunk = Dropout(p).train(), 1 << 24
    torch.manual_seed(0)
    dropped = 0
    for start in range(0, n, chunk):
        dropped += int((drop(torch.ones(min(chunk, n - start))) == 0).sum())
    assert dropped / n == pytest.approx(p, rel=0.005)


@pytest.mark.parametrize("activation", ["relu", "swiglu"])
def test_train_flops_matches_pytorch_flop_counter(gen, activation):
    """Without padding, our analytic count equals torch's FlopCounterMode on the forward pass (x3
    for training) for every matrix multiply; the counter does not see the CPU attention kernel, so
    the attention terms are added here by hand: QK^T and AV cost 2*2*d per query-key pair."""
    from torch.utils.flop_counter import FlopCounterMode

    cfg = small_cfg(encoder_layers=2, decoder_layers=3, activation=activation)
    model = Transformer(cfg, V, V, joint_vocab=True).eval()
    B, S, T = 4, 9, 7
    src, tgt = random_ids(B, S, [S] * B, gen), random_ids(B, T, [T] * B, gen)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(src, tgt)
    pairs = cfg.encoder_layers * B * S * S + cfg.decoder_layers * B * (T * (T + 1) // 2 + T * S)
    assert model.train_flops(src, tgt) / 3 == pytest.approx(
        counter.get_total_flops() + 4 * D * pairs, rel=1e-9
    )
