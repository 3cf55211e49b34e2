"""`tmt export`: a checkpoint as a CTranslate2 model directory (the `[ct2]` extra).

CTranslate2 is the fastest CPU engine for Transformer translation models (int8 weights, its own
kernels); its converters read fairseq, OpenNMT and Marian models, and this one reads ours. The
directory holds CTranslate2's model.bin, config.json and vocabularies, our SentencePiece model(s),
the run's config (tmt_config.yaml, for `tmt evaluate`'s test split and decode settings), tmt.json
and a README.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch

from .checkpoint import load_for_inference, resolve_checkpoint
from .config import QUANTIZATIONS, save_config
from .errors import UserError
from .fileio import temp_dir
from .model import MultiHeadAttention, Transformer
from .tokenizer import Tokenizer
from .vocab import BOS, EOS, UNK

MANIFEST = "tmt.json"  # what makes a directory one of our exports


class ExportError(UserError):
    """The model cannot be exported (an option CTranslate2 cannot express, or the extra is
    missing)."""


def import_ctranslate2() -> Any:
    try:
        import ctranslate2
    except ImportError:
        raise ExportError(
            "CTranslate2 is not installed: pip install 'transformer-mt[ct2]'"
        ) from None
    return ctranslate2


def is_export(path: str | Path) -> bool:
    """A directory written by export_ctranslate2."""
    return (Path(path) / MANIFEST).is_file() and (Path(path) / "model.bin").is_file()


def export_ctranslate2(
    checkpoint: str | Path | None,
    output: str | Path,
    quantization: str = "float32",
    force: bool = False,
) -> Path:
    """Convert a checkpoint (or a run directory's best) into a CTranslate2 model directory `output`.

    The export is written into a temporary directory beside `output` and renamed into place, so
    `output` is whole or untouched; force=True replaces an earlier export whole (no stale file of it
    survives)."""
    if quantization not in QUANTIZATIONS:
        raise ExportError(
            f"--quantization {quantization!r}: choose one of {', '.join(QUANTIZATIONS)}"
        )
    ct2 = import_ctranslate2()
    path = resolve_checkpoint(checkpoint)
    return write_directory(output, force, lambda tmp: _write_export(ct2, path, tmp, quantization))


def write_directory(output: str | Path, force: bool, write: Callable[[Path], None]) -> Path:
    """Call write(tmp) on an empty temporary directory beside `output`, then rename it into place:
    `output` is whole or untouched. force=True replaces an earlier export (a directory with
    tmt.json) whole; any other non-empty `output` is refused."""
    out = Path(output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not force:
            raise ExportError(
                f"{out} exists and is not empty: choose another --output or pass --force"
            )
        # --force empties a directory: only one that holds an earlier export
        if not (out / MANIFEST).is_file():
            raise ExportError(
                f"{out} is not a tmt export (no {MANIFEST}): --force replaces only an earlier "
                "export; choose another --output"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        write(tmp)
        # the earlier export goes aside, the new one takes its name, then the old one goes
        if out.exists():
            old = temp_dir(out.parent, prefix=f".{out.name}.", suffix=".old")
            os.replace(out, old / out.name)
            try:
                os.replace(tmp, out)
            except OSError:
                os.replace(old / out.name, out)
                raise
            finally:
                shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_export(ct2: Any, path: Path, out: Path, quantization: str) -> None:
    """Everything an export holds, written into the (empty) directory `out`."""
    model, tokenizer, cfg, ckpt = load_for_inference(path, "cpu")
    spec = model_spec(ct2, model, tokenizer)
    try:
        spec.validate()
        spec.optimize(quantization=quantization)
    except (ValueError, TypeError) as e:
        raise ExportError(f"CTranslate2 refused the converted model: {e}") from None
    spec.save(str(out))
    tokenizer.save(out)
    save_config(cfg, out / "tmt_config.yaml")
    manifest = {
        "checkpoint": str(path.resolve()),
        "step": ckpt.get("step"),
        "tokenizer": tokenizer.digest,
        "quantization": quantization,
        "precision": cfg.train.precision,
        "ctranslate2": ct2.__version__,
        "max_positions": cfg.model.max_positions,
        "parameters": model.num_parameters(),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    (out / "README.md").write_text(_readme(path, manifest))


def export_tokenizer(directory: Path, manifest: dict[str, Any]) -> Tokenizer:
    """The SentencePiece model(s) of an export, checked against the digest its manifest recorded: a
    model copied or left over from another export would tokenize silently wrong."""
    tokenizer = Tokenizer.load(directory)
    if manifest.get("tokenizer") not in (None, tokenizer.digest):
        files = "spm.model" if tokenizer.joint else "spm.src.model + spm.tgt.model"
        raise UserError(
            f"{directory / MANIFEST} records tokenizer {manifest['tokenizer']} but {files} in "
            f"{directory} is {tokenizer.digest}: the SentencePiece model does not belong to this "
            "export; export again (tmt export --force) or copy the model(s) from the run it came "
            "from"
        )
    return tokenizer


CACHE_KEEP = 3  # exports kept in a run's ct2-cache/, the most recently used
_DIGESTS: dict[tuple[Any, ...], str] = {}


def checkpoint_digest(path: Path) -> str:
    """sha256 of the checkpoint's bytes; memoised for this process by the file's identity, size,
    mtime and ctime (a rewrite changes the ctime, which no tool sets back)."""
    st = path.stat()
    key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def cached_export(checkpoint: Path, cache_root: Path, keep: int = CACHE_KEEP) -> Path:
    """A float32 export of `checkpoint` under cache_root, made once per checkpoint content (its
    digest names it); CTranslate2 quantizes on load to the compute type asked for. Each process
    converts into its own temporary directory and renames it into place; if another process put the
    same export there meanwhile, its copy is kept and this one discarded. Only the `keep` most
    recently used exports stay."""
    out = cache_root / f"{checkpoint.stem}-{checkpoint_digest(checkpoint)[:16]}"
    fresh = is_export(out)
    if fresh:
        try:
            os.utime(out)  # most recently used
        except FileNotFoundError:  # another process pruned it just now: convert it again
            fresh = False
    if not fresh:
        cache_root.mkdir(parents=True, exist_ok=True)
        work = temp_dir(cache_root, prefix=f".{out.name}.", suffix=".tmp")
        try:
            export_ctranslate2(checkpoint, work / out.name, "float32")
            try:
                os.rename(work / out.name, out)  # atomic; refused when `out` appeared meanwhile
            except OSError:
                if not is_export(out):
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    _prune(cache_root, keep, out)
    return out


def _prune(cache_root: Path, keep: int, current: Path) -> None:
    """Remove all but the `keep` most recently used exports (never `current`), and temporary
    directories an interrupted conversion left behind more than an hour ago."""
    # another process may remove some
    entries = {p: _mtime_ns(p) for p in cache_root.iterdir() if p.is_dir()}
    exports = sorted(
        (p for p in entries if not p.name.startswith(".") and p != current),
        key=entries.get,
        reverse=True,
    )
    stale = [
        p
        for p, t in entries.items()
        if p.name.startswith(".") and t < time.time_ns() - 3600 * 10**9
    ]
    for p in exports[max(keep - 1, 0) :] + stale:
        shutil.rmtree(p, ignore_errors=True)


def _mtime_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0


# --------------------------------------------------------------------------- the specification


def model_spec(ct2: Any, model: Transformer, tokenizer: Tokenizer) -> Any:
    """CTranslate2's TransformerSpec with our weights, vocabularies and special tokens."""
    if not isinstance(model, Transformer):
        raise ExportError(
            "only a single model exports: average the checkpoints (tmt average) instead of "
            "ensembling them"
        )
    cfg = model.cfg
    if cfg.norm_type != "layer":
        raise ExportError(
            "CTranslate2 exports LayerNorm models only (model.norm_type: layer): its Transformer "
            "has no ScaleNorm"
        )
    if cfg.activation == "swiglu":
        raise ExportError(
            "CTranslate2 export takes model.activation relu or gelu, not swiglu: the gated "
            "layer's weights are not mapped onto its spec"
        )
    specs = ct2.specs
    spec = specs.TransformerSpec.from_config(
        (cfg.encoder_layers, cfg.decoder_layers),
        cfg.heads,
        pre_norm=cfg.norm == "pre",
        activation=specs.Activation.GELU if cfg.activation == "gelu" else specs.Activation.RELU,
    )
    # (P, d): ours interleave sin and cos, so CTranslate2 gets the table
    positions = model.pos.pe.numpy()
    _input_layers(spec.encoder, model.src_embed.lut.weight, positions)
    _input_layers(spec.decoder, model.tgt_embed.lut.weight, positions)
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder.layers):
        _attention(layer_spec.self_attention, layer.self_attn, layer.norm1)
        _ffn(layer_spec.ffn, layer.ff, layer.norm2)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder.layers):
        _attention(layer_spec.self_attention, layer.self_attn, layer.norm1)
        _attention(layer_spec.attention, layer.cross_attn, layer.norm2)
        _ffn(layer_spec.ffn, layer.ff, layer.norm3)
    if cfg.norm == "pre":
        _norm(spec.encoder.layer_norm, model.encoder.norm)
        _norm(spec.decoder.layer_norm, model.decoder.norm)
    spec.decoder.projection.weight = _np(model.generator.weight)
    src_vocab, tgt_vocab = vocabulary_pieces(tokenizer.src), vocabulary_pieces(tokenizer.tgt)
    spec.register_source_vocabulary(src_vocab)
    spec.register_target_vocabulary(tgt_vocab)
    c = spec.config
    c.unk_token, c.bos_token, c.eos_token = tgt_vocab[UNK], tgt_vocab[BOS], tgt_vocab[EOS]
    c.decoder_start_token, c.add_source_eos = tgt_vocab[BOS], True  # our sources end in EOS
    c.layer_norm_epsilon = model.encoder.layers[0].norm1.eps
    return spec


def _np(t: torch.Tensor) -> Any:
    return t.detach().float().cpu().numpy().copy()


def _input_layers(spec: Any, embedding: torch.Tensor, positions: Any) -> None:
    emb = spec.embeddings[0] if isinstance(spec.embeddings, list) else spec.embeddings
    emb.weight = _np(embedding)
    spec.scale_embeddings = True  # x sqrt(d_model), Sec. 3.4
    spec.position_encodings.encodings = positions.copy()


def _norm(spec: Any, norm: torch.nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _np(norm.weight), _np(norm.bias)


def _linear(spec: Any, linear: torch.nn.Linear) -> None:
    spec.weight, spec.bias = _np(linear.weight), _np(linear.bias)


def _attention(spec: Any, attn: MultiHeadAttention, norm: torch.nn.LayerNorm) -> None:
    """Our fused projections are CTranslate2's: self-attention QKV in one matrix, cross-attention Q
    then KV."""
    if attn.cross:
        _linear(spec.linear[0], attn.q_proj)
        _linear(spec.linear[1], attn.kv_proj)
    else:
        _linear(spec.linear[0], attn.qkv_proj)
    _linear(spec.linear[-1], attn.out_proj)
    _norm(spec.layer_norm, norm)


def _ffn(spec: Any, ff: torch.nn.Module, norm: torch.nn.LayerNorm) -> None:
    _linear(spec.linear_0, ff.w1)
    _linear(spec.linear_1, ff.w2)
    _norm(spec.layer_norm, norm)


def vocabulary_pieces(sp: Any) -> list[str]:
    """Every piece of a SentencePiece model in id order: what an exported vocabulary lists (the
    CTranslate2 and the transformers exports); duplicates refused, as pieces are looked up."""
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if len(set(pieces)) != len(pieces):
        raise ExportError(
            "the SentencePiece model has duplicate pieces; CTranslate2 looks tokens up by piece"
        )
    return pieces


def _readme(path: Path, manifest: dict[str, Any]) -> str:
    return (
        f"# CTranslate2 export of {path.name}\n\nWritten by `tmt export` from "
        f"`{manifest['checkpoint']}` (step {manifest['step']}), weights stored as "
        f"{manifest['quantization']}, for CTranslate2 {manifest['ctranslate2']}.\n\nWith "
        "transformer-mt: `tmt translate --engine ctranslate2 -c THIS_DIR`, and likewise evaluate, "
        "score and serve.\n\nWith CTranslate2 alone: encode the source with `spm.model` (or "
        "`spm.src.model`), then `ctranslate2.Translator(THIS_DIR).translate_batch(pieces)`; the "
        "end-of-sentence token is added to the source for you, and outputs are decoded with "
        "`spm.model` (or `spm.tgt.model`).\n"
    )
