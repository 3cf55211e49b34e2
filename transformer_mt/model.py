"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), written out.

Batch-first tensors throughout. Masks are boolean with True = may attend, broadcastable to
(B, H, T, S). Incremental decoding keeps a `KVCache` that the caller passes in.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .vocab import PAD

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: (B, H, S, d_k) each


# --------------------------------------------------------------------------- masks


def padding_mask(ids: torch.Tensor) -> torch.Tensor:
    """(B, S) ids -> (B, 1, 1, S): True where a key is a real token, not padding."""
    return (ids != PAD)[:, None, None, :]


def causal_mask(T: int, device: torch.device | None = None) -> torch.Tensor:
    """(T, T): position t may attend to positions <= t (Sec. 3.2.3, "masking out ... illegal
    connections")."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()


# --------------------------------------------------------------------------- building blocks


class Dropout(nn.Module):
    """Inverted dropout at exactly rate p. On CPU the mask comes from four random bytes per 32-bit
    draw: torch's CPU generator makes one draw per element in F.dropout, which costs more than the
    rest of dropout.

    With p * 256 = k + f (k whole, 0 <= f < 1), a byte below k drops its element and a byte above k
    keeps it; the one byte value in 256 equal to k drops it with probability f, from a draw made for
    those few elements only. P(drop) = k/256 + f/256 = p.
    """

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        whole, self.tie_drop = divmod(p * 256, 1.0)
        self.threshold = int(whole)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if x.device.type != "cpu":
            return F.dropout(x, self.p, training=True)
        n = x.numel()
        words = torch.randint(
            -(2**31), 2**31 - 1, ((n + 3) // 4,), dtype=torch.int32, device=x.device
        )
        byte = words.view(torch.uint8)[:n]  # (n,) uniform in 0..255
        keep = byte > self.threshold
        if self.tie_drop > 0:
            ties = (byte == self.threshold).nonzero().squeeze(1)  # about n/256 elements
            keep[ties] = torch.rand(len(ties), device=x.device) >= self.tie_drop
        return x * keep.view(x.shape) * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}"


class ScaleNorm(nn.Module):
    """g * x / ||x|| over the last dimension, with one learned scalar g initialised to sqrt(d)
    (Nguyen & Salazar, 2019): LayerNorm without the mean, the per-feature gains or the bias.
    Computed as (g / sqrt(d)) * RMSNorm(x), since RMSNorm(x) = sqrt(d) * x / ||x|| (eps aside)."""

    def __init__(self, d_model: int, eps: float = 1e-5):
        super().__init__()
        self.d_model, self.eps = d_model, eps
        self.g = nn.Parameter(torch.tensor(math.sqrt(d_model)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., d) -> (..., d)
        scale = (self.g / math.sqrt(self.d_model)).to(x.dtype)
        return F.rms_norm(x, (self.d_model,), eps=self.eps) * scale

    def extra_repr(self) -> str:
        return f"{self.d_model}, eps={self.eps}"


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The normalisation `model.norm_type` names: LayerNorm or ScaleNorm."""
    return ScaleNorm(cfg.d_model) if cfg.norm_type == "scale" else nn.LayerNorm(cfg.d_model)


class Embeddings(nn.Module):
    """Token embeddings multiplied by sqrt(d_model) (Sec. 3.4)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.lut = nn.Embedding(vocab_size, d_model, padding_idx=PAD)
        self.scale = math.sqrt(d_model)
        nn.init.normal_(self.lut.weight, mean=0.0, std=d_model**-0.5)
        with torch.no_grad():
            self.lut.weight[PAD].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lut(ids) * self.scale  # (B, T, d)


class PositionalEncoding(nn.Module):
    """Sinusoidal positions (Sec. 3.5): PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) =
    cos(...)."""

    def __init__(self, d_model: int, max_positions: int):
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float32)[:, None]  # (P, 1)
        freq = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model)
        )
        pe = torch.zeros(max_positions, d_model)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq)
        self.register_buffer("pe", pe, persistent=False)  # derived, so not in checkpoints

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        T = x.size(1)
        if start + T > self.pe.size(0):
            raise ValueError(
                f"sequence of {start + T} positions exceeds model.max_positions={self.pe.size(0)}"
            )
        return x + self.pe[start : start + T].to(x.dtype)  # (B, T, d)


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (Sec. 3.2.2) through F.scaled_dot_product_attention.

    Self-attention projects Q, K, V with one fused matrix; cross-attention projects Q from the
    decoder and K, V (fused) from the encoder output, which decoding computes once per source.
    """

    def __init__(self, d_model: int, heads: int, dropout: float = 0.0, cross: bool = False):
        super().__init__()
        self.heads, self.d_k, self.dropout, self.cross = heads, d_model // heads, dropout, cross
        if cross:
            self.q_proj = nn.Linear(d_model, d_model)
            self.kv_proj = nn.Linear(d_model, 2 * d_model)
        else:
            self.qkv_proj = nn.Linear(d_model, 3 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(B, T, n*d) -> n tensors of (B, H, T, d_k)."""
        B, T, _ = x.shape
        x = x.view(B, T, -1, self.heads, self.d_k).permute(2, 0, 3, 1, 4)  # (n, B, H, T, d_k)
        return x.unbind(0)

    def memory_kv(self, memory: torch.Tensor) -> KV:
        """Cross-attention keys and values of the encoder output (B, S, d)."""
        k, v = self._heads(self.kv_proj(memory))
        return k, v

    def probabilities(self, x: torch.Tensor, kv: KV, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The attention weights softmax(QK^T / sqrt(d_k)) (Eq. 1) from x (B, T, d) over keys kv:
        (B, H, T, S). Written out (scaled_dot_product_attention does not return them): for
        alignments and plots only."""
        # (B, H, T, d_k)
        q = self._heads(self.q_proj(x) if self.cross else self.qkv_proj(x)[..., : x.size(-1)])[0]
        scores = q @ kv[0].transpose(-2, -1) / math.sqrt(self.d_k)  # (B, H, T, S)
        if mask is not None:
            scores = scores.masked_fill(~mask, -math.inf)
        return scores.float().softmax(-1)

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: Optional[torch.Tensor] = None,
        causal: bool = False,
        memory: Optional[torch.Tensor] = None,
        kv: Optional[KV] = None,
    ) -> tuple[torch.Tensor, KV]:
        """Attend from x (B, T, d). Returns the output (B, T, d) and the keys/values used, for
        caching.

        Self-attention: `kv`, if given, holds the cached keys/values of earlier positions.
        Cross-attention: `kv`, if given, replaces projecting `memory` again.
        """
        B, T, _ = x.shape
        if self.cross:
            (q,) = self._heads(self.q_proj(x))
            k, v = kv if kv is not None else self.memory_kv(memory)
        else:
            q, k, v = self._heads(self.qkv_proj(x))
            if kv is not None:
                k = torch.cat([kv[0], k], dim=2)  # (B, H, S_past + T, d_k)
                v = torch.cat([kv[1], v], dim=2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            dropout_p=self.dropout if self.training else 0.0,
        )
        out = out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*d_k)
        return self.out_proj(out), (k, v)


class FeedForward(nn.Module):
    """Position-wise feed-forward network FFN(x) = max(0, xW1 + b1)W2 + b2 (Sec. 3.3, Eq. 2); with
    `activation` gelu, GELU for the max; with swiglu, (Swish(xW1) * xV)W2 (Shazeer, 2020), whose W1
    and V are one (d_model, 2 d_ff) product."""

    def __init__(self, d_model: int, d_ff: int, dropout: float = 0.0, activation: str = "relu"):
        super().__init__()
        self.activation = activation
        gated = 2 if activation == "swiglu" else 1
        self.w1 = nn.Linear(d_model, gated * d_ff)
        self.w2 = nn.Linear(d_ff, d_model)
        self.dropout = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)  # (B, T, d_ff), or (B, T, 2 d_ff) for swiglu
        if self.activation == "swiglu":
            a, v = h.chunk(2, dim=-1)
            h = F.silu(a) * v  # (B, T, d_ff)
        elif self.activation == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        return self.w2(self.dropout(h))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each in a residual block with a norm (Sec. 3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.ff = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.norm1, self.norm2 = make_norm(cfg), make_norm(cfg)
        self.dropout = Dropout(cfg.dropout)
        self.pre_norm = cfg.norm == "pre"

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self.dropout(self.self_attn(self.norm1(x), mask=mask)[0])
            x = x + self.dropout(self.ff(self.norm2(x)))
        else:  # the paper: LayerNorm(x + Sublayer(x))
            x = self.norm1(x + self.dropout(self.self_attn(x, mask=mask)[0]))
            x = self.norm2(x + self.dropout(self.ff(x)))
        return x


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over the encoder output, feed-forward (Sec. 3.1)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.attention_dropout)
        self.cross_attn = MultiHeadAttention(
            cfg.d_model, cfg.heads, cfg.attention_dropout, cross=True
        )
        self.ff = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.norm1, self.norm2, self.norm3 = (make_norm(cfg) for _ in range(3))
        self.dropout = Dropout(cfg.dropout)
        self.pre_norm = cfg.norm == "pre"

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        self_kv: Optional[KV] = None,
        cross_kv: Optional[KV] = None,
        attention: Optional[list[torch.Tensor]] = None,
    ) -> tuple[torch.Tensor, KV, KV]:
        """x (B, T, d). With cached `self_kv`, x holds only the new position(s) and needs no causal
        mask (the cache has only the past; is_causal would align the triangle top-left).
        `attention`, when given, receives this layer's cross-attention weights (B, H, T, S)."""
        causal = self_kv is None and x.size(1) > 1
        if self.pre_norm:
            h, self_kv = self.self_attn(self.norm1(x), causal=causal, kv=self_kv)
            x = x + self.dropout(h)
            q_in = self.norm2(x)
            h, cross_kv = self.cross_attn(q_in, mask=src_mask, memory=memory, kv=cross_kv)
            x = x + self.dropout(h)
            x = x + self.dropout(self.ff(self.norm3(x)))
        else:
            h, self_kv = self.self_attn(x, causal=causal, kv=self_kv)
            x = q_in = self.norm1(x + self.dropout(h))
            h, cross_kv = self.cross_attn(x, mask=src_mask, memory=memory, kv=cross_kv)
            x = self.norm2(x + self.dropout(h))
            x = self.norm3(x + self.dropout(self.ff(x)))
        if attention is not None:
            attention.append(self.cross_attn.probabilities(q_in, cross_kv, src_mask))
        return x, self_kv, cross_kv


class KVCache:
    """Decoder state for incremental decoding, passed in and returned by `Transformer.decode`.

    Per layer: self-attention keys/values of the positions decoded so far, and the cross-attention
    keys/values of the source (computed on the first step only). `reorder` follows beam search.
    """

    def __init__(self, n_layers: int):
        self.self_kv: list[Optional[KV]] = [None] * n_layers
        self.cross_kv: list[Optional[KV]] = [None] * n_layers
        self.length = 0  # positions decoded so far

    def reorder(self, index: torch.Tensor) -> None:
        """Keep/duplicate batch rows: row i of the new cache is row index[i] of the old one."""
        self.reorder_self(index)
        self.reorder_cross(index)

    def reorder_self(self, index: torch.Tensor) -> None:
        """Reorder the self-attention keys/values only. Beam search moves hypotheses between the
        rows of one sentence, which share the source's cross-attention keys/values: those stay."""
        self._select(self.self_kv, index)

    def reorder_cross(self, index: torch.Tensor) -> None:
        """Reorder the cross-attention keys/values only (when sentences leave the batch)."""
        self._select(self.cross_kv, index)

    @staticmethod
    def _select(kvs: list[Optional[KV]], index: torch.Tensor) -> None:
        for i, kv in enumerate(kvs):
            if kv is not None:
                kvs[i] = (kv[0].index_select(0, index), kv[1].index_select(0, index))


# --------------------------------------------------------------------------- stacks and model


class Encoder(nn.Module):
    """N encoder layers; pre-norm stacks end with a final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.norm = make_norm(cfg) if cfg.norm == "pre" else nn.Identity()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class Decoder(nn.Module):
    """N decoder layers; pre-norm stacks end with a final norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.norm = make_norm(cfg) if cfg.norm == "pre" else nn.Identity()

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: Optional[KVCache] = None,
        attention: Optional[list[torch.Tensor]] = None,
    ) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            if cache is None:
                x = layer(x, memory, src_mask, attention=attention)[0]
            else:
                first = cache.cross_kv[i] is None
                x, cache.self_kv[i], (k, v) = layer(
                    x, memory, src_mask, cache.self_kv[i], cache.cross_kv[i]
                )
                # the source's keys/values are read at every later step: store them contiguous, once
                cache.cross_kv[i] = (k.contiguous(), v.contiguous()) if first else (k, v)
        return self.norm(x)


class Transformer(nn.Module):
    """Encoder-decoder with embeddings, positions and the output projection (Figure 1)."""

    def __init__(
        self, cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int, joint_vocab: bool
    ):
        super().__init__()
        self.cfg = cfg
        self.src_embed = Embeddings(src_vocab_size, cfg.d_model)
        share_src_tgt = cfg.tie_embeddings and joint_vocab
        self.tgt_embed = (
            self.src_embed if share_src_tgt else Embeddings(tgt_vocab_size, cfg.d_model)
        )
        self.pos = PositionalEncoding(cfg.d_model, cfg.max_positions)
        self.dropout = Dropout(cfg.dropout)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.generator = nn.Linear(cfg.d_model, tgt_vocab_size, bias=False)
        for name, p in self.named_parameters():
            if p.dim() > 1 and "embed" not in name:
                nn.init.xavier_uniform_(p)
        if cfg.tie_embeddings:  # Sec. 3.4: the output projection shares the target embedding matrix
            self.generator.weight = self.tgt_embed.lut.weight
        # Training may run the output projection alone in a lower precision (train.precision
        # bf16-output): set by the trainer, not saved; decoding (decode_step) always projects in the
        # model's own dtype.
        self.output_dtype: Optional[torch.dtype] = None

    def encode(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src (B, S) ids -> memory (B, S, d) and its padding mask (B, 1, 1, S)."""
        src_mask = padding_mask(src)
        x = self.dropout(self.pos(self.src_embed(src)))
        return self.encoder(x, src_mask), src_mask

    def decode(
        self,
        tgt_in: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor,
        cache: Optional[KVCache] = None,
    ) -> torch.Tensor:
        """tgt_in (B, T) ids -> decoder states (B, T, d). With a cache, tgt_in holds only the new
        positions, which start at cache.length; the cache is updated in place."""
        start = cache.length if cache is not None else 0
        y = self.dropout(self.pos(self.tgt_embed(tgt_in), start))
        h = self.decoder(y, memory, src_mask, cache)
        if cache is not None:
            cache.length += tgt_in.size(1)
        return h

    def forward(
        self,
        src: torch.Tensor,
        tgt_in: torch.Tensor,
        tgt_out: Optional[torch.Tensor] = None,
        smoothing: float = 0.0,
    ) -> torch.Tensor:
        """Teacher-forced logits (B, T, V) of src (B, S) and tgt_in (B, T) ids.

        Every position is projected, padding included: picking the real tokens first skips the
        padding in the largest matrix multiply, but was slower overall in `make bench` ablations
        (BENCHMARKS.md). With tgt_out (B, T), the summed label-smoothed loss instead, from
        chunked_output_loss: the CPU's training step, which never needs the logits whole.
        """
        memory, src_mask = self.encode(src)
        h = self.decode(tgt_in, memory, src_mask)  # (B, T, d)
        if tgt_out is not None:
            device = h.device.type
            autocast_dtype = torch.get_autocast_dtype(device)
            dtype = self.output_dtype or (
                autocast_dtype if torch.is_autocast_enabled(device) else torch.float32
            )
            return chunked_output_loss(h, self.generator.weight, tgt_out, smoothing, dtype)
        if self.output_dtype is None:
            return self.generator(h)
        with torch.autocast(h.device.type, dtype=self.output_dtype):
            return self.generator(h)  # (B, T, V) in output_dtype

    def new_cache(self) -> KVCache:
        return KVCache(len(self.decoder.layers))

    @torch.no_grad()
    def cross_attention(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Cross-attention weights of every decoder layer and head, teacher-forced: (L, B, H, T,
        S)."""
        memory, src_mask = self.encode(src)
        weights: list[torch.Tensor] = []
        self.decoder(
            self.dropout(self.pos(self.tgt_embed(tgt_in))), memory, src_mask, attention=weights
        )
        return torch.stack(weights)

    def decode_step(
        self, tokens: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor, cache: KVCache
    ) -> torch.Tensor:
        """One incremental step: tokens (B, 1) -> logits (B, V) of the next token, in the compute
        dtype.

        Only the newest position is projected to the vocabulary. Search normalises what it needs:
        greedy takes the argmax as is, beam search only the best few tokens of each row.
        """
        h = self.decode(tokens, memory, src_mask, cache)[:, -1]  # (B, d)
        return self.generator(h)

    def train_flops(self, src: torch.Tensor, tgt_out: torch.Tensor) -> float:
        """Model FLOPs of one training step on a padded batch, counting real (non-pad) tokens only.

        Forward: 2 per multiply-add of every weight matrix a token meets, plus attention scores and
        weighted sums (the causal half for decoder self-attention); training = 3 x forward.
        """
        c = self.cfg
        d, vocab = c.d_model, self.generator.out_features
        # The feed-forward's FLOPs a token, from its weights' shapes (all layers' are alike), so
        # swiglu's third product counts without a case of its own
        ff = self.encoder.layers[0].ff
        ffn = 2 * (ff.w1.weight.numel() + ff.w2.weight.numel())
        s_len = (src != PAD).sum(1).double()  # (B,)
        t_len = (tgt_out != PAD).sum(1).double()
        S, T = s_len.sum().item(), t_len.sum().item()
        fwd = c.encoder_layers * (S * (8 * d * d + ffn) + (4 * d * s_len**2).sum().item())
        fwd += c.decoder_layers * (
            T * (12 * d * d + ffn)
            + S * 4 * d * d
            + (2 * d * t_len * (t_len + 1)).sum().item()
            + (4 * d * t_len * s_len).sum().item()
        )
        return 3 * (fwd + T * 2 * d * vocab)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # tied matrices are counted once


# --------------------------------------------------------------------------- ensembles


class Ensemble(nn.Module):
    """Models that decode together: the next-token distribution is the mean of theirs, each model
    with its own KV cache. It offers what search needs of a Transformer (encode, new_cache,
    decode_step and forward), returning log-probabilities where a Transformer returns logits: search
    normalises either."""

    def __init__(self, models: list[Transformer]):
        super().__init__()
        self.members = nn.ModuleList(models)
        # the shortest limit holds
        self.cfg = min((m.cfg for m in models), key=lambda c: c.max_positions)

    def encode(self, src: torch.Tensor) -> tuple["_PerMember", torch.Tensor]:
        encoded = [m.encode(src) for m in self.members]
        # one padding mask: one source
        return _PerMember([memory for memory, _ in encoded]), encoded[0][1]

    def new_cache(self) -> "_PerMember":
        return _PerMember([m.new_cache() for m in self.members])

    def decode_step(
        self,
        tokens: torch.Tensor,
        memory: "_PerMember",
        src_mask: torch.Tensor,
        cache: "_PerMember",
    ) -> torch.Tensor:
        """(B, 1) tokens -> (B, V) log of the members' mean next-token probability."""
        logps = [
            F.log_softmax(m.decode_step(tokens, mem, src_mask, c), dim=-1, dtype=torch.float32)
            for m, mem, c in zip(self.members, memory.parts, cache.parts)
        ]
        return torch.stack(logps).logsumexp(0) - math.log(len(logps))

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """Teacher-forced (B, T, V) log of the members' mean probability."""
        logps = [F.log_softmax(m(src, tgt_in), dim=-1, dtype=torch.float32) for m in self.members]
        return torch.stack(logps).logsumexp(0) - math.log(len(logps))

    def cross_attention(self, src: torch.Tensor, tgt_in: torch.Tensor) -> torch.Tensor:
        """The first member's cross-attention (members may differ in layers and heads)."""
        return self.members[0].cross_attention(src, tgt_in)


class _PerMember:
    """One object per ensemble member (encoder outputs, KV caches), indexed and reordered
    together."""

    def __init__(self, parts: list):
        self.parts = parts

    def __getitem__(self, index: torch.Tensor) -> "_PerMember":
        return _PerMember([p[index] for p in self.parts])

    def reorder(self, index: torch.Tensor) -> None:
        for p in self.parts:
            p.reorder(index)

    def reorder_self(self, index: torch.Tensor) -> None:
        for p in self.parts:
            p.reorder_self(index)

    def reorder_cross(self, index: torch.Tensor) -> None:
        for p in self.parts:
            p.reorder_cross(index)


def label_smoothed_loss(
    logits: torch.Tensor, target: torch.Tensor, smoothing: float
) -> torch.Tensor:
    """Summed label-smoothed cross-entropy over non-padding targets (Sec. 5.4). logits (..., V)."""
    V = logits.size(-1)
    return F.cross_entropy(
        logits.reshape(-1, V).float(),
        target.reshape(-1),
        ignore_index=PAD,
        label_smoothing=smoothing,
        reduction="sum",
    )


# The logits chunked_output_loss makes at a time: 256 rows of a 10,000-piece vocabulary (10 MB of
# fp32). On the recipe's step, 128 to 512 rows were level; 32 were slower than no chunking (each
# chunk runs a dozen small ops and three small matmuls) (docs/multi30k.md).
OUTPUT_CHUNK_ELEMENTS = 2_560_000


class _ChunkedOutputLoss(torch.autograd.Function):
    """label_smoothed_loss(h @ W^T, target, eps) and its gradients, one chunk of rows at a time.

    With z = h W^T, p = softmax(z) and lse = log sum_v exp(z_v), a row's loss is
    lse - (1 - eps) z_t - (eps / V) sum_v z_v, and dloss/dz = p - (1 - eps) onehot(t) - eps / V.
    Only p depends on the whole row: it is made, used for both gradient matmuls and dropped chunk
    by chunk. In fp32 the one-hot and eps / V parts reduce to (n, d) and (V, d) terms (sum_v z_v =
    h . sum_v W_v; the one-hot picks rows of W for dh and adds rows of h for dW), and p's 1 / sum is
    applied to the (c, d) sides. With bf16 matmuls the chunk's whole dloss/dz is made in fp32 and
    rounded once, as F.cross_entropy's backward does on bf16 logits: where p_t is near 1 - eps the
    gradient is a small difference, which rounding its two large terms apart would lose. The
    gradients are computed in the forward pass (the loss ends the graph), scaled in the backward.
    """

    @staticmethod
    def forward(ctx, h, weight, target, smoothing, dtype):  # type: ignore[override]
        # h (N, d), weight (V, d), target (N,) with PAD where there is no token
        V = weight.size(0)
        keep = (target != PAD).nonzero().squeeze(1)  # (n,)
        x, t = h[keep].float(), target[keep]  # (n, d), (n,)
        exact = dtype == torch.float32
        w = weight.to(dtype)  # the matmuls' precision: bf16-output or autocast's, else fp32
        w_sum = weight.float().sum(0)  # (d,)
        lse, z_t = x.new_empty(len(t)), x.new_empty(len(t))  # (n,) each
        grad_x = torch.empty_like(x)  # (n, d)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)  # (V, d)
        rows = max(1, OUTPUT_CHUNK_ELEMENTS // V)
        for s in range(0, len(t), rows):
            xc, tc = x[s : s + rows], t[s : s + rows]  # (c, d), (c,)
            z = (xc.to(dtype) @ w.t()).float()  # (c, V) logits
            z_t[s : s + rows] = z.gather(1, tc[:, None]).squeeze(1)
            top = z.amax(-1, keepdim=True)  # (c, 1)
            e = z.sub_(top).exp_()  # (c, V): exp(z - top), in place
            total = e.sum(-1, keepdim=True)  # (c, 1)
            lse[s : s + rows] = (top + total.log()).squeeze(1)
            if exact:  # p @ W and p^T @ h, with p = e / total applied to the (c, d) sides
                inv = total.reciprocal()
                grad_x[s : s + rows] = (e @ w) * inv
                grad_w.addmm_(e.t(), xc * inv)  # in place: no (V, d) product to add
            else:  # the chunk's whole dloss/dz, rounded once
                dz = e.mul_(total.reciprocal()).sub_(smoothing / V)
                dz[torch.arange(len(tc)), tc] -= 1 - smoothing
                dz = dz.to(dtype)
                grad_x[s : s + rows] = (dz @ w).float()
                grad_w += (dz.t() @ xc.to(dtype)).float()
        loss = (lse - (1 - smoothing) * z_t - (smoothing / V) * (x @ w_sum)).sum()
        if exact:
            grad_x -= (1 - smoothing) * weight[t].float() + (smoothing / V) * w_sum
            grad_w -= (smoothing / V) * x.sum(0)
            grad_w.index_add_(0, t, x, alpha=-(1 - smoothing))
        grad_h = torch.zeros_like(h)
        grad_h[keep] = grad_x.to(h.dtype)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):  # type: ignore[override]
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None, None, None


def chunked_output_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    smoothing: float,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """label_smoothed_loss(h @ weight^T, target, smoothing) without the (tokens, V) logits: the
    softmax and both gradient matmuls run on chunks of rows that stay in the CPU's cache, where the
    whole matrix makes six passes through memory. h (..., d) decoder states, weight (V, d) the
    output projection, target (...); the matmuls run in `dtype`, the softmax in fp32."""
    with torch.autocast(h.device.type, enabled=False):
        return _ChunkedOutputLoss.apply(
            h.reshape(-1, h.size(-1)), weight, target.reshape(-1), smoothing, dtype
        )


def symmetric_kl(
    logits_a: torch.Tensor, logits_b: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """KL(a‖b) + KL(b‖a) of two predictions of the same targets, summed over the non-padding ones:
    R-Drop's consistency term (Liang et al., 2021). logits (..., V), target (...)."""
    V = logits_a.size(-1)
    keep = target.reshape(-1) != PAD  # (N,)
    log_a = logits_a.reshape(-1, V)[keep].float().log_softmax(-1)  # (n, V)
    log_b = logits_b.reshape(-1, V)[keep].float().log_softmax(-1)  # (n, V)
    # sum p_a (log p_a - log p_b) + sum p_b (log p_b - log p_a) = sum (p_a - p_b)(log p_a - log p_b)
    return ((log_a.exp() - log_b.exp()) * (log_a - log_b)).sum()
