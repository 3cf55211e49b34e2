"""SentencePiece models in a run directory: a separate vocabulary with one file missing is a user
error."""

from __future__ import annotations

import textwrap

import pytest

from transformer_mt.cli import main
from transformer_mt.config import TokenizerConfig
from transformer_mt.errors import UserError
from transformer_mt.tokenizer import Tokenizer, train_tokenizer

LINES = [
    "the cat sat on the mat",
    "a dog runs to the old house",
    "the red tree by the river",
] * 20


@pytest.fixture(scope="module")
def separate():
    return train_tokenizer(
        TokenizerConfig(vocab_size=40, joint=False), LINES, [s.upper() for s in LINES]
    )


@pytest.mark.parametrize(
    "missing, present",
    [("spm.tgt.model", "spm.src.model"), ("spm.src.model", "spm.tgt.model")],
)
def test_one_half_of_a_separate_vocabulary_is_a_user_error_naming_the_missing_file(
    tmp_path, separate, missing, present
):
    """Issue 22 item 11: it was a FileNotFoundError traceback."""
    separate.save(tmp_path)
    assert Tokenizer.load(tmp_path).digest == separate.digest
    (tmp_path / missing).unlink()
    with pytest.raises(UserError) as info:
        Tokenizer.load(tmp_path)
    message = str(info.value)
    assert str(tmp_path / missing) in message and present in message and "\n" not in message


def test_a_run_directory_without_any_model_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="spm.model"):
        Tokenizer.load(tmp_path)


def test_train_on_a_run_whose_spm_tgt_model_is_missing_exits_2_with_one_line(
    tmp_path, separate, capsys
):
    for split in ("train", "valid"):
        (tmp_path / f"{split}.en").write_text("".join(s + "\n" for s in LINES), encoding="utf-8")
        (tmp_path / f"{split}.de").write_text(
            "".join(s.upper() + "\n" for s in LINES), encoding="utf-8"
        )
    run = tmp_path / "run"
    run.mkdir()
    separate.save(run)
    (run / "spm.tgt.model").unlink()
    cfg = tmp_path / "sep.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
        data: {{src_lang: en, tgt_lang: de, train: {tmp_path / "train"},
                valid: {tmp_path / "valid"}}}
        tokenizer: {{vocab_size: 40, joint: false}}
        model: {{d_model: 16, heads: 2, encoder_layers: 1, decoder_layers: 1, d_ff: 32,
                 tie_embeddings: false, max_positions: 64}}
        train: {{max_steps: 2, device: cpu, precision: fp32}}
        output_dir: {run}
        """),
        encoding="utf-8",
    )
    capsys.readouterr()
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert str(run / "spm.tgt.model") in err
