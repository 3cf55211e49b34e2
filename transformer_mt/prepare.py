"""Setting a training run up: the process (threads, process group, seeds, device), the run
directory with its config, tokenizer and tokenized data, the precision to train in, the module the
loop calls (DDP, torch.compile) and the event log. train.py runs the loop on what this builds."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .checkpoint import Parent
from .config import Config, TrainConfig, save_config
from .data import TrainingData, prepare_data, prepare_tokenizer
from .distributed import (
    Dist,
    agree_min,
    init_distributed,
    rank_device,
    rank_zero_first,
    seed_everything,
)
from .errors import UserError
from .fileio import atomic_write
from .model import Transformer, label_smoothed_loss
from .runtime import (
    BF16_OUTPUT,
    attention_kernel,
    autocast,
    choose_cpu_attention,
    choose_cpu_precision,
    keep_freed_memory,
    keep_onednn_kernels,
    measured_choice,
    pick_device,
    set_threads,
    training_precision,
)
from .segmentations import sampled_segmentations
from .tokenizer import Tokenizer
from .vocab import UNK

log = logging.getLogger("transformer_mt")


def prepare_run(
    cfg: Config, run_dir: Path, d: Dist, parent: Parent | None = None
) -> tuple[Tokenizer, TrainingData]:
    """The run directory with its config, the tokenizer and the tokenized data (with the n best
    segmentations of each training pair under subword sampling). Rank 0 trains the tokenizer and
    fills the cache; the other ranks then read them. A fine-tuning run (`parent`) takes its
    parent's SentencePiece model(s) and tokenizer section as they are."""
    if parent is not None:
        adopt_tokenizer_config(cfg, parent)
    with rank_zero_first(d):
        if d.main:
            run_dir.mkdir(parents=True, exist_ok=True)
            if parent is not None:
                write_parent(run_dir, parent)
            save_config(cfg, run_dir / "config.yaml", parent_header(run_dir))
        tokenizer = prepare_tokenizer(cfg, run_dir)
        data = prepare_data(cfg, tokenizer)
    if parent is not None and d.main:
        log_unknown_share(data)
    # every rank draws the same segmentations: no need to wait for rank 0
    data.segmentations = sampled_segmentations(cfg, tokenizer)
    return tokenizer, data


def adopt_tokenizer_config(cfg: Config, parent: Parent) -> None:
    """The tokenizer section becomes the parent's: its vocabulary is used, none is trained (and
    subword sampling needs it to be a unigram model)."""
    if cfg.tokenizer != parent.config.tokenizer:
        log.info(
            "--init-from: the tokenizer section is the parent's (no new vocabulary is trained)"
        )
    cfg.tokenizer = dataclasses.replace(parent.config.tokenizer)
    if cfg.data.subword_sampling.nbest and cfg.tokenizer.type != "unigram":
        raise UserError(
            f"--init-from: the parent's tokenizer is {cfg.tokenizer.type}, and "
            "data.subword_sampling needs a unigram one: set data.subword_sampling.nbest: 0"
        )


def write_parent(run_dir: Path, parent: Parent) -> None:
    """The parent's SentencePiece model(s), byte for byte, and parent.json (its path, step and
    tokenizer digest). A run directory that already holds another vocabulary is refused."""
    if Tokenizer.exists(run_dir):
        mine = Tokenizer.load(run_dir).digest
        if mine != parent.tokenizer.digest:
            raise UserError(
                f"--init-from: {run_dir} already holds a SentencePiece model ({mine}) that is not "
                f"the parent's ({parent.tokenizer.digest}): set another output_dir"
            )
    else:
        parent.tokenizer.save(run_dir)
    text = json.dumps(parent.record(), indent=2) + "\n"
    atomic_write(run_dir / "parent.json", text.encode("utf-8"))


def parent_header(run_dir: Path) -> str:
    """config.yaml's first line in a fine-tuned run (resumed ones too): where it started from."""
    path = run_dir / "parent.json"
    if not path.exists():
        return ""
    record = json.loads(path.read_text(encoding="utf-8"))
    return f"fine-tuned from {record['path']} (step {record['step']}): parent.json"


def log_unknown_share(data: TrainingData) -> None:
    """How much of the new training corpus the parent's vocabulary spells as <unk>."""
    shares = []
    for ids in (data.train.src_ids, data.train.tgt_ids):
        shares.append(float(np.count_nonzero(np.asarray(ids) == UNK)) / max(len(ids), 1))
    level = logging.WARNING if max(shares) > 0.01 else logging.INFO
    log.log(
        level,
        "--init-from: <unk> pieces in the training corpus under the parent's vocabulary: "
        "%.2f%% of source, %.2f%% of target tokens",
        100 * shares[0],
        100 * shares[1],
    )


def build_model(cfg: Config, tokenizer: Tokenizer, parent: Parent | None) -> Transformer:
    """The model to train: fresh, or with the parent's weights (a fine-tuning run)."""
    model = Transformer(cfg.model, *tokenizer.sizes())
    if parent is not None:
        model.load_state_dict(parent.weights)
        log.info("--init-from: weights of %s (step %d)", parent.path, parent.step)
    return model


def chunked_loss(tc: TrainConfig, device: torch.device) -> bool:
    """Whether training computes its loss with model.chunked_output_loss (the model's forward with
    tgt_out): on a CPU, where the (tokens, V) logits cost more to pass through memory than to
    compute; not with R-Drop, whose consistency term needs both passes' logits, nor under
    torch.compile, nor in fp16, whose loss scaling must reach the logits' gradient before it is
    rounded. A GPU keeps F.cross_entropy on the whole logits."""
    return device.type == "cpu" and tc.passes == 1 and not tc.compile and tc.precision != "fp16"


def training_loss(
    forward: Callable[..., torch.Tensor],
    src: torch.Tensor,
    tgt_in: torch.Tensor,
    tgt_out: torch.Tensor,
    smoothing: float,
    chunked: bool,
) -> torch.Tensor:
    """The summed label-smoothed loss of one teacher-forced pass of `forward` (the model, or DDP
    around it): computed inside the forward, in chunks, when `chunked` (chunked_loss), else on the
    whole logits."""
    if chunked:
        return forward(src, tgt_in, tgt_out, smoothing)
    return label_smoothed_loss(forward(src, tgt_in), tgt_out, smoothing)


def training_forward(
    model: Transformer, tc: TrainConfig, d: Dist, device: torch.device
) -> torch.nn.Module:
    """The module the loop calls: DDP and/or torch.compile around the model. Checkpoints take the
    state dict of the plain model, so they load without either."""
    forward: torch.nn.Module = model
    if d.world > 1:
        forward = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if tc.compile:
        forward = torch.compile(forward, dynamic=True)
    return forward


def init_runtime(tc: TrainConfig) -> tuple[Dist, torch.device]:
    """Threads, the process group, seeds (seed + rank: each rank its own dropout masks); this
    process's device."""
    if tc.threads:
        set_threads(tc.threads)
    d = init_distributed(tc.device)
    seed_everything(tc.seed, d.rank)
    device = rank_device(d, pick_device(tc.device))
    if device.type == "cpu":
        if keep_freed_memory():
            log.debug("malloc keeps freed memory: no page faults for each step's large tensors")
        keep_onednn_kernels()  # before the precision probe's first bf16 step
    return d, device


def probe_batch_shape(tc: TrainConfig) -> tuple[int, int]:
    """(sentences, tokens each) of the start-up probes' synthetic batch: train.max_tokens (twice
    that with R-Drop's two passes; at most 4,096) in sentences of 24 tokens, Multi30k's length."""
    T = 24
    return max(1, min(tc.max_tokens * tc.passes, 4096) // T), T


def cpu_probe_step(
    model: Transformer,
    tc: TrainConfig,
    device: torch.device,
    kernel_for: Callable[[str], str] = lambda precision: "fused",
) -> Callable[[str], None]:
    """A training step of `model` in a given precision on a synthetic batch of train.max_tokens
    (twice that with R-Drop's two passes; at most 4,096), for runtime.choose_cpu_precision: how much
    the output layer weighs depends on the batch size. Attention runs the kernel a run in that
    precision would train with (`kernel_for`, attention_chooser). Every call takes batch shapes no
    call took before (sources of 24 tokens, then 25, ...; targets 3 longer, as a pair's two sides
    differ), as training's batches rarely repeat one: oneDNN builds bf16 kernels for each new
    shape, and on a Xeon with AMX bf16 (math attention) ran faster than fp32 on one repeated shape
    but slower on fresh ones, as in training (docs/multi30k.md). It changes no weight, and leaves
    no gradient and the output layer in fp32."""
    B, T = probe_batch_shape(tc)
    tokens, lengths = B * T, itertools.count(T)
    chunked = chunked_loss(tc, device)

    def step(precision: str) -> None:
        t = next(lengths)
        b = max(1, tokens // t)
        # Ids within each side's own vocabulary (a separate target vocabulary may be smaller than
        # the source's), above the special ids. (b, t) and (b, t + 3)
        ids = torch.arange(b * (t + 3), device=device)
        src = (ids[: b * t] % (model.src_embed.lut.num_embeddings - 4) + 4).view(b, t)
        tgt = (ids % (model.generator.out_features - 4) + 4).view(b, t + 3)
        model.output_dtype = torch.bfloat16 if precision == BF16_OUTPUT else None
        with autocast(precision, device), attention_kernel(kernel_for(precision)):
            loss = training_loss(model, src, tgt, tgt, tc.label_smoothing, chunked)
        loss.backward()
        model.zero_grad(set_to_none=True)
        model.output_dtype = None

    return step


def set_up_precision(
    model: Transformer,
    tc: TrainConfig,
    d: Dist,
    device: torch.device,
    resumed: dict[str, Any] | None,
    kernel_for: Callable[[str], str] = lambda precision: "fused",
    timings: dict[str, float] | None = None,
) -> str:
    """The precision to train in (runtime.training_precision: auto on a CPU times this model's
    step, each precision with its attention kernel `kernel_for(precision)`, all ranks taking the
    most exact choice, and puts this process's ms a step in `timings`; a resumed run keeps its
    own); bf16-output puts the model's output projection in bf16."""
    precision = training_precision(
        tc.precision,
        device,
        resumed["train_state"].get("precision", "") if resumed is not None else "",
        lambda: choose_cpu_precision(
            cpu_probe_step(model, tc, device, kernel_for),
            lambda mine: agree_min(d, device, mine),
            timings,
        ),
    )
    model.output_dtype = torch.bfloat16 if precision == BF16_OUTPUT else None
    return precision


def cpu_attention_probe(
    model: Transformer, tc: TrainConfig, device: torch.device, precision: str
) -> Callable[[str], None]:
    """Attention's forward and backward with a given kernel at the run's shapes, for
    runtime.choose_cpu_attention: an encoder's padding-masked self-attention and a decoder's causal
    one on the probe's batch (probe_batch_shape), in the run's precision. No weight is involved."""
    B, T = probe_batch_shape(tc)
    heads = model.cfg.heads
    # q, k, v and the output's gradient, (B, H, T, d_k) each: a dense gradient, as in training (the
    # ones of a sum() would be one value broadcast, which the math kernel's backward handles slowly)
    # drawn from a generator of its own, so that the probe leaves the run's random stream as it was
    g = torch.Generator(device).manual_seed(0)
    shape = (4, B, heads, T, model.cfg.d_model // heads)
    q, k, v, grad = torch.randn(shape, generator=g, device=device).unbind(0)
    lengths = torch.arange(B, device=device) % T + 1  # (B,): every length from 1 to T
    pad = (torch.arange(T, device=device) < lengths[:, None])[:, None, None, :]  # (B, 1, 1, T)

    def step(kernel: str) -> None:
        q_, k_, v_ = (x.detach().requires_grad_() for x in (q, k, v))
        with autocast(precision, device), attention_kernel(kernel):
            out = F.scaled_dot_product_attention(q_, k_, v_, attn_mask=pad)
            out = out + F.scaled_dot_product_attention(q_, k_, v_, is_causal=True)
        out.backward(grad.to(out.dtype))

    return step


def set_up_attention(
    model: Transformer,
    tc: TrainConfig,
    device: torch.device,
    precision: str,
    resumed: dict[str, Any] | None = None,
) -> str:
    """The attention kernel to train with (runtime.measured_choice): train.attention, for auto on
    a CPU the faster one measured here (runtime.choose_cpu_attention), on a GPU torch's fused
    kernels; a resumed auto run keeps the kernel it began with."""
    return measured_choice(
        "attention",
        tc.attention,
        device,
        resumed["train_state"].get("attention", "") if resumed is not None else "",
        lambda: choose_cpu_attention(
            cpu_attention_probe(model, tc, device, precision), precision=precision
        ),
        "fused",
    )


def attention_chooser(
    model: Transformer,
    tc: TrainConfig,
    device: torch.device,
    resumed: dict[str, Any] | None = None,
) -> Callable[[str], str]:
    """precision -> the attention kernel a run in that precision trains with (set_up_attention),
    measured at most once for each: precision auto times every precision with its own kernel. On
    a Xeon with AMX, torch's flash kernel took ~4x the math kernel's time in bf16 (its backward ~11x
    its own in fp32), which alone made bf16 the slowest precision (docs/multi30k.md)."""
    return functools.cache(
        lambda precision: set_up_attention(model, tc, device, precision, resumed)
    )


def describe_run(
    tc: TrainConfig,
    d: Dist,
    device: torch.device,
    precision: str,
    model: Transformer,
    data: TrainingData,
    batches_per_epoch: int,
) -> None:
    """One log line on what is about to be trained, and how."""
    log.info(
        "device %s, precision %s, %.2fM parameters, %d training pairs, %d batches/epoch of <= %d "
        "tokens; effective batch <= %d tokens (max_tokens %d x accumulate %d x %d process%s)",
        device,
        precision,
        model.num_parameters() / 1e6,
        len(data.train_idx),
        batches_per_epoch,
        tc.max_tokens,
        tc.max_tokens * tc.accumulate * d.world,
        tc.max_tokens,
        tc.accumulate,
        d.world,
        "es" if d.world > 1 else "",
    )
    if tc.bidirectional_epochs:
        log.info(
            "bidirectional training: the first %d epoch%s also train every pair reversed (target "
            "to source): about twice the batches of a later epoch",
            tc.bidirectional_epochs,
            "s" if tc.bidirectional_epochs > 1 else "",
        )
    if tc.bidirectional_share:
        log.info(
            "bidirectional training: epochs also train every pair reversed (target to source) "
            "until %g%% of the %s is spent",
            100 * tc.bidirectional_share,
            f"{tc.max_minutes:g} minutes" if tc.max_minutes else f"{tc.max_steps} updates",
        )


def open_event_log(run_dir: Path, d: Dist) -> Any:
    """TensorBoard's SummaryWriter into run_dir/tb on rank 0; a stand-in that writes nothing on
    the other ranks."""
    if not d.main:
        return NullWriter()
    from torch.utils.tensorboard import SummaryWriter  # imported late: slow, only training needs it

    return SummaryWriter(str(run_dir / "tb"))


class NullWriter:
    """Stands in for the SummaryWriter on ranks other than 0."""

    def add_scalar(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, done: int, main: bool) -> tqdm:
    """The training loop's bar, in updates: on rank 0, unless `tmt -q` quieted the logger."""
    return tqdm(
        total=total,
        initial=done,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        disable=not main or log.level > logging.INFO,
    )
