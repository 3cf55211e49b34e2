"""`tmt`: argparse front end. Parsing and printing only; each subcommand is one function call.

Exit status: 0 success, 2 user error (message, no traceback), 1 anything else.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from typing import Optional

from typing import Iterator, TextIO

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
        epilog="Run `tmt COMMAND --help` for the flags of each command.")
    parser.add_argument("-q", "--quiet", action="store_true", help="print warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="tokenize, train, validate and checkpoint a model from a YAML config",
                       description="Train SentencePiece (if the run has none) and the model described by CONFIG. "
                                   "Everything goes to the config's output_dir: config.yaml, spm*.model, "
                                   "checkpoints/{last,best,step_N}.pt and TensorBoard events under tb/.")
    p.add_argument("config", help="YAML config file (see configs/ and the README's config reference)")
    p.add_argument("--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
                   help="continue the run in output_dir from its checkpoints/last.pt (or from CHECKPOINT): "
                        "weights, optimizer, schedule, position in the epoch and random state")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.max_steps=200 --set model.d_model=128 "
                        "(repeatable; VALUE is parsed as YAML)")
    _add_inference_parsers(sub)
    return parser


def _add_inference_parsers(sub: argparse._SubParsersAction) -> None:
    """translate, evaluate and average: the commands that use a trained model."""

    def add_checkpoint(p: argparse.ArgumentParser) -> None:
        p.add_argument("--checkpoint", "-c", metavar="PATH",
                       help="checkpoint file, or run directory (uses its best, else last, checkpoint); "
                            "default: the best checkpoint of the most recently trained run under ./runs/")
        p.add_argument("--beam", type=_positive_int, metavar="N",
                       help="beam size; 1 = greedy search (default: the run's decode.beam)")
        p.add_argument("--alpha", type=float, metavar="A",
                       help="GNMT length penalty exponent for beam search (default: the run's decode.alpha)")
        p.add_argument("--max-len", type=float, nargs=2, metavar=("A", "B"),
                       help="output at most A x source length + B tokens (default: the run's decode.max_len_a "
                            "and decode.max_len_b; fairseq-generate's default is 0 200)")
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"],
                       help="where to run the model (default: auto = CUDA, then MPS, then CPU)")
        p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"],
                       help="dtype to decode in (default: the run's train.precision; bf16/fp16 decode with the "
                            "whole model in that dtype; fp16 only on CUDA, elsewhere it decodes in fp32)")

    p = sub.add_parser("translate", help="translate text with a trained model (stdin to stdout by default)",
                       description="Translate one sentence per line. Output lines match input lines one to one "
                                   "(an empty input line gives an empty output line; lines end at \\n only). "
                                   "Input is read and written in chunks, so any length streams in bounded memory; "
                                   "typed at a terminal, each line is translated as soon as Enter is pressed.")
    add_checkpoint(p)
    p.add_argument("--input", "-i", metavar="FILE", help="read source sentences from FILE (default: stdin)")
    p.add_argument("--output", "-o", metavar="FILE", help="write translations to FILE (default: stdout)")

    p = sub.add_parser("evaluate", help="translate a test set and print sacreBLEU BLEU, chrF and TER",
                       description="Translate the run's test split (from its saved config), or --src, and score "
                                   "it against the references with sacreBLEU; hypotheses are written next to "
                                   "the checkpoint.")
    add_checkpoint(p)
    p.add_argument("--src", metavar="FILE", help="source sentences (plain text or .gz); needs --ref")
    p.add_argument("--ref", metavar="FILE", help="reference translations, line-aligned with --src")
    p.add_argument("--output", "-o", metavar="FILE", help="where to write the hypotheses "
                                                          "(default: next to the checkpoint)")
    p.add_argument("--json", action="store_true", help="print one JSON object (bleu, chrf, ter, signature, "
                                                       "hypotheses_path, ...) instead of text")

    p = sub.add_parser("average", help="average the weights of a run's step checkpoints",
                       description="Average the newest N (--last) or the N best-validating (--best) "
                                   "checkpoints/step_N.pt of a run into checkpoints/averaged.pt (or --output), "
                                   "which translate and evaluate accept like any checkpoint.")
    p.add_argument("run_dir", help="run directory (the config's output_dir)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--last", type=_positive_int, metavar="N", help="average the newest N step checkpoints")
    group.add_argument("--best", type=_positive_int, metavar="N",
                       help="average the N step checkpoints with the best validation score")
    p.add_argument("--output", "-o", metavar="FILE", help="where to write (default: RUN_DIR/checkpoints/averaged.pt)")


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
    from .train import TrainingInterrupted, train

    try:
        summary = train(load_config(args.config, args.overrides), resume=args.resume)
    except TrainingInterrupted as e:
        print(f"tmt: {e}", file=sys.stderr)
        return e.exit_code
    print(f"trained {summary['steps']} steps in {summary['minutes']:.1f} min; best validation "
          f"{summary['best_score']:.2f} at step {summary['best_step']}; run directory {summary['run_dir']}",
          file=sys.stderr)
    return 0


def cmd_translate(args: argparse.Namespace) -> int:
    from .translate import load_translator

    translator = load_translator(args.checkpoint, device=args.device, precision=args.precision, beam=args.beam,
                                 alpha=args.alpha, max_len=args.max_len)
    with contextlib.ExitStack() as stack:  # closes only the files opened here, never stdin/stdout
        try:  # newline="\n": a lone \r inside a line must not split it (stdin already reads this way)
            src = stack.enter_context(open(args.input, encoding="utf-8", errors="replace", newline="\n")) \
                if args.input else sys.stdin
            out = stack.enter_context(open(args.output, "w", encoding="utf-8")) if args.output else sys.stdout
        except OSError as e:
            raise UserError(f"cannot open {e.filename}: {e.strerror}") from None
        interactive = src.isatty()  # a person typing: answer each line at once, not after 2,000 of them
        lines = _prompted(src) if interactive else src
        for line in translator.translate_stream(lines, chunk=1 if interactive else 2000):
            out.write(line + "\n")
            out.flush()
    return 0


def _prompted(src: TextIO) -> Iterator[str]:
    """Lines typed at a terminal, each after a prompt on stderr (so stdout holds translations only)."""
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

    result = evaluate(args.checkpoint, src=args.src, ref=args.ref, beam=args.beam, alpha=args.alpha,
                      max_len=args.max_len, device=args.device, precision=args.precision, output=args.output)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(result["bleu_detail"])
        print(f"chrF2 = {result['chrf']:.2f}  {result['chrf_signature']}")
        print(f"TER = {result['ter']:.2f}  {result['ter_signature']}")
        print(f"{result['sentences']} sentences, beam {result['beam']}, {result['sentences_per_second']} sent/s; "
              f"hypotheses in {result['hypotheses_path']}", file=sys.stderr)
    return 0


def cmd_average(args: argparse.Namespace) -> int:
    from .checkpoint import average_run

    path, steps = average_run(args.run_dir, last=args.last or 0, best=args.best or 0, output=args.output)
    print(f"averaged steps {', '.join(map(str, steps))} into {path}", file=sys.stderr)
    return 0


COMMANDS = {"train": cmd_train, "translate": cmd_translate, "evaluate": cmd_evaluate, "average": cmd_average}


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logger = logging.getLogger("transformer_mt")
    logger.setLevel(logging.WARNING if args.quiet else logging.INFO)
    handler = logging.StreamHandler(sys.stderr)  # this call's stderr (tests swap it between calls)
    handler.setFormatter(_Formatter())
    logger.addHandler(handler)
    try:
        with logging_redirect_tqdm(loggers=[logger]):  # log lines do not break a running progress bar
            return COMMANDS[args.command](args)
    except UserError as e:
        print(f"tmt: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("tmt: interrupted", file=sys.stderr)
        return 130
    finally:
        logger.removeHandler(handler)


if __name__ == "__main__":
    sys.exit(main())
