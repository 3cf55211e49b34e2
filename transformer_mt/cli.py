"""`tmt`: argparse front end. Parsing and printing only; each subcommand is one function call.

Exit status: 0 success, 2 user error (message, no traceback), 1 anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any, Iterator, NoReturn, Optional, TextIO

from tqdm.contrib.logging import logging_redirect_tqdm

from .errors import UserError


class _Formatter(logging.Formatter):
    """`tmt: message`, with the level named for warnings and errors."""

    def format(self, record: logging.LogRecord) -> str:
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        return f"tmt: {level}{record.getMessage()}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tmt",
        description="Train, run and score Transformer translation models (Vaswani et al., 2017).",
        epilog="Run `tmt COMMAND --help` for the flags of each command.",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "train",
        help="tokenize, train, validate and checkpoint a model from a YAML config",
        description="Train SentencePiece (if the run has none) and the model described by CONFIG. "
        "Everything goes to the config's output_dir: config.yaml, spm*.model, "
        "checkpoints/{last,best,step_N}.pt and TensorBoard events under tb/.",
    )
    p.add_argument("config", help="YAML config file (see configs/ and docs/config.md)")
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CHECKPOINT",
        help="continue the run in output_dir from its checkpoints/last.pt (or from CHECKPOINT; an "
        "ensemble: each member from its own): "
        "weights, optimizer, schedule, position in the epoch and random state",
    )
    p.add_argument(
        "--init-from",
        metavar="RUN_OR_CHECKPOINT",
        help="fine-tune: start a NEW run in output_dir from the weights of another run (its "
        "best.pt, else last.pt) or checkpoint, with its SentencePiece model(s) as they are; the "
        "model section must match it, the optimizer and schedule start fresh from this config. "
        "Not with --resume",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.max_steps=200 --set model.d_model=128 "
        "(repeatable; VALUE is parsed as YAML)",
    )
    _add_inference_parsers(sub)
    return parser


def _add_inference_parsers(sub: argparse._SubParsersAction) -> None:
    """The commands that use a trained model."""
    _add_translate_parser(sub)
    _add_evaluate_parser(sub)
    _add_score_parser(sub)
    _add_serve_parser(sub)
    _add_export_parser(sub)
    _add_average_parser(sub)


def _add_evaluate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "evaluate",
        help="translate a test set and print sacreBLEU BLEU, chrF and TER",
        description="Translate the run's test split (from its saved config), or --src, and score "
        "it against the references with sacreBLEU; hypotheses are written next to the "
        "checkpoint.",
    )
    _add_model_flags(p)
    p.add_argument(
        "--src", metavar="FILE", help="source sentences (plain text or .gz); needs --ref"
    )
    p.add_argument(
        "--ref",
        metavar="FILE",
        action="append",
        help="reference translations, line-aligned with --src; repeat for several references",
    )
    p.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="where to write the hypotheses (default: next to the checkpoint)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (bleu, chrf, ter, signature, tokenized_bleu, comparison, "
        "hypotheses_path, ...) instead of text",
    )
    p.add_argument(
        "--compare",
        nargs="+",
        default=[],
        metavar="OTHER",
        help="compare with other systems: hypothesis files, or checkpoints/runs (translated the "
        "same way); prints each system's BLEU and chrF with its 95%% interval, the "
        "difference to this one and the p-value of sacreBLEU's paired bootstrap resampling "
        "(1,000 samples, seed 12345)",
    )
    p.add_argument(
        "--paired-ar",
        action="store_true",
        help="with --compare: paired approximate randomization (10,000 trials) instead of the "
        "bootstrap",
    )
    p.add_argument(
        "--confidence",
        action="store_true",
        help="a 95%% bootstrap interval (1,000 samples) for each of this system's scores",
    )
    p.add_argument(
        "--tokenize",
        choices=sorted(_bleu_tokenizers()),
        metavar="NAME",
        help="sacreBLEU's BLEU tokenizer (default: from the target language as sacreBLEU does: "
        "zh, ja-mecab, ko-mecab, else 13a)",
    )


def _add_score_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "score",
        help="score given translations by forced decoding (log-probabilities, perplexity)",
        description="Forced decoding of (source, target) pairs, like fairseq's --score-reference, "
        "sockeye-score and marian-scorer: each target's log-probability given its "
        "source, per token, and the corpus perplexity (on stderr). Streamed in chunks.",
    )
    # forced decoding: no search, so no --beam/--alpha/--max-len
    _add_model_flags(p, decoding=False)
    p.add_argument(
        "--src", metavar="FILE", required=True, help="source sentences (plain text or .gz)"
    )
    p.add_argument(
        "--ref",
        metavar="FILE",
        required=True,
        help="target sentences to score, line-aligned with --src",
    )
    p.add_argument(
        "--format",
        choices=["text", "jsonl"],
        default="text",
        help="text: one log-probability per line; jsonl: one JSON object per line with source, "
        "target, logprob, tokens and token_logprobs (default: text)",
    )
    p.add_argument(
        "--output", "-o", metavar="FILE", help="write the scores to FILE (default: stdout)"
    )


def _add_average_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "average",
        help="average the weights of a run's step checkpoints",
        description="Average the newest N (--last) or the N best-validating (--best) "
        "checkpoints/step_N.pt of a run into checkpoints/averaged.pt (or --output), "
        "which translate and evaluate accept like any checkpoint.",
    )
    p.add_argument("run_dir", help="run directory (the config's output_dir)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument(
        "--last", type=_positive_int, metavar="N", help="average the newest N step checkpoints"
    )
    group.add_argument(
        "--best",
        type=_positive_int,
        metavar="N",
        help="average the N step checkpoints with the best validation score",
    )
    p.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="where to write (default: RUN_DIR/checkpoints/averaged.pt)",
    )


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from .serve import Limits

    p = sub.add_parser(
        "serve",
        help="serve a model: a JSON API and a web page (the [serve] extra)",
        description="A translation server on Starlette/uvicorn: POST /translate, POST /score, GET "
        "/health, GET /info, and a page at /. Concurrent requests are batched "
        "together; the model runs in one worker thread. SIGTERM or Ctrl-C stops "
        "accepting, finishes the requests in flight, then exits.",
    )
    _add_model_flags(p)
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 for every "
        "interface)",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    _add_serve_limits(p, Limits())


def _add_serve_limits(p: argparse.ArgumentParser, d: Any) -> None:
    """What one request and one model call may cost (serve.Limits, whose defaults these are)."""
    p.add_argument(
        "--max-body",
        type=_positive_int,
        default=d.max_body,
        metavar="BYTES",
        help=f"largest request body; larger gets 413 (default: {d.max_body})",
    )
    p.add_argument(
        "--max-lines",
        type=_positive_int,
        default=d.max_lines,
        metavar="N",
        help=f"most lines in one request; more gets 413 (default: {d.max_lines})",
    )
    p.add_argument(
        "--max-queue",
        type=_positive_int,
        default=d.max_queue,
        metavar="N",
        help="most requests waiting or running; more get 503 with Retry-After (default: "
        f"{d.max_queue})",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=d.deadline,
        metavar="SECONDS",
        help="a request not answered within this gets 504, and its work is dropped (default: "
        f"{d.deadline:g})",
    )
    _add_serve_work_limits(p, d)


def _add_serve_work_limits(p: argparse.ArgumentParser, d: Any) -> None:
    """How the model's worker batches requests, and what one model call may cost."""
    p.add_argument(
        "--batch-wait",
        type=float,
        default=d.batch_wait,
        metavar="SECONDS",
        help="how long the model's worker waits for more requests to batch with (default: "
        f"{d.batch_wait:g})",
    )
    p.add_argument(
        "--max-work",
        type=_positive_int,
        default=d.max_work,
        metavar="STEPS",
        help="most decoding steps one request may cost (each line: beam x its output budget, "
        f"weighted by the positions attended); more gets 413 (default: {d.max_work})",
    )
    p.add_argument(
        "--batch-work",
        type=_positive_int,
        default=d.batch_work,
        metavar="STEPS",
        help="most decoding steps of one model call, and so of one line: long requests are served "
        "in chunks of this size between other requests, so a new short request waits for one "
        f"chunk at most (default: {d.batch_work})",
    )
    p.add_argument(
        "--batch-lines",
        type=_positive_int,
        default=d.batch_lines,
        metavar="N",
        help=f"most lines of one model call (default: {d.batch_lines})",
    )
    p.add_argument(
        "--threads",
        type=_positive_int,
        metavar="N",
        help="CPU threads of the model (default: one less than the cores, so that the HTTP side "
        "keeps one; OMP_NUM_THREADS, when set, decides instead)",
    )


def _add_export_parser(sub: argparse._SubParsersAction) -> None:
    from .config import QUANTIZATIONS

    p = sub.add_parser(
        "export",
        help="export a checkpoint for CTranslate2 (the [ct2] extra) or Hugging Face "
        "transformers (the [hf] extra)",
        description="Convert a checkpoint (or a run directory's best) into a CTranslate2 model "
        "directory: model.bin, vocabularies, the SentencePiece model(s), the run's "
        "config and a README. `tmt translate/evaluate/score/serve --engine "
        "ctranslate2 -c DIR` then decode with it. With --format transformers: a Marian "
        "model directory that transformers loads (MarianMTModel, pipeline('translation')).",
    )
    p.add_argument(
        "checkpoint_pos",
        nargs="?",
        metavar="RUN_OR_CHECKPOINT",
        help="checkpoint file or run directory (or give it with -c)",
    )
    p.add_argument(
        "--checkpoint",
        "-c",
        metavar="PATH",
        help="checkpoint file or run directory (default: the newest run under ./runs/)",
    )
    p.add_argument(
        "--format",
        choices=["ctranslate2", "transformers"],
        default="ctranslate2",
        help="what to export to: ctranslate2 (default), or transformers (a Marian model; "
        "post-norm models only)",
    )
    p.add_argument(
        "--output", "-o", metavar="DIR", required=True, help="directory to write (new, or empty)"
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default="float32",
        help="how the weights are stored: int8 is about 4x smaller and the fastest on CPUs; "
        "CTranslate2 can still load them in another compute type (default: float32)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier export in --output whole (its files do not survive)",
    )


def _add_model_flags(p: argparse.ArgumentParser, *, decoding: bool = True) -> None:
    """Which model, where and in what precision it runs; with `decoding`, also how it searches."""
    p.add_argument(
        "--checkpoint",
        "-c",
        metavar="PATH",
        action="append",
        help="checkpoint file, or run directory (uses its best, else last, checkpoint); default: "
        "the best checkpoint of the most recently trained run under ./runs/. Give it more "
        "than once to decode with an ensemble (the mean of the models' probabilities; one "
        "vocabulary)",
    )
    if decoding:
        _add_search_flags(p)
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda", "mps"],
        help="where to run the model (default: auto = CUDA, then MPS, then CPU)",
    )
    p.add_argument(
        "--precision",
        choices=["auto", "fp32", "bf16", "fp16", "int8"],
        help="dtype to decode in (default: the precision the run trained in, as its checkpoint "
        "records it: train.precision auto's choice; bf16-output runs decode in fp32; "
        "bf16/fp16 decode with the whole model in that dtype; fp16 only on CUDA, elsewhere "
        "it decodes in fp32; int8: dynamic int8 quantization of the linear layers, CPU "
        "only). With --engine ctranslate2 it is CTranslate2's compute type (default: as the "
        "export stores its weights)",
    )
    p.add_argument(
        "--engine",
        choices=["torch", "ctranslate2"],
        default="torch",
        help="torch: our PyTorch model (default); ctranslate2: CTranslate2 (the [ct2] extra), "
        "from a `tmt export` directory given to --checkpoint, or a checkpoint/run exported "
        "on the fly (once, into the run's ct2-cache/); no --alignment or attention plots",
    )


def _add_search_flags(p: argparse.ArgumentParser) -> None:
    """Beam size, length penalty and length budget: what translate, evaluate and serve search
    with."""
    p.add_argument(
        "--beam",
        type=_positive_int,
        metavar="N",
        help="beam size; 1 = greedy search (default: the run's decode.beam)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        metavar="A",
        help="GNMT length penalty exponent for beam search (default: the run's decode.alpha)",
    )
    p.add_argument(
        "--max-len",
        type=float,
        nargs=2,
        metavar=("A", "B"),
        help="output at most A x source length + B tokens (default: the run's decode.max_len_a "
        "and decode.max_len_b; fairseq-generate's default is 0 200)",
    )


def _add_translate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "translate",
        help="translate text with a trained model (stdin to stdout by default)",
        description="Translate one sentence per line. Output lines match input lines one to one "
        "(an empty input line gives an empty output line; lines end at \\n only). "
        "Input is read and written in chunks, so any length streams in bounded "
        "memory; typed at a terminal, each line is translated as soon as Enter is "
        "pressed. Invalid UTF-8 is replaced by U+FFFD, with one warning that counts "
        "the lines.",
    )
    _add_model_flags(p)
    p.add_argument(
        "--input", "-i", metavar="FILE", help="read source sentences from FILE (default: stdin)"
    )
    p.add_argument(
        "--output", "-o", metavar="FILE", help="write translations to FILE (default: stdout)"
    )
    p.add_argument(
        "--nbest",
        type=_positive_int,
        default=1,
        metavar="N",
        help="the N best hypotheses of each input, best first (N <= beam; shown by --format "
        "jsonl/nbest)",
    )
    p.add_argument(
        "--format",
        choices=["text", "jsonl", "nbest"],
        default="text",
        help="text: the best translation, one line per input line; jsonl: one JSON object per "
        "input line {source, hypotheses: [{text, score, logprob, tokens, token_logprobs, "
        "alignment}]}; nbest: Moses n-best lines `i ||| text ||| logprob=L ||| score` "
        "(default: text)",
    )
    p.add_argument(
        "--alignment",
        action="store_true",
        help="word alignment (Pharaoh `src-tgt` pairs) from the cross-attention of the last "
        "decoder layer, its heads averaged: each target word goes to the source word it "
        "attends to most. text format: `translation ||| 0-0 1-2 ...`",
    )
    p.add_argument(
        "--plot-attention",
        metavar="DIR",
        help="write DIR/N.png for input line N: source words x target words of the alignment's "
        "attention, with a colour bar (needs the [plot] extra: pip install "
        "'transformer-mt[plot]')",
    )
    p.add_argument(
        "--plot-all-heads",
        action="store_true",
        help="with --plot-attention: a grid of every decoder layer and head, over pieces",
    )
    _add_prefix_and_sampling_flags(p)


def _add_prefix_and_sampling_flags(p: argparse.ArgumentParser) -> None:
    """Where the search starts (a prefix) and whether it samples instead."""
    p.add_argument(
        "--prefix-file",
        metavar="FILE",
        help="one target prefix per input line (an empty line: none): each translation starts "
        "with its prefix as typed, the rest is the model's search from there",
    )
    p.add_argument(
        "--sampling",
        type=_sampling,
        metavar="topk:K|topp:P",
        help="sample each token instead of searching: from the K most likely (topk:0 = all), or "
        "from the smallest set holding probability P (topp:0.9); for back-translation",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        metavar="T",
        help="with --sampling: divide the logits by T (below 1 sharper; 0 = greedy) (default: 1)",
    )
    p.add_argument(
        "--seed", type=int, metavar="S", help="with --sampling: the same seed gives the same output"
    )


def _bleu_tokenizers() -> list[str]:
    from sacrebleu.metrics import BLEU

    return list(BLEU.TOKENIZERS)


def _sampling(text: str) -> Any:
    from .search import Sampling

    kind, _, value = text.partition(":")
    try:
        if kind == "topk" and int(value) >= 0:
            return Sampling(topk=int(value))
        if kind == "topp" and 0 < float(value) <= 1:
            return Sampling(topp=float(value))
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"expected topk:K (K >= 0) or topp:P (0 < P <= 1), got {text!r}"
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def cmd_train(args: argparse.Namespace) -> int:
    from .config import load_config
    from .errors import TrainingInterrupted
    from .train import train

    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.train.ensemble > 1:
            summary = _train_ensemble(cfg, args)
        else:
            summary = train(cfg, resume=args.resume, init_from=args.init_from)
    except TrainingInterrupted as e:
        print(f"tmt: {e}", file=sys.stderr)
        return e.exit_code
    if summary.get("rank", 0) != 0:
        return 0  # under torchrun, rank 0 speaks for the run
    if "members" in summary:
        valid = summary.get("valid_bleu")
        print(
            f"trained an ensemble of {len(summary['members'])}: "
            f"{', '.join(f'{s:,}' for s in summary['steps'])} steps in "
            f"{summary['minutes']:.1f} min"
            + ("" if valid is None else f"; ensemble validation BLEU {valid:.2f}")
            + f"; run directory {summary['run_dir']}",
            file=sys.stderr,
        )
        return 0
    averaged = " (the average of the last checkpoints)" if summary.get("best_averaged") else ""
    print(
        f"trained {summary['steps']} steps in {summary['minutes']:.1f} min; best validation "
        f"{summary['best_score']:.2f} at step {summary['best_step']}{averaged}; run directory "
        f"{summary['run_dir']}",
        file=sys.stderr,
    )
    return 0


def _train_ensemble(cfg: Any, args: argparse.Namespace) -> dict[str, Any]:
    """`tmt train` of a config with train.ensemble > 1 (members.py)."""
    from .config import ConfigError
    from .members import train_ensemble

    if args.init_from is not None:
        raise ConfigError(
            "--init-from fine-tunes one model: set train.ensemble: 1, or fine-tune each member"
        )
    if args.resume not in (None, True):
        raise ConfigError(
            f"--resume {args.resume}: an ensemble resumes each member from its own last.pt; "
            "give --resume without a checkpoint"
        )
    return train_ensemble(cfg, resume=args.resume is True)


def cmd_translate(args: argparse.Namespace) -> int:
    from .inference import load_translator

    # fails before loading if the extra is missing
    plot = _attention_plotter(args.plot_attention, args.plot_all_heads)
    translator = load_translator(
        args.checkpoint, device=args.device, precision=args.precision, engine=args.engine
    )
    if args.sampling is None and (args.temperature != 1.0 or args.seed is not None):
        raise UserError("--temperature and --seed go with --sampling topk:K or topp:P")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature:g}")
    sampling = args.sampling and dataclasses.replace(
        args.sampling, temperature=args.temperature, seed=args.seed
    )
    # the options are checked before --output is opened (and truncated) or a line is typed
    translator.defaults.replace(
        beam=args.beam, nbest=args.nbest, alpha=args.alpha, max_len=args.max_len, sampling=sampling
    )
    # the prefix file opens first: a missing one leaves --output untouched
    with _prefix_lines(args.prefix_file) as pre, _open_io(args.input, args.output) as (src, out):
        # a person typing: answer each line at once, not after 2,000 of them
        interactive = src.isatty()
        lines = _prompted(src) if interactive else src
        for i, (line, hyps) in enumerate(
            translator.translate_stream(
                lines,
                chunk=1 if interactive else 2000,
                prefix=pre,
                beam=args.beam,
                alpha=args.alpha,
                max_len=args.max_len,
                nbest=args.nbest,
                sampling=sampling,
                alignment=args.alignment,
                attention=plot is not None,
            )
        ):
            out.write(_format_translations(args.format, i, line, hyps, args.alignment))
            out.flush()
            if plot is not None:
                plot(hyps[0], i)
    return 0


def _format_translations(fmt: str, i: int, line: str, hyps: list, alignment: bool) -> str:
    """One input line's n-best list as text (the best), jsonl (one object) or Moses n-best (one line
    each)."""
    if fmt == "jsonl":
        return (
            json.dumps(
                {"source": line, "hypotheses": [h.to_json(alignment) for h in hyps]},
                ensure_ascii=False,
            )
            + "\n"
        )
    if fmt == "nbest":
        return "".join(
            f"{i} ||| {h.text} ||| logprob={h.logprob:.6f} ||| {h.score:.6f}\n" for h in hyps
        )
    return hyps[0].text + (f" ||| {hyps[0].pharaoh()}" if alignment else "") + "\n"


def _attention_plotter(folder: Optional[str], all_heads: bool) -> Any:
    """plot(translation, i) writing folder/i.png, or None without --plot-attention."""
    if folder is None:
        return None
    from .plot import plot_attention, require_matplotlib

    require_matplotlib()
    Path(folder).mkdir(parents=True, exist_ok=True)

    def plot(h: Any, i: int) -> None:
        if h.pieces and h.source_pieces:  # an empty line or translation has no attention to draw
            plot_attention(h, Path(folder) / f"{i}.png", all_heads=all_heads)

    return plot


@contextlib.contextmanager
def _prefix_lines(path: Optional[str]) -> Iterator[Any]:
    """--prefix-file's lines (read like --input: data.TextLines), or None without it."""
    from .data import TextLines

    if path is None:
        yield None
        return
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot open --prefix-file {e.filename}: {e.strerror}") from None
    with raw:
        lines = TextLines(raw, path)
        yield lines
        lines.warn()


@contextlib.contextmanager
def _open_io(input: Optional[str], output: Optional[str]) -> Iterator[tuple[Any, TextIO]]:
    """The input file (or stdin) and the output file (or stdout); closes only the files it opened.
    Both inputs are read alike (data.TextLines): lines end at \\n only, invalid UTF-8 is replaced
    and counted in one warning at the end."""
    from .data import TextLines

    with contextlib.ExitStack() as stack:
        try:
            src = (
                TextLines(stack.enter_context(open(input, "rb")), input)
                if input
                else _stdin_lines()
            )
            out = stack.enter_context(open(output, "w", encoding="utf-8")) if output else sys.stdout
        except OSError as e:
            raise UserError(f"cannot open {e.filename}: {e.strerror}") from None
        yield src, out
        if isinstance(src, TextLines):
            src.warn()


def _stdin_lines() -> Any:
    """stdin's bytes as data.TextLines; a text stream without bytes beneath (a caller's StringIO) as
    it is."""
    from .data import TextLines

    buffer = getattr(sys.stdin, "buffer", None)
    return TextLines(buffer, "<stdin>") if buffer is not None else sys.stdin


def cmd_serve(args: argparse.Namespace) -> int:
    from .inference import load_translator
    from .serve import Limits, model_threads, require_serve_extra, serve

    require_serve_extra()
    model_threads(args.threads)
    translator = load_translator(
        args.checkpoint,
        device=args.device,
        precision=args.precision,
        beam=args.beam,
        alpha=args.alpha,
        max_len=args.max_len,
        engine=args.engine,
    )
    limits = Limits(
        max_body=args.max_body,
        max_lines=args.max_lines,
        max_queue=args.max_queue,
        deadline=args.deadline,
        batch_wait=args.batch_wait,
        batch_lines=args.batch_lines,
        max_work=args.max_work,
        batch_work=args.batch_work,
    )
    serve(translator, host=args.host, port=args.port, limits=limits)
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from .data import pair_lines
    from .inference import load_translator

    translator = load_translator(
        args.checkpoint, device=args.device, precision=args.precision, engine=args.engine
    )
    logprob, tokens, n = 0.0, 0, 0
    with _open_io(None, args.output) as (_, out):
        for s in translator.score_stream(pair_lines(args.src, args.ref)):
            out.write(
                json.dumps(s.to_json(), ensure_ascii=False) + "\n"
                if args.format == "jsonl"
                else f"{s.logprob:.6f}\n"
            )
            logprob, tokens, n = logprob + s.logprob, tokens + len(s.token_logprobs), n + 1
    print(
        f"{n} pairs, {tokens} target tokens (EOS included), log-probability {logprob:.2f}, "
        f"perplexity {math.exp(-logprob / max(tokens, 1)):.4f}",
        file=sys.stderr,
    )
    return 0


def _prompted(src: TextIO) -> Iterator[str]:
    """Lines typed at a terminal, each after a prompt on stderr (so stdout holds translations
    only)."""
    print("tmt: type a sentence and press Enter to translate it; Ctrl-D ends", file=sys.stderr)
    while True:
        print("> ", end="", file=sys.stderr, flush=True)
        line = src.readline()
        if not line:
            print(file=sys.stderr)
            return
        yield line


def cmd_evaluate(args: argparse.Namespace) -> int:
    from .evaluate import evaluate

    result = evaluate(
        args.checkpoint,
        src=args.src,
        ref=args.ref,
        beam=args.beam,
        alpha=args.alpha,
        max_len=args.max_len,
        device=args.device,
        precision=args.precision,
        output=args.output,
        others=args.compare,
        paired_ar=args.paired_ar,
        confidence=args.confidence,
        tokenize=args.tokenize,
        engine=args.engine,
    )
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(result["bleu_detail"])
    print(f"chrF2 = {result['chrf']:.2f}  {result['chrf_signature']}")
    print(f"TER = {result['ter']:.2f}  {result['ter_signature']}")
    for name in ("bleu", "chrf", "ter"):
        if f"{name}_confidence" in result:
            c = result[f"{name}_confidence"]
            print(
                f"{name}: 95% bootstrap interval {c['mean']:.2f} ± {c['plus_minus']:.2f} "
                f"({c['bootstrap_samples']} samples)"
            )
    if "tokenized_bleu" in result:
        print(
            f"tokenized BLEU = {result['tokenized_bleu']:.2f}  "
            f"({result['tokenized_bleu_description']})"
        )
    if "comparison" in result:
        print(_comparison_table(result["comparison"]))
    print(
        f"{result['sentences']} sentences, beam {result['beam']}, {result['sentences_per_second']} "
        f"sent/s; hypotheses in {result['hypotheses_path']}",
        file=sys.stderr,
    )
    return 0


def _comparison_table(c: dict) -> str:
    lines = [
        f"Comparison: {c['method']}, {c['samples']} samples, seed {c['seed']}; p: the chance of a "
        "difference this large if the systems were equal"
    ]
    for metric, m in c["metrics"].items():
        lines.append(f"{metric}  ({m['signature']})")
        for i, row in enumerate(m["systems"]):
            ci = f"[{row['ci95'][0]:.2f}, {row['ci95'][1]:.2f}]" if row["ci95"] else ""
            test = "baseline" if i == 0 else f"Δ {row['delta']:+.2f}  p = {row['p_value']:.4f}"
            lines.append(f"  {row['score']:6.2f}  95% CI {ci:16}  {test:24}  {row['system']}")
    return "\n".join(lines)


def cmd_average(args: argparse.Namespace) -> int:
    from .checkpoint import average_run

    path, steps = average_run(
        args.run_dir, last=args.last or 0, best=args.best or 0, output=args.output
    )
    print(f"averaged steps {', '.join(map(str, steps))} into {path}", file=sys.stderr)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from .export import export_ctranslate2

    if args.checkpoint_pos and args.checkpoint:
        raise UserError("give the checkpoint once: as RUN_OR_CHECKPOINT or with -c, not both")
    if args.format == "transformers":
        return _export_transformers(args)
    out = export_ctranslate2(
        args.checkpoint_pos or args.checkpoint, args.output, args.quantization, force=args.force
    )
    print(
        f"exported to {out} ({args.quantization}); decode with: tmt translate --engine ctranslate2 "
        f"-c {out}",
        file=sys.stderr,
    )
    return 0


def _export_transformers(args: argparse.Namespace) -> int:
    from .export_hf import export_transformers

    if args.quantization != "float32":
        raise UserError("--quantization is for --format ctranslate2; transformers exports float32")
    out = export_transformers(args.checkpoint_pos or args.checkpoint, args.output, args.force)
    print(
        f"exported to {out}; load it with transformers' MarianMTModel and MarianTokenizer (or the "
        f"Auto classes): {out / 'README.md'} shows how",
        file=sys.stderr,
    )
    return 0


COMMANDS = {
    "train": cmd_train,
    "translate": cmd_translate,
    "evaluate": cmd_evaluate,
    "score": cmd_score,
    "serve": cmd_serve,
    "average": cmd_average,
    "export": cmd_export,
}


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logger = logging.getLogger("transformer_mt")
    logger.setLevel(logging.WARNING if args.quiet else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)  # this call's stderr (tests swap it between calls)
    handler.setFormatter(_Formatter())
    logger.addHandler(handler)
    try:
        # log lines do not break a running progress bar
        with logging_redirect_tqdm(loggers=[logger]):
            return COMMANDS[args.command](args)
    except UserError as e:
        print(f"tmt: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tmt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader went away (`tmt translate ... | head`): stop quietly
        # no second error when Python flushes
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        logger.removeHandler(handler)


def run() -> NoReturn:
    """The `tmt` command: main() and its exit status. A torchrun rank ends without Python's
    finalization (distributed.exit_process); a command that never imported torch stays clear of
    it (`tmt --help` is quick)."""
    code = main()
    distributed = sys.modules.get("transformer_mt.distributed")
    if distributed is not None:
        distributed.exit_process(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
