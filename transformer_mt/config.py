"""Configuration: one dataclass per YAML section, loaded strictly (no torch import here).

Unknown keys, wrong types and out-of-range values fail at load time with the dotted key,
the file and line where we know it, and the closest valid name.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from .errors import UserError
from .fileio import atomic_write


class ConfigError(UserError):
    """A user error in a config file or override: the message says what and where."""


@dataclass
class SubwordSampling:
    """Subword regularisation (Kudo, 2018), section `data.subword_sampling`: every epoch draws each
    training sentence's segmentation (both sides) from its `nbest` best under the unigram model,
    with probability proportional to P(segmentation)^alpha. nbest 0 (the default) keeps the one
    best segmentation; validation and decoding always use the best one."""

    nbest: int = 0  # candidates per sentence; 0 = off
    alpha: float = 0.3  # smaller: closer to uniform over the n best; larger: closer to the 1-best

    def __post_init__(self) -> None:
        _check(
            self.nbest == 0 or self.nbest >= 2,
            "data.subword_sampling.nbest",
            f"must be 0 (off) or >= 2, got {self.nbest}",
        )
        _check(self.alpha > 0, "data.subword_sampling.alpha", f"must be > 0, got {self.alpha}")


@dataclass
class DataConfig:
    """Where the parallel corpus comes from (section `data`)."""

    src_lang: str = "en"
    tgt_lang: str = "de"
    # text: train/valid/test are path prefixes; files are PREFIX.LANG or PREFIX.LANG.gz.
    # tsv / jsonl: train/valid/test are file paths read with `datasets`' csv/json loaders.
    # hf: train/valid/test are split names of the hub dataset `dataset` (config `dataset_config`).
    format: Literal["text", "tsv", "jsonl", "hf"] = "text"
    train: Optional[str] = None
    valid: Optional[str] = None
    test: Optional[str] = None
    dataset: Optional[str] = None
    dataset_config: Optional[str] = None
    # Field names for tsv/jsonl/hf rows; dots reach into nested records ("translation.en").
    # Default: the language codes.
    src_field: Optional[str] = None
    tgt_field: Optional[str] = None
    # Training pairs longer than this (in subword tokens) are dropped; it must leave room for
    # BOS/EOS within model.max_positions. Default: 256, or model.max_positions - 1 when that is
    # smaller.
    max_len: Optional[int] = None
    # text/tsv files: stop at file:line, or replace and count
    invalid_utf8: Literal["error", "replace"] = "error"
    # tokenized-corpus cache shared by runs; default $TMT_CACHE, ~/.cache/transformer_mt
    cache_dir: Optional[str] = None
    # training only: a new segmentation of every training sentence each epoch (unigram tokenizers)
    subword_sampling: SubwordSampling = field(default_factory=SubwordSampling)

    def __post_init__(self) -> None:
        _check(
            self.max_len is None or self.max_len >= 1,
            "data.max_len",
            f"must be >= 1, got {self.max_len}",
        )
        if self.format == "hf":
            _check(
                bool(self.dataset),
                "data.dataset",
                "is required when data.format is hf (e.g. bentrevett/multi30k)",
            )
        _check(
            self.src_lang != self.tgt_lang or self.src_field != self.tgt_field,
            "data.tgt_lang",
            "source and target are the same field",
        )

    @property
    def fields(self) -> tuple[str, str]:
        return self.src_field or self.src_lang, self.tgt_field or self.tgt_lang


@dataclass
class TokenizerConfig:
    """SentencePiece settings (section `tokenizer`)."""

    type: Literal["unigram", "bpe"] = "unigram"
    vocab_size: int = 8000
    joint: bool = True  # one model and vocabulary for both languages
    # Share of characters the vocabulary covers; the rarest others become <unk> (or bytes, with
    # byte_fallback). Default as SentencePiece recommends: 0.9995 when a language is zh, ja or ko,
    # else 1.0.
    character_coverage: Optional[float] = None
    # spell characters outside the vocabulary as UTF-8 bytes: no <unk> at all
    byte_fallback: bool = False
    # SentencePiece trains on a random sample of at most this many lines
    max_sentences: int = 2_000_000

    def __post_init__(self) -> None:
        _check(
            self.vocab_size >= 16, "tokenizer.vocab_size", f"must be >= 16, got {self.vocab_size}"
        )
        _check(
            self.character_coverage is None or 0.9 <= self.character_coverage <= 1.0,
            "tokenizer.character_coverage",
            f"must be in [0.9, 1.0], got {self.character_coverage}",
        )


@dataclass
class ModelConfig:
    """Transformer sizes (section `model`); defaults are the paper's base model."""

    d_model: int = 512
    heads: int = 8
    encoder_layers: int = 6
    decoder_layers: int = 6
    d_ff: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    # The feed-forward layer's non-linearity: relu (the paper's), gelu, or swiglu, the gated
    # Swish(xW) * xV of Shazeer (2020), with d_ff the width of each of its two input projections
    activation: Literal["relu", "gelu", "swiglu"] = "relu"
    norm: Literal["post", "pre"] = "post"  # post: the paper's LayerNorm(x + Sublayer(x))
    # layer: LayerNorm; scale: ScaleNorm, g * x / ||x|| with one learned g (Nguyen & Salazar, 2019)
    norm_type: Literal["layer", "scale"] = "layer"
    tie_embeddings: bool = True  # joint vocab: src, tgt and output share one matrix
    max_positions: int = 1024

    def __post_init__(self) -> None:
        for key in (
            "d_model",
            "heads",
            "encoder_layers",
            "decoder_layers",
            "d_ff",
            "max_positions",
        ):
            _check(
                getattr(self, key) >= 1, f"model.{key}", f"must be >= 1, got {getattr(self, key)}"
            )
        _check(
            self.d_model % self.heads == 0,
            "model.d_model",
            f"({self.d_model}) must be divisible by model.heads ({self.heads})",
        )
        for key in ("dropout", "attention_dropout", "activation_dropout"):
            v = getattr(self, key)
            _check(0.0 <= v < 1.0, f"model.{key}", f"must be in [0, 1), got {v}")


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping (section `train`)."""

    seed: int = 1
    max_tokens: int = 4096  # per batch: n_sentences x (longer of source and target + 1)
    accumulate: int = 1  # batches per optimizer step
    max_steps: int = 100_000
    max_epochs: int = 1000
    max_minutes: float = 0.0  # time budget (set-up included); 0 = none. Stops, validates and saves.
    lr_factor: float = 2.0  # Noam: lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    warmup: int = 4000
    # When > 0, the warm-up is this share of the updates the run is planned to make, where that is
    # fewer than `warmup`: of max_steps, or, when max_minutes ends the run first, of the updates the
    # time budget holds at the rate of the run's first minute (so a slow CPU's short run is not
    # mostly warm-up). Noam's rate after the warm-up is the same 1/sqrt(step) curve either way.
    warmup_share: float = 0.0
    # The last fraction of the run over which the lr decays to ~0: of max_steps, or, when
    # max_minutes ends the run first, of the time budget (its steps planned from the step rate so
    # far).
    cooldown: float = 0.0
    # How the cooldown comes down: "linear", or "sqrt", 1 - sqrt(progress): it drops faster at first
    # and spends longer near 0 (ahead of linear in Hägele et al. (2024)'s language-model runs).
    cooldown_shape: Literal["linear", "sqrt"] = "linear"
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    # false: an L2 penalty (weight_decay x w joins the gradient, so Adam rescales it); true: AdamW's
    # decay (Loshchilov & Hutter, 2019; fairseq's Adam): each update shrinks w by lr x weight_decay.
    decoupled_weight_decay: bool = False
    # false: norm gains and biases and every bias (the tensors of under two dimensions) are not
    # decayed, as in BERT's and GPT's recipes, only the matrices (embeddings included); true:
    # all are.
    decay_norms_and_biases: bool = True
    label_smoothing: float = 0.1
    # Word dropout (Sennrich et al., 2016; Sennrich & Zhang, 2019): while training, each source
    # token and each decoder-input token becomes <unk> at this rate; 0 = off. Labels stay intact.
    word_dropout: float = 0.0
    # The decoder input's rate, when it should differ from the source's (0 = source-only); None =
    # word_dropout.
    target_word_dropout: Optional[float] = None
    # R-Drop (Liang et al., 2021): each batch passes twice, with its own dropout (and word dropout)
    # each time, and the loss adds this weight times the two predictions' symmetric KL; 0 = off.
    # An update then costs twice the compute (2.6x the time on two CPU cores: docs/multi30k.md).
    r_drop: float = 0.0
    # Bidirectional training (BiT; Ding et al., 2021): the first N epochs also train on every pair
    # reversed (target -> source), so they hold twice the pairs; later epochs the given direction
    # alone. Needs tokenizer.joint (both directions share one vocabulary). 0 = off.
    bidirectional_epochs: int = 0
    # The same for the first share of the training budget instead of a count of epochs: of
    # max_minutes when set (else of max_steps); the epoch under way when the share is reached is
    # the last trained both ways. A CPU that holds fewer epochs in the hour keeps the split of the
    # budget. 0 = off; not with bidirectional_epochs.
    bidirectional_share: float = 0.0
    clip_norm: float = 1.0  # 0 disables gradient clipping
    log_every: int = 50
    valid_every: int = 1000
    valid_bleu: bool = True  # decode the whole validation set (greedy unless valid_beam > 1)
    valid_beam: int = 1
    keep_last: int = 3  # step_N.pt checkpoints kept besides last.pt and best.pt
    # also write step_N.pt every N steps between validations (to average); 0 = at validations
    save_every: int = 0
    patience: int = 0  # stop after this many validations without a new best; 0 = never
    # at the end, average the newest N step checkpoints (averaged.pt; best.pt if better)
    average_last: int = 0
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    # bf16-output: fp32 with the output projection alone in bf16; auto on a CPU measures fp32, bf16
    # and it
    precision: Literal["auto", "fp32", "bf16", "fp16", "bf16-output"] = "auto"
    # scaled_dot_product_attention's kernel: torch's fused one, or math (plain tensor ops: faster
    # for short sentences on some CPUs); auto on a CPU times both at start-up, on a GPU takes fused
    attention: Literal["auto", "fused", "math"] = "auto"
    threads: int = 0  # torch intra-op threads on CPU; 0 = torch's default (an ensemble: its share)
    # Train an ensemble of this many models at once (members.py): each its own process and seed
    # (train.seed + i), on its share of the CPU's cores (or on the one GPU), sharing the run's
    # SentencePiece model; translate/evaluate on the run directory decode with all of them.
    ensemble: int = 1
    # torch.compile the model for training (checkpoints stay loadable without it)
    compile: bool = False

    def __post_init__(self) -> None:
        for key in (
            "max_tokens",
            "accumulate",
            "max_steps",
            "max_epochs",
            "warmup",
            "log_every",
            "valid_every",
            "valid_beam",
        ):
            _check(
                getattr(self, key) >= 1, f"train.{key}", f"must be >= 1, got {getattr(self, key)}"
            )
        _check(self.lr_factor > 0, "train.lr_factor", f"must be > 0, got {self.lr_factor}")
        _check(
            0.0 <= self.label_smoothing < 1.0,
            "train.label_smoothing",
            f"must be in [0, 1), got {self.label_smoothing}",
        )
        _check(
            0.0 <= self.word_dropout < 1.0,
            "train.word_dropout",
            f"must be in [0, 1), got {self.word_dropout}",
        )
        _check(
            self.target_word_dropout is None or 0.0 <= self.target_word_dropout < 1.0,
            "train.target_word_dropout",
            f"must be in [0, 1) or null, got {self.target_word_dropout}",
        )
        _check(self.r_drop >= 0, "train.r_drop", f"must be >= 0, got {self.r_drop}")
        _check(
            self.bidirectional_epochs >= 0,
            "train.bidirectional_epochs",
            f"must be >= 0, got {self.bidirectional_epochs}",
        )
        _check(
            0.0 <= self.bidirectional_share < 1.0,
            "train.bidirectional_share",
            f"must be in [0, 1), got {self.bidirectional_share}",
        )
        _check(
            not (self.bidirectional_share and self.bidirectional_epochs),
            "train.bidirectional_share",
            "and train.bidirectional_epochs both say when bidirectional training ends: set one",
        )
        _check(self.clip_norm >= 0, "train.clip_norm", f"must be >= 0, got {self.clip_norm}")
        _check(self.keep_last >= 0, "train.keep_last", f"must be >= 0, got {self.keep_last}")
        _check(self.save_every >= 0, "train.save_every", f"must be >= 0, got {self.save_every}")
        _check(self.patience >= 0, "train.patience", f"must be >= 0, got {self.patience}")
        _check(
            0.0 <= self.cooldown < 1.0, "train.cooldown", f"must be in [0, 1), got {self.cooldown}"
        )
        _check(
            0.0 <= self.warmup_share < 1.0,
            "train.warmup_share",
            f"must be in [0, 1), got {self.warmup_share}",
        )
        _check(self.max_minutes >= 0, "train.max_minutes", f"must be >= 0, got {self.max_minutes}")
        _check(
            self.average_last >= 0, "train.average_last", f"must be >= 0, got {self.average_last}"
        )
        _check(
            self.average_last <= max(self.keep_last, 1),
            "train.average_last",
            f"({self.average_last}) needs train.keep_last >= {self.average_last} step checkpoints "
            "to average",
        )
        _check(self.threads >= 0, "train.threads", f"must be >= 0, got {self.threads}")
        _check(self.ensemble >= 1, "train.ensemble", f"must be >= 1, got {self.ensemble}")
        _check(
            all(0.0 <= b < 1.0 for b in self.adam_betas),
            "train.adam_betas",
            f"must be two numbers in [0, 1), got {list(self.adam_betas)}",
        )

    @property
    def passes(self) -> int:
        """Forward passes per batch: two with R-Drop, else one."""
        return 2 if self.r_drop > 0 else 1


# How `tmt export` can store a CTranslate2 model's weights (CTranslate2's own names).
QUANTIZATIONS = ("float32", "int8", "int8_float32", "int16", "float16", "bfloat16")


@dataclass
class DecodeConfig:
    """Search settings for translate/evaluate (section `decode`)."""

    beam: int = 4
    alpha: float = 0.6  # GNMT length penalty ((5 + len) / 6) ** alpha; 0 = raw log-probability
    max_len_a: float = 1.5  # output at most a * |src| + b tokens
    max_len_b: int = 10
    # Per decoding batch: n_sentences x beam x (longest source + 1), the source positions the beam's
    # hypotheses attend to; inference.py cuts every batch of both engines by it (scoring: beam 1).
    # (Called decode.max_tokens before; that name still loads.)
    max_src_tokens: int = 8192

    def __post_init__(self) -> None:
        _check(self.beam >= 1, "decode.beam", f"must be >= 1, got {self.beam}")
        _check(self.alpha >= 0, "decode.alpha", f"must be >= 0, got {self.alpha}")
        _check(
            self.max_len_a >= 0 and self.max_len_b >= 1,
            "decode.max_len_b",
            "need max_len_a >= 0 and max_len_b >= 1",
        )
        _check(
            self.max_src_tokens >= 1,
            "decode.max_src_tokens",
            f"must be >= 1, got {self.max_src_tokens}",
        )


@dataclass
class Config:
    """The whole experiment: one YAML file."""

    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    output_dir: str = "runs/default"

    def __post_init__(self) -> None:
        # A training target of max_len tokens takes max_len + 1 positions (with BOS, or EOS).
        if self.data.max_len is None:
            self.data.max_len = min(256, self.model.max_positions - 1)
        # large character sets: SentencePiece's advice
        if self.tokenizer.character_coverage is None:
            cjk = {self.data.src_lang, self.data.tgt_lang} & {"zh", "ja", "ko"}
            self.tokenizer.character_coverage = 0.9995 if cjk else 1.0
        _check(
            self.data.max_len + 1 <= self.model.max_positions,
            "data.max_len",
            f"({self.data.max_len}) + 1 must be <= model.max_positions "
            f"({self.model.max_positions}): lower data.max_len or raise model.max_positions",
        )
        _check(
            not self.data.subword_sampling.nbest or self.tokenizer.type == "unigram",
            "data.subword_sampling.nbest",
            f"needs tokenizer.type unigram (a {self.tokenizer.type} model has no n-best "
            "segmentations to sample from)",
        )
        tc = self.train
        bidirectional = "bidirectional_share" if tc.bidirectional_share else "bidirectional_epochs"
        _check(
            not getattr(tc, bidirectional) or self.tokenizer.joint,
            f"train.{bidirectional}",
            "needs tokenizer.joint: true (training on reversed pairs needs one vocabulary for both "
            "languages)",
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["train"]["adam_betas"] = list(self.train.adam_betas)
        return d


# Keys that were renamed: old run directories' config.yaml files still load.
RENAMED = {"decode.max_tokens": "max_src_tokens"}


def _check(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"config error: {key} {message}")


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML file, apply `a.b=c` overrides, and build a checked Config."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config error: {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config error: {path}: cannot read ({e})") from None
    try:
        raw = yaml.safe_load(text)
        lines = _key_lines(yaml.compose(text))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"config error: {where}: invalid YAML: {problem}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"config error: {path}: the top level must be a mapping of sections")
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw, source=str(path), lines=lines)


def apply_override(raw: dict, item: str) -> None:
    """Set `a.b=c` in a nested dict; the value is parsed as YAML (so 128 is an int)."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(
            f"config error: --set {item!r}: expected KEY=VALUE, e.g. train.max_steps=200"
        )
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: --set {key}: {part} is not a section")
        node = child
    try:
        node[parts[-1]] = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        node[parts[-1]] = value


def config_from_dict(
    raw: dict, source: str = "<dict>", lines: dict[str, int] | None = None
) -> Config:
    """Build a Config from plain data, checking keys and types section by section."""
    lines = lines or {}
    return _build(Config, raw, prefix="", source=source, lines=lines)


def _build(cls: type, raw: Any, prefix: str, source: str, lines: dict[str, int]) -> Any:
    where = _where(source, lines, prefix)
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config error: {where}{prefix.rstrip('.') or 'config'} must be a mapping, got "
            f"{type(raw).__name__}"
        )
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if dotted in RENAMED:
            key = RENAMED[dotted]
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (valid keys: {', '.join(names)})"
            section = prefix.rstrip(".") or "the config"
            raise ConfigError(
                f"config error: {_where(source, lines, dotted)}{dotted} is not a key of "
                f"{section}{hint}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(
                tp, value if value is not None else {}, f"{dotted}.", source, lines
            )
        else:
            kwargs[key] = _coerce(value, tp, dotted, _where(source, lines, dotted))
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # Point range errors at the line of the key they name, when we know it.
        msg = str(e)
        key = msg.removeprefix("config error: ").split(" ", 1)[0]
        loc = _where(source, lines, key)
        raise ConfigError(msg.replace("config error: ", f"config error: {loc}", 1)) from None


def _where(source: str, lines: dict[str, int], dotted: str) -> str:
    line = lines.get(dotted)
    return f"{source}:{line}: " if line else ""


def _coerce(value: Any, tp: Any, key: str, where: str) -> Any:
    """Check `value` against a type hint; ints are accepted for floats, lists for tuples."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], key, where)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(
                f"config error: {where}{key} must be one of {', '.join(map(str, args))}, got "
                f"{value!r}{hint}"
            )
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(
                f"config error: {where}{key} must be a list of {len(args)} numbers, got {value!r}"
            )
        return tuple(_coerce(v, a, key, where) for v, a in zip(value, args))
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 1e-9 (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }[tp](value)
    if not ok:
        raise ConfigError(
            f"config error: {where}{key} must be {_type_name(tp)}, got {value!r} "
            f"({type(value).__name__})"
        )
    return float(value) if tp is float else value


def _type_name(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]


def _key_lines(node: Any, prefix: str = "") -> dict[str, int]:
    """Map each dotted key of a composed YAML document to its 1-based line number."""
    out: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            dotted = f"{prefix}{k.value}"
            out[dotted] = k.start_mark.line + 1
            out.update(_key_lines(v, dotted + "."))
    return out


def save_config(cfg: Config, path: str | os.PathLike, header: str = "") -> None:
    """Write the resolved config as YAML (atomically), so a run directory describes itself;
    `header`'s lines go first, as YAML comments."""
    comments = "".join(f"# {line}\n" for line in header.splitlines())
    text = comments + yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    atomic_write(path, text.encode("utf-8"))
