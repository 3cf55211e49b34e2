"""End to end through `tmt` (cli.main) with the tiny model trained once per test run (conftest.py:
`tiny_run`): translate, evaluate, score, average, and the user errors of each."""

from __future__ import annotations

import io
import json
import logging
import math
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch

from transformer_mt.cli import main
from transformer_mt.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TMT = ROOT / ".venv" / "bin" / "tmt"
# One torch thread for the module (conftest.py): decoding on a small shared machine.
pytestmark = pytest.mark.usefixtures("one_thread")


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def lines_of(path: Path) -> list[str]:
    """Lines of a file written one per line; split on \\n only (a translation may hold other
    separators)."""
    text = path.read_text(encoding="utf-8")
    assert text == "" or text.endswith("\n")
    return text.split("\n")[:-1] if text else []


@pytest.fixture(scope="module", autouse=True)
def _package_logger_kept():
    """The package logger as it was before main() configured it, for the modules that run
    after."""
    logger = logging.getLogger("transformer_mt")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)


# --------------------------------------------------------------------------- train


def test_train_writes_a_complete_run_directory(tiny_run):
    run = tiny_run.dir
    for name in ("config.yaml", "spm.model", "checkpoints/last.pt", "checkpoints/best.pt"):
        assert (run / name).is_file(), name
    assert list((run / "tb").rglob("events.out.tfevents*")), "no TensorBoard events under tb/"
    # The override reached the run: the YAML says 500 updates, `--set train.max_steps=300`
    # (conftest.py) 300, and so do the saved config and the last checkpoint.
    assert load_config(tiny_run.config).train.max_steps == 500
    assert load_config(run / "config.yaml").train.max_steps == 300
    ckpt = torch.load(run / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert ckpt["step"] == 300


# --------------------------------------------------------------------------- translate


def test_translate_file_keeps_line_count_and_empty_lines(tiny_run, tmp_path):
    src = ["alpha beta gamma", "", "delta echo", "fox golf hotel india", "", "kilo", ""]
    f = write_lines(tmp_path / "in.txt", src)
    g = tmp_path / "out.txt"
    rc = main(
        [
            "translate",
            "--checkpoint",
            str(tiny_run.dir),
            "--input",
            str(f),
            "--output",
            str(g),
            "--beam",
            "2",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    out = lines_of(g)
    assert len(out) == len(src)
    for line_in, line_out in zip(src, out):
        if line_in == "":
            assert line_out == ""


def test_translate_greedy_with_a_checkpoint_file(tiny_run, tmp_path, sentences):
    src = sentences(9, 4)
    f = write_lines(tmp_path / "in.txt", src)
    g = tmp_path / "out.txt"
    ckpt = tiny_run.dir / "checkpoints" / "last.pt"
    assert main(["translate", "-c", str(ckpt), "-i", str(f), "-o", str(g), "--beam", "1"]) == 0
    assert len(lines_of(g)) == len(src)


def test_translate_stdin_to_stdout_leaves_streams_open(tiny_run, monkeypatch):
    stdin, stdout = io.StringIO("alpha beta\n\ngamma delta\n"), io.StringIO()
    monkeypatch.setattr(sys, "stdin", stdin)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["translate", "-c", str(tiny_run.dir)]) == 0
    assert not stdout.closed
    assert len(stdout.getvalue().split("\n")[:-1]) == 3


def test_translate_without_checkpoint_uses_newest_run_in_cwd(
    tiny_run, tmp_path, monkeypatch, capsys
):
    runs = tmp_path / "runs"
    # An older run whose checkpoint is unusable: picking it would fail.
    old = runs / "older" / "checkpoints"
    old.mkdir(parents=True)
    shutil.copy(tiny_run.dir / "spm.model", runs / "older")
    (old / "last.pt").write_bytes(b"")
    os.utime(old / "last.pt", (1_000_000_000, 1_000_000_000))
    new = runs / "newer"
    (new / "checkpoints").mkdir(parents=True)
    shutil.copy(tiny_run.dir / "spm.model", new)
    shutil.copy(tiny_run.dir / "checkpoints" / "last.pt", new / "checkpoints" / "last.pt")
    write_lines(tmp_path / "in.txt", ["alpha beta", "gamma"])
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    rc = main(["translate", "--input", "in.txt", "--output", "out.txt", "--beam", "1"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "newer" in err and "older" not in err
    assert len(lines_of(tmp_path / "out.txt")) == 2


# --------------------------------------------------------------------------- evaluate


def test_evaluate_test_split_json(tiny_run, capsys):
    capsys.readouterr()
    rc = main(["evaluate", "--checkpoint", str(tiny_run.dir), "--json", "--beam", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)
    # The scores are sacreBLEU's on the file it wrote against the test split's references,
    # computed here without our code; and that file has one line per test sentence.
    hyps, refs = lines_of(Path(result["hypotheses_path"])), lines_of(tiny_run.corpus / "test.de")
    assert len(hyps) == len(refs) == result["sentences"]
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=0.005)
    assert result["chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=0.005)
    assert result["signature"].startswith("nrefs:1|") and "tok:13a" in result["signature"]
    # the tiny model has learned to copy: its BLEU is far from 0 (a wrong pairing would be near it)
    assert result["bleu"] > 50, hyps


def test_evaluate_src_ref_files(tiny_run, tmp_path, capsys, sentences):
    src = sentences(7, 11)
    s = write_lines(tmp_path / "mine.en", src)
    r = write_lines(tmp_path / "mine.de", [x.upper() for x in src])
    hyp = tmp_path / "hyps" / "mine.hyp"
    hyp.parent.mkdir()
    capsys.readouterr()
    rc = main(
        [
            "evaluate",
            "-c",
            str(tiny_run.dir),
            "--src",
            str(s),
            "--ref",
            str(r),
            "--json",
            "--output",
            str(hyp),
        ]
    )
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert Path(result["hypotheses_path"]).resolve() == hyp.resolve()
    assert len(lines_of(hyp)) == 7


def test_evaluate_text_output(tiny_run, capsys):
    assert main(["evaluate", "-c", str(tiny_run.dir), "--beam", "1"]) == 0
    captured = capsys.readouterr()
    assert "BLEU" in captured.out and "chrF" in captured.out
    assert "sentences" in captured.err


# --------------------------------------------------------------------------- user errors


# Each case: (the tiny run, an empty folder that is the cwd) -> (argv, what the error line names).


def _missing_config(t, tmp):
    return ["train", str(tmp / "nope.yaml")], "nope.yaml"


def _unknown_key(t, tmp):
    cfg = tmp / "bad.yaml"
    cfg.write_text("model:\n  d_modle: 64\n")
    return ["train", str(cfg)], "model.d_modle"


def _unknown_override(t, tmp):
    return ["train", str(t.config), "--set", "train.max_stepz=3"], "train.max_stepz"


def _bad_override(t, tmp):
    return ["train", str(t.config), "--set", "model.heads=3"], "model.d_model"


def _vocab_smaller_than_alphabet(t, tmp):
    sets = ["--set", "tokenizer.vocab_size=16", "--set", f"output_dir={tmp / 'run'}"]
    return ["-q", "train", str(t.config), *sets], "tokenizer.vocab_size"


def _missing_checkpoint(t, tmp):
    return ["translate", "-c", str(tmp / "no-such-run"), "--input", str(t.config)], "no-such-run"


def _evaluate_missing_checkpoint(t, tmp):
    return ["evaluate", "--checkpoint", str(tmp / "gone.pt")], "gone.pt"


def _empty_run_dir(t, tmp):
    (tmp / "emptyrun").mkdir()
    return ["translate", "--checkpoint", str(tmp / "emptyrun")], "emptyrun"


def _no_runs_in_cwd(t, tmp):
    return ["evaluate"], "runs"  # the test runs in an empty cwd


def _text_checkpoint(text):
    def case(t, tmp):
        path = tmp / "notes.txt"
        path.write_text(text)
        return ["translate", "--checkpoint", str(path), "--input", str(t.config)], "notes.txt"

    return case


def _empty_checkpoint(t, tmp):
    path = tmp / "empty.pt"
    path.write_bytes(b"")
    return ["evaluate", "--checkpoint", str(path)], "empty.pt"


def _src_without_ref(t, tmp):
    return ["evaluate", "-c", str(t.dir), "--src", str(t.corpus / "test.en")], "--ref"


def _ref_without_src(t, tmp):
    return ["evaluate", "-c", str(t.dir), "--ref", str(t.corpus / "test.de")], "--src"


def _src_ref_mismatch(t, tmp):
    s = write_lines(tmp / "a.en", ["alpha", "beta"])
    r = write_lines(tmp / "a.de", ["ALPHA"])
    return ["evaluate", "-c", str(t.dir), "--src", str(s), "--ref", str(r)], "a.de"


def _missing_input(t, tmp):
    return ["translate", "-c", str(t.dir), "--input", str(tmp / "absent.txt")], "absent.txt"


ERROR_CASES = [
    pytest.param(_missing_config, id="missing-config"),
    pytest.param(_unknown_key, id="unknown-key"),
    pytest.param(_unknown_override, id="unknown-override"),
    pytest.param(_bad_override, id="override-out-of-range"),
    pytest.param(_vocab_smaller_than_alphabet, id="vocab-smaller-than-alphabet"),
    pytest.param(_missing_checkpoint, id="missing-checkpoint"),
    pytest.param(_evaluate_missing_checkpoint, id="evaluate-missing-checkpoint"),
    pytest.param(_empty_run_dir, id="run-dir-without-checkpoints"),
    pytest.param(_no_runs_in_cwd, id="no-runs-in-cwd"),
    pytest.param(_text_checkpoint("this is not a checkpoint\n"), id="text-checkpoint"),
    pytest.param(_text_checkpoint("hello\n"), id="text-checkpoint-hello"),
    pytest.param(_text_checkpoint("{}"), id="text-checkpoint-braces"),
    pytest.param(_empty_checkpoint, id="empty-checkpoint"),
    pytest.param(_src_without_ref, id="src-without-ref"),
    pytest.param(_ref_without_src, id="ref-without-src"),
    pytest.param(_src_ref_mismatch, id="src-ref-line-mismatch"),
    pytest.param(_missing_input, id="missing-input"),
]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_user_errors_exit_2_with_one_line(tiny_run, tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    argv, mention = case(tiny_run, tmp_path)
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tmt:")
    assert mention in lines[0]


# --------------------------------------------------------------------------- --help

HELP_FLAGS = {
    (): ["train", "translate", "evaluate"],
    ("train",): ["--set"],
    ("translate",): ["--checkpoint", "--beam", "--input", "--output", "--device"],
    ("evaluate",): ["--checkpoint", "--beam", "--src", "--ref", "--json", "--device", "--output"],
}


@pytest.mark.parametrize("sub", list(HELP_FLAGS), ids=lambda s: " ".join(s) or "tmt")
def test_help_in_process(sub, capsys):
    with pytest.raises(SystemExit) as info:
        main([*sub, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for flag in HELP_FLAGS[sub]:
        assert flag in out, flag


def test_console_script_help():
    assert TMT.is_file(), f"{TMT} is missing: run `make install`"
    for sub, flags in HELP_FLAGS.items():
        proc = subprocess.run(
            [str(TMT), *sub, "--help"], capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 0, proc.stderr
        for flag in flags:
            assert flag in proc.stdout, (sub, flag)


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage" in capsys.readouterr().err.lower()


def test_bad_beam_is_a_usage_error(tiny_run, capsys):
    with pytest.raises(SystemExit) as info:
        main(["translate", "-c", str(tiny_run.dir), "--beam", "0"])
    assert info.value.code == 2
    assert "--beam" in capsys.readouterr().err


def test_max_len_reaches_the_decoder_and_is_checked(tiny_run, capsys):
    # (the cap itself is tested on the search functions:
    # test_search.test_outputs_respect_the_length_budget)
    assert main(["evaluate", "-c", str(tiny_run.dir), "--json", "--max-len", "0", "200"]) == 0
    assert json.loads(capsys.readouterr().out)["max_len"] == [0.0, 200]  # the run's own is 1.5, 5
    assert main(["evaluate", "-c", str(tiny_run.dir), "--max-len", "0", "2.5"]) == 2
    assert "--max-len" in capsys.readouterr().err


def test_precision_flag_overrides_the_runs(tiny_run, capsys):
    for precision in ("bf16", "fp32"):
        assert main(["evaluate", "-c", str(tiny_run.dir), "--json", "--precision", precision]) == 0
        assert json.loads(capsys.readouterr().out)["precision"] == precision
    with pytest.raises(SystemExit):
        main(["translate", "-c", str(tiny_run.dir), "--precision", "fp8"])
    assert "--precision" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["--last", "--best"])
def test_average_then_evaluate(tiny_run, tmp_path, how, capsys):
    out = tmp_path / f"avg{how}.pt"
    assert main(["average", str(tiny_run.dir), how, "2", "--output", str(out)]) == 0
    assert "averaged steps 150, 300" in capsys.readouterr().err  # validated every 150
    assert main(["evaluate", "-c", str(out), "--json", "--beam", "2", "--alpha", "1.0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["alpha"] == 1.0 and result["checkpoint"] == str(out)


def test_average_needs_two_checkpoints(tmp_path, capsys):
    (tmp_path / "checkpoints").mkdir()
    assert main(["average", str(tmp_path), "--last", "3"]) == 2
    assert "at least 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "precision, dtype", [("bf16", torch.bfloat16), ("fp32", torch.float32), ("fp16", torch.float32)]
)  # fp16 only on GPUs
def test_translator_decodes_in_the_runs_precision(tiny_run, precision, dtype):
    from transformer_mt.checkpoint import load_for_inference, resolve_checkpoint
    from transformer_mt.inference import Translator

    model, tokenizer, cfg, _ = load_for_inference(
        resolve_checkpoint(str(tiny_run.dir)), torch.device("cpu")
    )
    seen = []
    model.generator.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    out = Translator.for_model(model, tokenizer, cfg.decode, precision=precision).translate_text(
        ["alpha beta", "gamma"], beam=2
    )
    assert len(out) == 2 and seen and set(seen) == {dtype}
    # the caller's model (training's) is untouched
    assert {p.dtype for p in model.parameters()} == {torch.float32}


# --------------------------------------------------------------------------- defects found in
# review (issue 11)


def test_translate_input_file_keeps_a_lone_carriage_return_inside_its_line(tiny_run, tmp_path):
    """Defect 1: --input was read with universal newlines, so a lone \\r split one line in two."""
    f = tmp_path / "in.txt"
    # 3 lines: one with a lone \r, one CRLF
    f.write_bytes(b"alpha beta\ngamma\rdelta echo\nfox golf\r\n")
    g = tmp_path / "out.txt"
    assert (
        main(["translate", "-c", str(tiny_run.dir), "-i", str(f), "-o", str(g), "--beam", "1"]) == 0
    )
    assert len(lines_of(g)) == 3


def test_translate_at_a_terminal_answers_each_line_before_end_of_input(tiny_run):
    """Defect 2: translate buffered 2,000 lines, so a person typing saw nothing until Ctrl-D.
    Through a pseudo-terminal: one line in, its translation out, while stdin is still open."""
    import pty
    import select

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformer_mt",
            "translate",
            "-c",
            str(tiny_run.dir),
            "--beam",
            "1",
            "--device",
            "cpu",
        ],
        stdin=slave,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
    )
    os.close(slave)
    try:
        os.write(master, b"alpha beta gamma\n")
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "no translation within 120 s of the line (stdin still open)"
        line = proc.stdout.readline().decode()
        # answered, and still waiting for more input
        assert line.endswith("\n") and proc.poll() is None
        os.write(master, b"\x04")  # Ctrl-D: end of input
        proc.wait(timeout=60)
        assert proc.returncode == 0
        # the prompt goes to stderr, not among the translations
        assert "> " in proc.stderr.read().decode()
    finally:
        proc.kill()
        os.close(master)


def test_average_best_ranks_only_validated_checkpoints(make_tiny_run, tmp_path, capsys):
    """Defect 3: save_every checkpoints carried the previous validation's metrics, so `average
    --best` ranked unvalidated weights by another checkpoint's score. Steps 2, 6, 10 are written
    between the validations at 4, 8, 12: with the bug the copies of the best score win the ties."""
    run = make_tiny_run(
        train={
            "max_steps": 12,
            "valid_every": 4,
            "save_every": 2,
            "keep_last": 10,
            "valid_bleu": False,
        }
    ).dir
    ckpts = {
        int(p.stem.split("_")[1]): torch.load(p, weights_only=True)
        for p in (run / "checkpoints").glob("step_*.pt")
    }
    assert sorted(ckpts) == [2, 4, 6, 8, 10, 12]
    assert all(not ckpts[s]["metrics"] for s in (2, 6, 10)) and all(
        ckpts[s]["metrics"] for s in (4, 8, 12)
    )
    best_two = sorted(sorted((4, 8, 12), key=lambda s: ckpts[s]["metrics"]["loss"])[:2])
    capsys.readouterr()
    assert main(["average", str(run), "--best", "2", "--output", str(tmp_path / "avg.pt")]) == 0
    assert f"averaged steps {best_two[0]}, {best_two[1]}" in capsys.readouterr().err


def test_max_len_longer_than_max_positions_is_a_config_error(tiny_run, tmp_path, capsys):
    """Defect 4: data.max_len + 1 > model.max_positions crashed mid-training in the positional
    encoding."""
    sets = ["--set", "data.max_len=128", "--set", f"output_dir={tmp_path / 'run'}"]
    assert main(["train", str(tiny_run.config), *sets]) == 2
    err = capsys.readouterr().err
    assert "data.max_len" in err and "model.max_positions" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_load_translator_keeps_one_output_per_input_even_for_none(tiny_run):
    from transformer_mt.inference import load_translator

    translator = load_translator(tiny_run.dir, device="cpu", beam=1)
    assert translator.translate_text([]) == [] and translator.translate([]) == []
    assert translator.translate_text(["", "alpha beta", ""])[::2] == ["", ""]
    best = tiny_run.dir / "checkpoints" / "best.pt"
    assert translator.checkpoint == best and translator.defaults.beam == 1
    assert translator.step == torch.load(best, weights_only=True)["step"] in (150, 300)


# --------------------------------------------------------------------------- n-best, formats,
# score, plots (issue 12)


def _translate(tiny_run, tmp_path, lines: list[str], *flags: str) -> list[str]:
    f = write_lines(tmp_path / "in.txt", lines)
    g = tmp_path / "out.txt"
    assert main(["translate", "-c", str(tiny_run.dir), "-i", str(f), "-o", str(g), *flags]) == 0
    return lines_of(g)


def test_jsonl_keeps_one_object_per_input_line_with_n_hypotheses(tiny_run, tmp_path):
    src = ["alpha beta gamma", "", "delta echo fox golf"]
    out = _translate(
        tiny_run, tmp_path, src, "--beam", "4", "--nbest", "3", "--format", "jsonl", "--alignment"
    )
    records = [json.loads(line) for line in out]
    assert [r["source"] for r in records] == src
    for r in records:
        hyps = r["hypotheses"]
        assert len(hyps) == (1 if r["source"] == "" else 3)
        assert [h["score"] for h in hyps] == sorted((h["score"] for h in hyps), reverse=True)
        for h in hyps:
            assert set(h) == {"text", "score", "logprob", "tokens", "token_logprobs", "alignment"}
            if r["source"] == "":  # not decoded: an empty line stays empty
                assert h["text"] == "" and h["token_logprobs"] == [] and h["logprob"] == 0
                continue
            assert len(h["token_logprobs"]) == len(h["tokens"]) + 1
            assert h["logprob"] == pytest.approx(sum(h["token_logprobs"]), abs=1e-4)
    text = _translate(tiny_run, tmp_path, src, "--beam", "4")
    # the 1-best is the text format's line
    assert [r["hypotheses"][0]["text"] for r in records] == text


def test_nbest_format_is_moses_with_n_lines_per_input_line(tiny_run, tmp_path):
    src = ["alpha beta", "", "gamma delta echo"]
    out = _translate(tiny_run, tmp_path, src, "--beam", "3", "--nbest", "2", "--format", "nbest")
    fields = [line.split(" ||| ") for line in out]
    # every input line, the empty one included
    assert [int(f[0]) for f in fields] == [0, 0, 1, 2, 2]
    for f in fields:
        assert len(f) == 4 and f[2].startswith("logprob=")
        float(f[2].removeprefix("logprob=")), float(f[3])


def test_nbest_larger_than_the_beam_is_a_user_error(tiny_run, tmp_path, capsys):
    f = write_lines(tmp_path / "in.txt", ["alpha"])
    assert (
        main(
            [
                "translate",
                "-c",
                str(tiny_run.dir),
                "-i",
                str(f),
                "--beam",
                "2",
                "--nbest",
                "3",
            ]
        )
        == 2
    )
    assert "--nbest 3" in capsys.readouterr().err


def test_score_agrees_with_what_translate_reports(tiny_run, tmp_path, capsys, sentences):
    """tmt score on (source, translate's own output) gives translate's log-probabilities back."""
    src = sentences(6, 11)
    out = [
        json.loads(line)
        for line in _translate(tiny_run, tmp_path, src, "--beam", "3", "--format", "jsonl")
    ]
    s, r = (
        write_lines(tmp_path / "s.en", src),
        write_lines(tmp_path / "r.de", [o["hypotheses"][0]["text"] for o in out]),
    )
    capsys.readouterr()
    assert (
        main(
            [
                "score",
                "-c",
                str(tiny_run.dir),
                "--src",
                str(s),
                "--ref",
                str(r),
                "--format",
                "jsonl",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    scored = [json.loads(line) for line in captured.out.splitlines()]
    assert [x["target"] for x in scored] == [o["hypotheses"][0]["text"] for o in out]
    for x, o in zip(scored, out):
        assert x["logprob"] == pytest.approx(o["hypotheses"][0]["logprob"], abs=1e-4)
    tokens = sum(len(x["token_logprobs"]) for x in scored)
    expected_ppl = math.exp(-sum(x["logprob"] for x in scored) / tokens)
    assert f"perplexity {expected_ppl:.4f}" in captured.err
    assert main(["score", "-c", str(tiny_run.dir), "--src", str(s), "--ref", str(r)]) == 0
    assert [float(v) for v in capsys.readouterr().out.split()] == pytest.approx(
        [x["logprob"] for x in scored], abs=1e-5
    )


def test_score_with_mismatched_files_says_so(tiny_run, tmp_path, capsys):
    s, r = write_lines(tmp_path / "s.en", ["a", "b"]), write_lines(tmp_path / "r.de", ["A"])
    assert main(["score", "-c", str(tiny_run.dir), "--src", str(s), "--ref", str(r)]) == 2
    assert "has 2 lines but" in capsys.readouterr().err


def test_plot_attention_writes_readable_pngs_of_the_expected_size(tiny_run, tmp_path):
    from matplotlib.image import imread

    src = ["alpha beta gamma", "delta echo fox golf hotel india"]
    plots = tmp_path / "plots"
    _translate(tiny_run, tmp_path, src, "--beam", "2", "--plot-attention", str(plots))
    assert sorted(p.name for p in plots.iterdir()) == ["0.png", "1.png"]
    for i, line in enumerate(src):
        image = imread(plots / f"{i}.png")  # decodes: a valid PNG
        assert image.ndim == 3 and image.shape[2] in (3, 4)
        # 100 dpi, 0.45 in per source word beyond a 1.5 in margin (at least 4 words wide)
        assert image.shape[1] == round(100 * (1.5 + 0.45 * max(len(line.split()), 4)))
    grid = tmp_path / "grid"
    _translate(tiny_run, tmp_path, src[:1], "--plot-attention", str(grid), "--plot-all-heads")
    assert imread(grid / "0.png").shape[1] > image.shape[1]  # one panel per layer and head


def test_plot_attention_without_matplotlib_names_the_extra(tiny_run, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    f = write_lines(tmp_path / "in.txt", ["alpha"])
    assert (
        main(
            [
                "translate",
                "-c",
                str(tiny_run.dir),
                "-i",
                str(f),
                "--plot-attention",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "transformer-mt[plot]" in capsys.readouterr().err


def test_sampling_from_the_cli_repeats_for_a_seed(tiny_run, tmp_path, sentences):
    src = sentences(8, 12)
    one = _translate(tiny_run, tmp_path, src, "--sampling", "topk:0", "--seed", "7")
    assert _translate(tiny_run, tmp_path, src, "--sampling", "topk:0", "--seed", "7") == one
    assert _translate(
        tiny_run, tmp_path, src, "--sampling", "topp:0.9", "--temperature", "0"
    ) == _translate(tiny_run, tmp_path, src, "--beam", "1")


def test_ensemble_of_the_same_checkpoint_twice_translates_like_it(tiny_run, tmp_path, sentences):
    src = sentences(5, 13)
    single = _translate(tiny_run, tmp_path, src, "--beam", "3")
    # -c twice: an ensemble
    twice = _translate(tiny_run, tmp_path, src, "--beam", "3", "-c", str(tiny_run.dir))
    assert twice == single


def test_ensemble_of_models_with_different_vocabularies_is_refused(
    tiny_run, make_tiny_run, tmp_path, capsys
):
    # the same corpus, another SentencePiece model
    other = make_tiny_run(train={"max_steps": 2}, tokenizer={"vocab_size": 40}).dir
    f = write_lines(tmp_path / "in.txt", ["alpha"])
    capsys.readouterr()
    assert main(["translate", "-c", str(tiny_run.dir), "-c", str(other), "-i", str(f)]) == 2
    assert "cannot ensemble" in capsys.readouterr().err


def test_the_readme_python_example_runs(tiny_run, capsys):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    code = readme.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "from transformer_mt import load" in code
    exec(code.replace('"runs/demo"', repr(str(tiny_run.dir))), {})
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 5 and out[2].startswith("[")  # text+scores, pieces, alignment, scores, text


# --------------------------------------------------------------------------- evaluation to publish
# (issue 14)


def test_evaluate_compare_prints_and_carries_the_test(tiny_run, tmp_path, capsys):
    run = str(tiny_run.dir)
    other = tmp_path / "other.hyp"
    assert main(["evaluate", "-c", run, "--beam", "1", "-o", str(other)]) == 0
    capsys.readouterr()
    assert main(["evaluate", "-c", run, "--compare", str(other), "--json", "--confidence"]) == 0
    result = json.loads(capsys.readouterr().out)
    c = result["comparison"]
    assert (
        c["method"] == "paired bootstrap resampling"
        and c["samples"] == 1000
        and c["seed"] == "12345"
    )
    base, greedy = c["metrics"]["BLEU"]["systems"]
    assert base["system"].endswith("best.pt") and greedy["system"] == str(other)
    assert greedy["delta"] == pytest.approx(greedy["score"] - base["score"], abs=0.01)
    assert 0 < greedy["p_value"] <= 1 and len(base["ci95"]) == 2
    assert result["bleu_confidence"]["bootstrap_samples"] == 1000 and "tokenized_bleu" in result
    assert main(["evaluate", "-c", run, "--compare", str(other), "--paired-ar"]) == 0
    out = capsys.readouterr().out
    assert (
        "paired approximate randomization" in out
        and "p = " in out
        and "Δ" in out
        and "95% CI" in out
    )


def test_evaluate_takes_several_references(tiny_run, tmp_path, capsys):
    corpus = tiny_run.corpus
    src, ref = corpus / "test.en", corpus / "test.de"
    noise = write_lines(tmp_path / "noise.de", ["x"] * len(lines_of(ref)))
    assert (
        main(
            [
                "evaluate",
                "-c",
                str(tiny_run.dir),
                "--src",
                str(src),
                "--ref",
                str(noise),
                "--ref",
                str(ref),
                "--json",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["references"] == 2 and "nrefs:2" in result["signature"]


def test_a_tiny_english_to_japanese_corpus_trains_translates_and_evaluates_without_unk(
    make_tiny_run, tmp_path, capsys
):
    """Japanese words made of kanji and kana the tokenizer samples rarely; byte fallback spells
    those."""
    en = "cat dog bird fish red blue big small sees eats".split()
    ja = "猫 犬 鳥 魚 赤い 青い 大きい 小さい 見る 食べる".split()
    rng = random.Random(3)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for split, n in (("train", 300), ("valid", 10), ("test", 10)):
        idx = [[rng.randrange(len(en)) for _ in range(rng.randint(2, 5))] for _ in range(n)]
        write_lines(corpus / f"{split}.en", [" ".join(en[i] for i in row) for row in idx])
        write_lines(corpus / f"{split}.ja", ["".join(ja[i] for i in row) + "。" for row in idx])
    run = make_tiny_run(
        corpus,
        data={"tgt_lang": "ja"},
        tokenizer={"vocab_size": 400, "byte_fallback": True},
        train={"max_steps": 60},
    ).dir
    saved = load_config(run / "config.yaml")
    assert saved.tokenizer.character_coverage == 0.9995 and saved.tokenizer.byte_fallback
    capsys.readouterr()
    assert main(["evaluate", "-c", str(run), "--json", "-o", str(tmp_path / "hyp")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert "tok:ja-mecab" in result["bleu_signature"] and "asian:yes" in result["ter_signature"]
    hyps = Path(result["hypotheses_path"]).read_text(encoding="utf-8")
    assert "⁇" not in hyps and "<unk>" not in hyps  # SentencePiece writes an unknown piece as ⁇


def test_sampling_flags_are_checked(tiny_run, tmp_path, capsys):
    f = write_lines(tmp_path / "in.txt", ["alpha", ""])
    run = str(tiny_run.dir)
    assert main(["translate", "-c", run, "-i", str(f), "--temperature", "0.5"]) == 2
    assert "--sampling" in capsys.readouterr().err
    assert (
        main(["translate", "-c", run, "-i", str(f), "--sampling", "topk:0", "--temperature", "-1"])
        == 2
    )
    assert (
        main(
            [
                "translate",
                "-c",
                run,
                "-i",
                str(f),
                "--sampling",
                "topk:0",
                "--temperature",
                "1e-40",
                "--seed",
                "1",
                "-o",
                str(tmp_path / "o.txt"),
            ]
        )
        == 0
    )  # tiny T: greedy, not NaN
    assert lines_of(tmp_path / "o.txt") == _translate(
        tiny_run, tmp_path, ["alpha", ""], "--beam", "1"
    )


def test_plot_attention_skips_empty_lines(tiny_run, tmp_path):
    plots = tmp_path / "p"
    _translate(tiny_run, tmp_path, ["", "alpha beta"], "--plot-attention", str(plots))
    # line 0 is empty: nothing to draw
    assert sorted(p.name for p in plots.iterdir()) in (["1.png"], [])


# --------------------------------------------------------------------------- issue 22: items 13,
# 14, 15


def _run_with_precision(tiny_run, folder: Path, recorded: str) -> Path:
    """A copy of the tiny run whose config says precision auto and whose last.pt says it tiny_run in
    `recorded`."""
    (folder / "checkpoints").mkdir(parents=True)
    shutil.copy(tiny_run.dir / "spm.model", folder)
    ckpt = torch.load(
        tiny_run.dir / "checkpoints" / "last.pt", map_location="cpu", weights_only=True
    )
    ckpt["config"]["train"]["precision"] = "auto"
    ckpt["train_state"]["precision"] = recorded
    torch.save(ckpt, folder / "checkpoints" / "last.pt")
    # what averaging keeps
    weights_only = {k: ckpt[k] for k in ("model", "config", "tokenizer", "spm", "step")}
    torch.save(weights_only, folder / "checkpoints" / "averaged.pt")
    return folder / "checkpoints"


def test_decoding_defaults_to_the_precision_the_run_trained_in(tiny_run, tmp_path, monkeypatch):
    """Issue 22 item 13: with precision auto the decoder resolved auto anew (fp32 on a CPU) instead
    of taking what the run tiny_run and validated in (train_state), e.g. bf16-output or bf16 chosen
    by the CPU probe."""
    from transformer_mt import translate

    asked = []
    real = translate.inference_model
    monkeypatch.setattr(
        translate,
        "inference_model",
        lambda model, p, device: asked.append(p) or real(model, p, device),
    )
    ckpts = _run_with_precision(tiny_run, tmp_path / "out", "bf16-output")
    translate.load_torch_engine(ckpts / "last.pt", device="cpu")
    # weights only: the run's last.pt says
    translate.load_torch_engine(ckpts / "averaged.pt", device="cpu")
    # decoded as validation decoded (runtime.inference_model)
    assert asked == ["bf16-output", "bf16-output"]

    ckpts = _run_with_precision(tiny_run, tmp_path / "bf16", "bf16")
    # the verdict must not hang on this CPU
    monkeypatch.setattr(translate, "cpu_has_native_bf16", lambda: True)
    for name in ("last.pt", "averaged.pt"):
        tr = translate.load_torch_engine(ckpts / name, device="cpu")
        assert tr.precision == "bf16" and {p.dtype for p in tr.model.parameters()} == {
            torch.bfloat16
        }
        assert (
            translate.load_torch_engine(ckpts / name, device="cpu", precision="fp32").precision
            == "fp32"
        )
    # where bf16 is emulated (an AVX2-only CPU: 10-20x slower), the default falls back to fp32;
    # asked for, bf16 stays
    monkeypatch.setattr(translate, "cpu_has_native_bf16", lambda: False)
    assert translate.load_torch_engine(ckpts / "last.pt", device="cpu").precision == "fp32"
    assert (
        translate.load_torch_engine(ckpts / "last.pt", device="cpu", precision="bf16").precision
        == "bf16"
    )
    # a weights-only checkpoint away from its run: the config's auto, resolved here
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(ckpts / "averaged.pt", alone)
    assert translate.load_torch_engine(alone / "averaged.pt", device="cpu").precision == "fp32"


def test_invalid_utf8_on_stdin_is_replaced_with_one_warning(tiny_run):
    """Issue 22 item 14: `printf '\\xff\\xfe bad\\n' | tmt translate` was a TypeError traceback; now
    stdin is read as --input is: bad bytes replaced, and one warning counting the lines that had
    any."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer_mt",
            "translate",
            "-c",
            str(tiny_run.dir),
            "--beam",
            "1",
            "--device",
            "cpu",
        ],
        input=b"\xff\xfe bad\nalpha beta\n\xc3 x \xff\n",
        capture_output=True,
        cwd=ROOT,
        timeout=300,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert len(proc.stdout.decode().split("\n")[:-1]) == 3
    warnings = [line for line in err.splitlines() if "invalid UTF-8" in line]
    assert len(warnings) == 1 and "<stdin>: 2 line(s)" in warnings[0], err


def test_invalid_utf8_in_every_input_file_is_replaced_with_one_warning_per_file(
    tiny_run, tmp_path, monkeypatch, capsys
):
    """The same policy for translate's --input (it replaced silently), for a text stdin that carries
    undecodable bytes as surrogates (a C locale's: it crashed), and for score's and evaluate's
    --src/--ref (they stopped)."""
    run = str(tiny_run.dir)
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"alpha \xff beta\ngamma\n")
    good = write_lines(tmp_path / "good.de", ["ALPHA", "GAMMA"])
    monkeypatch.setattr(
        sys,
        "stdin",
        io.TextIOWrapper(
            io.BytesIO(b"alpha \xff\ngamma\n"),
            encoding="utf-8",
            errors="surrogateescape",
            newline="\n",
        ),
    )
    for argv, name in (
        (["translate", "-c", run, "--beam", "1", "-i", str(bad)], str(bad)),
        (["translate", "-c", run, "--beam", "1"], "<stdin>"),
        (["score", "-c", run, "--src", str(bad), "--ref", str(good)], str(bad)),
        (["score", "-c", run, "--src", str(good), "--ref", str(bad)], str(bad)),
        (
            [
                "evaluate",
                "-c",
                run,
                "--beam",
                "1",
                "--src",
                str(bad),
                "--ref",
                str(good),
                "-o",
                str(tmp_path / "hyp"),
            ],
            str(bad),
        ),
    ):
        capsys.readouterr()
        assert main(argv) == 0, argv
        out, err = capsys.readouterr()
        warnings = [line for line in err.splitlines() if "invalid UTF-8" in line]
        assert warnings == [
            f"tmt: warning: {name}: 1 line(s) with invalid UTF-8 (first: line 1); bytes replaced "
            "by U+FFFD"
        ], (argv, err)
        if argv[0] != "evaluate":
            assert len(out.split("\n")[:-1]) == 2, argv


@pytest.mark.parametrize("flag", [["--beam", "4"], ["--alpha", "5"], ["--max-len", "0", "5"]])
def test_score_offers_no_search_flags(tiny_run, tmp_path, capsys, flag):
    """Issue 22 item 15: score (forced decoding) accepted --beam/--alpha/--max-len and ignored
    them."""
    s, r = write_lines(tmp_path / "s.en", ["alpha"]), write_lines(tmp_path / "r.de", ["ALPHA"])
    with pytest.raises(SystemExit) as info:
        main(["score", "-c", str(tiny_run.dir), "--src", str(s), "--ref", str(r), *flag])
    assert info.value.code == 2
    assert f"unrecognized arguments: {' '.join(flag)}" in capsys.readouterr().err


def test_quiet_training_prints_no_progress_bar_and_no_validation_lines(tiny_run, tmp_path, capsys):
    """Issue 22 item 15: `tmt -q train` printed the progress bar and every `step N: valid` line."""
    shown = {}
    for quiet in (False, True):
        capsys.readouterr()
        assert (
            main(
                [
                    *(["-q"] if quiet else []),
                    "train",
                    str(tiny_run.config),
                    "--set",
                    "train.max_steps=4",
                    "--set",
                    "train.valid_every=2",
                    "--set",
                    f"output_dir={tmp_path / f'run-{quiet}'}",
                ]
            )
            == 0
        )
        out, err = capsys.readouterr()
        shown[quiet] = out + err
    bar, valid = re.compile(r"train:\s+\d+%\|"), re.compile(r"step [24]: valid")
    # what -q is to hide is there without it
    assert bar.search(shown[False]) and valid.search(shown[False])
    assert not bar.search(shown[True]) and not valid.search(shown[True]), shown[True]
