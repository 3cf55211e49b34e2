"""`tmt export --format transformers` (issue 24): the Marian model that `transformers` loads
computes what ours computes, greedy output for greedy output and log-probability for
log-probability, for every option of our post-norm architecture; pre-norm models are refused."""

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_model

from transformer_mt.cli import main
from transformer_mt.data import read_split
from transformer_mt.errors import UserError
from transformer_mt.export_hf import export_transformers, marian_model
from transformer_mt.inference import load_translator
from transformer_mt.search import max_output_len
from transformer_mt.vocab import BOS, EOS

transformers = pytest.importorskip(
    "transformers", reason="the [hf] extra (transformers) is not installed"
)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
# Tiny runs (conftest.py: the copy task, one layer each) of each option, 200 updates: outputs that
# are sentences, not yet exact copies.
STEPS = 200


def small_run(
    make_tiny_run, *, norm: str, tie: bool, joint: bool, activation: str = "relu"
) -> Path:
    return make_tiny_run(
        model={"norm": norm, "tie_embeddings": tie, "dropout": 0.0, "activation": activation},
        tokenizer={"joint": joint},
        train={"max_steps": STEPS, "valid_every": STEPS, "valid_bleu": False},
    ).dir


def export(run: Path, out: Path) -> Path:
    assert main(["-q", "export", str(run), "--format", "transformers", "-o", str(out)]) == 0
    return out


def hf_greedy(model, ids: list[int], budget: int) -> list[int]:
    """Greedy generation from our source ids; the output's tokens without start token and EOS."""
    out = model.generate(
        torch.tensor([ids + [EOS]]), num_beams=1, do_sample=False, max_length=budget + 1
    )[0].tolist()
    assert out[0] == BOS
    out = out[1:]
    return out[: out.index(EOS)] if EOS in out else out


def hf_logprobs(model, src: list[int], tgt: list[int]) -> list[float]:
    """Forced decoding: log P of each target token, then of EOS."""
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor([src + [EOS]]), decoder_input_ids=torch.tensor([[BOS] + tgt])
        ).logits[0]
    logp = logits.float().log_softmax(-1)
    return logp[torch.arange(len(tgt) + 1), torch.tensor(tgt + [EOS])].tolist()


@pytest.mark.parametrize(
    "tie, joint, activation",
    [(True, True, "relu"), (False, True, "relu"), (True, False, "relu"), (False, False, "gelu")],
)
def test_export_generates_and_scores_as_ours(make_tiny_run, tmp_path, tie, joint, activation):
    run = small_run(make_tiny_run, norm="post", tie=tie, joint=joint, activation=activation)
    out = export(run, tmp_path / "hf")
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert isinstance(model, transformers.MarianMTModel)
    ours = load_translator(run, device="cpu", precision="fp32")
    sources, references = read_split(ours.config.data, "test")
    src_ids = ours.tokenizer.encode_src(sources)
    # the tokenizer encodes as ours does, EOS appended
    assert tokenizer(sources)["input_ids"] == [ids + [EOS] for ids in src_ids]
    d = ours.config.decode
    budgets = max_output_len(
        torch.tensor([len(x) + 1 for x in src_ids]), d.max_len_a, d.max_len_b, ours.max_positions
    ).tolist()
    mine = ours.translate_ids(src_ids, ours.defaults.replace(beam=1))
    theirs = [hf_greedy(model, ids, b) for ids, b in zip(src_ids, budgets)]
    assert [h[0].tokens for h in mine] == theirs
    assert len({tuple(t) for t in theirs}) > 5  # real, varied outputs
    # the pipeline's strings are ours
    assert tokenizer.batch_decode(
        [[BOS] + t + [EOS] for t in theirs], skip_special_tokens=True
    ) == [t[0].text for t in ours.translate(sources, beam=1)]
    # forced decoding of the references
    tgt_ids = ours.tokenizer.encode_tgt(references)
    scored = ours.score(sources, references)
    for s, t, sc in zip(src_ids, tgt_ids, scored):
        assert hf_logprobs(model, s, t) == pytest.approx(sc.token_logprobs, abs=1e-3)


def test_export_records_the_run_and_refuses_pre_norm(make_tiny_run, tmp_path):
    run = small_run(make_tiny_run, norm="post", tie=True, joint=True)
    out = export(run, tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    ours = load_translator(run, device="cpu")
    assert config["tmt"]["step"] == STEPS
    assert config["tmt"]["tokenizer"] == ours.tokenizer.digest
    assert json.loads((out / "tmt.json").read_text()) == config["tmt"]
    assert "pipeline(" in (out / "README.md").read_text()
    # the README's three lines, from the directory alone: greedy, as ours
    sources = read_split(ours.config.data, "test")[0]
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(out))
    got = tok.batch_decode(
        model.generate(**tok(sources, return_tensors="pt", padding=True)), skip_special_tokens=True
    )
    expected = [t[0].text for t in ours.translate(sources, beam=1, max_len=(0, 128))]
    assert got == expected
    if int(transformers.__version__.split(".")[0]) < 5:  # transformers 5 has no such pipeline
        translate = transformers.pipeline("translation", model=str(out), device="cpu")
        assert [r["translation_text"] for r in translate(sources)] == expected
    # an export is replaced only with --force
    with pytest.raises(UserError, match="--force"):
        export_transformers(run, out)
    pre = small_run(make_tiny_run, norm="pre", tie=True, joint=True)
    with pytest.raises(UserError, match="post-norm models only"):
        export_transformers(pre, tmp_path / "pre")
    assert not (tmp_path / "pre").exists()


def test_missing_extra_names_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    args = ["export", str(tmp_path), "--format", "transformers", "-o", str(tmp_path / "out")]
    assert main(args) == 2
    assert "pip install 'transformer-mt[hf]'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_scale_norm_model_is_refused_by_name():
    """Marian has LayerNorm only: a ScaleNorm model would not export as itself."""
    with pytest.raises(UserError, match="model.norm_type"):
        marian_model(transformers, tiny_model(norm_type="scale"), tokenizer=None)


def test_a_gated_feed_forward_is_refused_by_name():
    """Marian's feed-forward layer has no gate: a swiglu model would not export as itself."""
    with pytest.raises(UserError, match="model.activation"):
        marian_model(transformers, tiny_model(activation="swiglu"), tokenizer=None)
