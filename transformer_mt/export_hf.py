"""`tmt export --format transformers`: a checkpoint as a Hugging Face `transformers` Marian model
directory (the `[hf]` extra), which `MarianMTModel`/`MarianTokenizer` (or the Auto classes and
`pipeline("translation")`) load with no tmt installed.

Our post-norm Transformer is Marian's architecture (post-norm, sinusoidal positions, embeddings x
sqrt(d), ReLU), with one difference: our position table interleaves sin and cos (model.py), Marian's
puts the sines in the first half of the model dimension and the cosines in the second, and
`from_pretrained` recomputes that table rather than load one. So the export permutes the model
dimension: every vector of the residual stream has its coordinates reordered the same way, which
is an exact reparametrisation (embeddings, LayerNorms and the matrices that read or write the
residual stream are permuted with it; attention heads and the feed-forward's inner dimension are
untouched). Pre-norm models are refused: no `transformers` architecture has pre-norm layers, final
LayerNorms and our position table all at once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .checkpoint import load_for_inference, resolve_checkpoint
from .config import Config
from .export import MANIFEST, ExportError, vocabulary_pieces, write_directory
from .model import MultiHeadAttention, Transformer
from .tokenizer import Tokenizer
from .vocab import BOS, EOS, PAD


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ExportError(
            "Hugging Face transformers is not installed: pip install 'transformer-mt[hf]'"
        ) from None
    return transformers


def export_transformers(
    checkpoint: str | Path | None, output: str | Path, force: bool = False
) -> Path:
    """Convert a checkpoint (or a run directory's best) into a `transformers` Marian model
    directory `output`, written whole or not at all (export.write_directory)."""
    tf = import_transformers()
    path = resolve_checkpoint(checkpoint)
    return write_directory(output, force, lambda tmp: _write_export(tf, path, tmp))


def _write_export(tf: Any, path: Path, out: Path) -> None:
    model, tokenizer, cfg, ckpt = load_for_inference(path, "cpu")
    marian = marian_model(tf, model, tokenizer)
    manifest = {
        "format": "transformers",
        "checkpoint": str(path.resolve()),
        "step": ckpt.get("step"),
        "tokenizer": tokenizer.digest,
        "tmt_version": __version__,
        "transformers": tf.__version__,
        "max_positions": cfg.model.max_positions,
        "parameters": model.num_parameters(),
    }
    marian.config.tmt = manifest  # saved in config.json too
    marian.save_pretrained(str(out))
    _write_tokenizer(out, tokenizer, cfg)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "README.md").write_text(_readme(path, manifest, cfg))


# --------------------------------------------------------------------------- the model


def marian_config(tf: Any, model: Transformer, tokenizer: Tokenizer) -> Any:
    """MarianConfig of our model: our special ids, decoding starts from BOS; generation greedy,
    never PAD or BOS (as search.py), EOS forced at the length limit (as our budget)."""
    c = model.cfg
    tied = c.tie_embeddings
    config = tf.MarianConfig(
        vocab_size=tokenizer.src_vocab_size,
        decoder_vocab_size=tokenizer.tgt_vocab_size,
        d_model=c.d_model,
        encoder_layers=c.encoder_layers,
        decoder_layers=c.decoder_layers,
        encoder_attention_heads=c.heads,
        decoder_attention_heads=c.heads,
        encoder_ffn_dim=c.d_ff,
        decoder_ffn_dim=c.d_ff,
        max_position_embeddings=c.max_positions,
        activation_function=c.activation,
        dropout=c.dropout,
        attention_dropout=c.attention_dropout,
        activation_dropout=c.activation_dropout,
        scale_embedding=True,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        decoder_start_token_id=BOS,
        forced_eos_token_id=EOS,
        # one matrix for source, target and output only when ours has one
        share_encoder_decoder_embeddings=tied and tokenizer.joint,
        tie_word_embeddings=tied,
    )
    return config


def generation_config(tf: Any, model: Transformer) -> Any:
    return tf.GenerationConfig(
        decoder_start_token_id=BOS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        forced_eos_token_id=EOS,
        suppress_tokens=[PAD, BOS],
        num_beams=1,
        do_sample=False,
        max_length=model.cfg.max_positions + 1,  # + the decoder's start token
    )


def marian_model(tf: Any, model: Transformer, tokenizer: Tokenizer) -> Any:
    """MarianMTModel with our weights, the model dimension permuted (the module docstring)."""
    if not isinstance(model, Transformer):
        raise ExportError("only a single model exports: average the checkpoints (tmt average)")
    if model.cfg.norm != "post":
        raise ExportError(
            "--format transformers exports post-norm models only (model.norm: post): Marian, "
            "the architecture they map onto, has no pre-norm layers"
        )
    if model.cfg.norm_type != "layer":
        raise ExportError(
            "--format transformers exports LayerNorm models only (model.norm_type: layer): "
            "Marian has no ScaleNorm"
        )
    if model.cfg.activation == "swiglu":
        raise ExportError(
            "--format transformers exports model.activation relu or gelu, not swiglu: Marian's "
            "feed-forward layer has no gate"
        )
    d = model.cfg.d_model
    if d % 2:
        raise ExportError(f"model.d_model={d} is odd: Marian's position table needs it even")
    marian = tf.MarianMTModel(marian_config(tf, model, tokenizer)).eval()
    marian.generation_config = generation_config(tf, model)
    perm = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])  # sines, then cosines
    with torch.no_grad():
        _copy_weights(marian, model, perm)
    return marian


def _copy_weights(marian: Any, model: Transformer, perm: torch.Tensor) -> None:
    m = marian.model
    # tied matrices are one tensor on both sides: copying into one of them sets all
    _set(m.encoder.embed_tokens.weight, model.src_embed.lut.weight[:, perm])
    _set(m.decoder.embed_tokens.weight, model.tgt_embed.lut.weight[:, perm])
    _set(marian.lm_head.weight, model.generator.weight[:, perm])
    marian.final_logits_bias.zero_()
    for theirs, ours in zip(m.encoder.layers, model.encoder.layers):
        _attention(theirs.self_attn, ours.self_attn, perm)
        _norm(theirs.self_attn_layer_norm, ours.norm1, perm)
        _ffn(theirs, ours.ff, perm)
        _norm(theirs.final_layer_norm, ours.norm2, perm)
    for theirs, ours in zip(m.decoder.layers, model.decoder.layers):
        _attention(theirs.self_attn, ours.self_attn, perm)
        _norm(theirs.self_attn_layer_norm, ours.norm1, perm)
        _attention(theirs.encoder_attn, ours.cross_attn, perm)
        _norm(theirs.encoder_attn_layer_norm, ours.norm2, perm)
        _ffn(theirs, ours.ff, perm)
        _norm(theirs.final_layer_norm, ours.norm3, perm)


def _set(param: torch.Tensor, value: torch.Tensor) -> None:
    if param.shape != value.shape:
        raise ExportError(f"internal: shape {tuple(value.shape)} for {tuple(param.shape)}")
    param.copy_(value.float())


def _norm(theirs: torch.nn.LayerNorm, ours: torch.nn.LayerNorm, perm: torch.Tensor) -> None:
    _set(theirs.weight, ours.weight[perm])
    _set(theirs.bias, ours.bias[perm])
    theirs.eps = ours.eps


def _reads(theirs: torch.nn.Linear, weight: torch.Tensor, bias: torch.Tensor, perm) -> None:
    """A linear map from the residual stream: its input columns permuted."""
    _set(theirs.weight, weight[:, perm])
    _set(theirs.bias, bias)


def _writes(theirs: torch.nn.Linear, ours: torch.nn.Linear, perm: torch.Tensor) -> None:
    """A linear map into the residual stream: its output rows permuted."""
    _set(theirs.weight, ours.weight[perm])
    _set(theirs.bias, ours.bias[perm])


def _attention(theirs: Any, ours: MultiHeadAttention, perm: torch.Tensor) -> None:
    """Our fused projections split: self-attention QKV (3d rows: Q, K, V), cross-attention Q and
    KV (2d rows: K, V); heads are contiguous row blocks on both sides."""
    if ours.cross:
        q = (ours.q_proj.weight, ours.q_proj.bias)
        k, v = zip(ours.kv_proj.weight.chunk(2), ours.kv_proj.bias.chunk(2))
    else:
        q, k, v = zip(ours.qkv_proj.weight.chunk(3), ours.qkv_proj.bias.chunk(3))
    for linear, (weight, bias) in zip((theirs.q_proj, theirs.k_proj, theirs.v_proj), (q, k, v)):
        _reads(linear, weight, bias, perm)
    _writes(theirs.out_proj, ours.out_proj, perm)


def _ffn(theirs: Any, ff: torch.nn.Module, perm: torch.Tensor) -> None:
    _reads(theirs.fc1, ff.w1.weight, ff.w1.bias, perm)
    _writes(theirs.fc2, ff.w2, perm)


# --------------------------------------------------------------------------- the tokenizer


def _write_tokenizer(out: Path, tokenizer: Tokenizer, cfg: Config) -> None:
    """MarianTokenizer's files: SentencePiece models as source.spm/target.spm and piece -> id
    vocabularies (ours are SentencePiece's own ids); the sources end in EOS as ours do."""
    (out / "source.spm").write_bytes(tokenizer.src_bytes)
    (out / "target.spm").write_bytes(tokenizer.tgt_bytes)
    _write_vocab(out / "vocab.json", tokenizer.src)
    settings: dict[str, Any] = {
        "tokenizer_class": "MarianTokenizer",
        "source_lang": cfg.data.src_lang,
        "target_lang": cfg.data.tgt_lang,
        "unk_token": "<unk>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "bos_token": "<s>",
        "model_max_length": cfg.model.max_positions,
        "separate_vocabs": not tokenizer.joint,
        "clean_up_tokenization_spaces": False,
    }
    if not tokenizer.joint:
        _write_vocab(out / "target_vocab.json", tokenizer.tgt)
        settings["target_vocab_file"] = "target_vocab.json"
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
    special = {"unk_token": "<unk>", "eos_token": "</s>", "pad_token": "<pad>", "bos_token": "<s>"}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _write_vocab(path: Path, sp: Any) -> None:
    pieces = vocabulary_pieces(sp)  # refuses duplicate pieces
    expected = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}
    for i, piece in expected.items():
        if pieces[i] != piece:
            raise ExportError(f"SentencePiece id {i} is {pieces[i]!r}, not {piece!r}")
    path.write_text(json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False) + "\n")


def _readme(path: Path, manifest: dict[str, Any], cfg: Config) -> str:
    d = cfg.decode
    return f"""# Hugging Face `transformers` export of {path.name}

Written by `tmt export --format transformers` (transformer-mt {manifest["tmt_version"]}) from
`{manifest["checkpoint"]}` (step {manifest["step"]}, tokenizer {manifest["tokenizer"]}), for
transformers {manifest["transformers"]}; the same facts are in `tmt.json` and under `tmt` in
`config.json`. A Marian model: `MarianMTModel` and `MarianTokenizer` (or the Auto classes) load it.

```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer  # DIR: this directory
tok, model = AutoTokenizer.from_pretrained(DIR), AutoModelForSeq2SeqLM.from_pretrained(DIR)
out = model.generate(**tok(["A sentence to translate."], return_tensors="pt"))
print(tok.batch_decode(out, skip_special_tokens=True))
```

With transformers 4.x, also `pipeline("translation", model="THIS_DIR")` (transformers 5 removed
the translation pipeline).

## What differs from `tmt translate`

- **Search.** `generation_config.json` asks for greedy search (`num_beams=1`): its outputs are
  `tmt translate --beam 1`'s. With `num_beams=N`, transformers ranks finished hypotheses by
  log P / |Y|^length_penalty; tmt by the GNMT penalty log P / ((5 + |Y|) / 6)^alpha (this run's
  alpha: {d.alpha}), so beam outputs can differ.
- **Length budget.** tmt stops at {d.max_len_a} x source length + {d.max_len_b} tokens (EOS
  included); transformers at `max_length` = {cfg.model.max_positions + 1} (the model's positions,
  plus the start token) unless you pass `max_new_tokens`. Both end a translation cut short with EOS.
- **Unknown pieces.** tmt writes an `<unk>` piece as " ⁇ "; the tokenizer's
  `skip_special_tokens=True` (the pipeline's default) drops it.
- Generation never emits `<pad>` or `<s>` (`suppress_tokens`), as tmt's search does; the source
  ends in `</s>` and decoding starts from `<s>` (id {BOS}), tmt's special ids (pad {PAD}, unk 1,
  bos {BOS}, eos {EOS}).

The model dimension is stored permuted (sines first, then cosines, as Marian's position table is):
an exact reparametrisation of the tmt model, so the weights differ from the checkpoint's while the
outputs do not.
"""
