"""Our PyTorch engine: a trained model (or an `Ensemble`) and search.py behind the
`decoding.Engine` interface, in the run's precision. `load_torch_engine` sets one or several
checkpoints up for inference; inference.py (`transformer_mt.load`) is what users call."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .checkpoint import CheckpointError, load_for_inference, resolve_checkpoints, run_dir_of
from .config import Config, ConfigError
from .data import pad_sources
from .decoding import DecodeOptions, Engine
from .model import Ensemble, Transformer
from .runtime import cpu_bf16_obstacle, cpu_has_native_bf16, inference_model, pick_device
from .search import Hypothesis, StopCheck, forced_logprobs, search
from .tokenizer import Tokenizer
from .vocab import BOS, EOS, PAD

log = logging.getLogger("transformer_mt")


class TorchEngine(Engine):
    """Decodes and scores with our model: n-best, sampling, forced scoring, cross-attention."""

    name = "torch"

    def __init__(
        self,
        model: Transformer | Ensemble,
        tokenizer: Tokenizer,
        device: torch.device | None = None,
        precision: str = "fp32",
    ):
        """precision: the run's train.precision; bf16 and fp16 runs decode with a copy of the model
        in that dtype, int8 with its linear layers quantized (runtime.inference_model); the caller's
        model is left as it is."""
        self.tokenizer = tokenizer
        self.device = device or next(model.parameters()).device
        self.parameters = sum(p.numel() for p in model.parameters())  # tied matrices once
        self.model, self.precision = inference_model(model, precision, self.device)
        self.max_positions = model.cfg.max_positions

    def search(
        self,
        ids: list[list[int]],
        options: DecodeOptions,
        *,
        generator: torch.Generator | None = None,
        should_stop: StopCheck = None,
        token_scores: bool = True,
        prefix: list[list[int]] | None = None,
    ) -> list[list[Hypothesis]]:
        return search(
            self.model,
            pad_sources(ids).to(self.device),  # (B, S): ids, EOS, padding
            beam=options.beam,
            alpha=options.alpha,
            max_len_a=options.max_len_a,
            max_len_b=options.max_len_b,
            nbest=options.nbest,
            sampling=options.sampling,
            generator=generator,
            should_stop=should_stop,
            prefix=prefix,
        )

    def score(self, src_ids: list[list[int]], tgt_ids: list[list[int]]) -> list[list[float]]:
        src = pad_sources(src_ids).to(self.device)  # (B, S)
        tgt_in, tgt_out = _shifted_targets(tgt_ids)  # (B, T) each: BOS y... / y... EOS
        logps = forced_logprobs(self.model, src, tgt_in.to(self.device), tgt_out.to(self.device))
        return [row[: len(t) + 1] for row, t in zip(logps.tolist(), tgt_ids)]

    def cross_attention(self, src_ids: list[int], tgt_ids: list[int]) -> torch.Tensor:
        src = torch.tensor([list(src_ids) + [EOS]], device=self.device)  # (1, S)
        tgt_in = torch.tensor([[BOS] + list(tgt_ids)], device=self.device)  # (1, T)
        return self.model.cross_attention(src, tgt_in)[:, 0].float().cpu()  # (L, H, T, S)


def _shifted_targets(tgt_ids: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder inputs (BOS y1 ... yn) and outputs (y1 ... yn EOS), PAD-padded: (B, T) each."""
    T = max(len(t) for t in tgt_ids) + 1
    tgt_in = np.full((len(tgt_ids), T), PAD, dtype=np.int64)
    tgt_out = np.full((len(tgt_ids), T), PAD, dtype=np.int64)
    for b, t in enumerate(tgt_ids):
        tgt_in[b, 0], tgt_in[b, 1 : len(t) + 1] = BOS, t
        tgt_out[b, : len(t)], tgt_out[b, len(t)] = t, EOS
    return torch.from_numpy(tgt_in), torch.from_numpy(tgt_out)


def load_torch_engine(
    checkpoint: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    device: str = "auto",
    precision: str | None = None,
) -> TorchEngine:
    """Our engine for a checkpoint file or run directory (None: the newest run under ./runs/);
    several checkpoints decode as an ensemble (they must share one SentencePiece model). precision
    defaults to the one the run trained and validated in (trained_precision; int8: the linear
    layers quantized, on the CPU)."""
    if precision == "int8" and pick_device(device).type != "cpu":
        raise ConfigError(
            "--precision int8 (dynamic int8 quantization of the linear layers) runs on the CPU "
            "only: add --device cpu, or use bf16/fp16 on the GPU"
        )
    paths = [
        found
        for c in (
            [checkpoint]
            if checkpoint is None or isinstance(checkpoint, (str, os.PathLike))
            else checkpoint
        )
        for found in resolve_checkpoints(c)  # an ensemble run's directory: all its members
    ]
    target = pick_device(device)
    loaded = [load_for_inference(p, target) for p in paths]
    model, tokenizer, cfg, ckpt = loaded[0]
    for path, (_, other, _, _) in zip(paths[1:], loaded[1:]):
        if other.digest != tokenizer.digest:
            raise CheckpointError(
                f"cannot ensemble {paths[0]} and {path}: their SentencePiece models differ "
                f"({tokenizer.digest} and {other.digest}); ensembles need one vocabulary"
            )
    if len(loaded) > 1:
        model = Ensemble([m for m, _, _, _ in loaded])
    if precision is None:
        precision = trained_precision(ckpt, paths[0], cfg)
        if precision == "bf16" and target.type == "cpu" and not cpu_has_native_bf16():
            log.info(
                "the run trained in bf16, but bf16 is emulated on this CPU (%s): decoding in fp32 "
                "(--precision bf16 insists)",
                cpu_bf16_obstacle(),
            )
            precision = "fp32"
    engine = TorchEngine(model, tokenizer, device=target, precision=precision)
    engine.checkpoint, engine.config, engine.step = paths[0], cfg, ckpt.get("step")
    engine.members = tuple(paths) if len(paths) > 1 else ()
    return engine


def trained_precision(ckpt: dict[str, Any], path: Path, cfg: Config) -> str:
    """The precision the run trained and validated in, which decoding follows by default (a
    bf16-output run decodes in fp32, as its validation did: runtime.inference_model). The
    checkpoint's train_state records it (precision auto's choice, e.g. bf16 or bf16-output on a
    CPU); a weights-only checkpoint (an average: best.pt after train.average_last, averaged.pt) has
    none, so the same run's checkpoints/last.pt is asked; without either, the saved train.precision
    stands (auto: resolved for the decoding device)."""
    recorded = (ckpt.get("train_state") or {}).get("precision")
    last = run_dir_of(path) / "checkpoints" / "last.pt"
    if not recorded and last.is_file() and last.resolve() != path.resolve():
        try:  # mmap: the tensors (weights, optimizer state) are not read, only the small dicts
            other = torch.load(last, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001  an unreadable last.pt only loses the hint
            other = {}
        # the same run's
        if isinstance(other, dict) and other.get("tokenizer") == ckpt.get("tokenizer"):
            recorded = (other.get("train_state") or {}).get("precision")
    return recorded or cfg.train.precision
