"""Checkpoint files: one serialisation per save, the other names linked (or copied) atomically;
resumes refused from weights-only files."""

import os

import pytest
import torch

from transformer_mt import checkpoint
from transformer_mt.checkpoint import CheckpointError, load_checkpoint, save_rotating


def training_state(step: int, value: float) -> dict:
    return {
        "model": {"w": torch.full((4,), value)},
        "optimizer": {"state": {}},
        "config": {},
        "step": step,
        "train_state": {"step": step},
    }


def counting_torch_save(monkeypatch) -> list:
    calls, save = [], torch.save
    monkeypatch.setattr(torch, "save", lambda *a, **kw: calls.append(1) or save(*a, **kw))
    return calls


@pytest.mark.parametrize("links", [True, False])
def test_one_save_serialises_the_checkpoint_once(tmp_path, monkeypatch, links):
    """Issue 22, item 9: last.pt, best.pt and step_N.pt were each re-serialised; now torch.save runs
    once and the others are hard links to that file, or copies where the file system has no hard
    links."""
    if not links:

        def no_links(src, dst):
            raise OSError(1, "Operation not permitted")

        monkeypatch.setattr(checkpoint.os, "link", no_links)
    calls = counting_torch_save(monkeypatch)
    save_rotating(tmp_path, training_state(3, 1.5), best=True, keep_last=2)
    assert len(calls) == 1
    ckpt_dir = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [
        "best.pt",
        "last.pt",
        "step_3.pt",
    ]  # no temporary files
    last = (ckpt_dir / "last.pt").read_bytes()
    assert (ckpt_dir / "best.pt").read_bytes() == last == (ckpt_dir / "step_3.pt").read_bytes()
    for name in ("best.pt", "step_3.pt"):
        ckpt = load_checkpoint(ckpt_dir / name)
        assert ckpt["step"] == 3 and torch.equal(ckpt["model"]["w"], torch.full((4,), 1.5))
    assert (os.stat(ckpt_dir / "best.pt").st_nlink == 3) == links


def test_a_later_save_leaves_the_linked_best_as_it_was(tmp_path):
    """Each save renames a new file over last.pt: best.pt, linked to the old one, keeps the old
    contents."""
    save_rotating(tmp_path, training_state(2, 1.0), best=True, keep_last=1)
    save_rotating(tmp_path, training_state(4, 2.0), best=False, keep_last=1)
    ckpt_dir = tmp_path / "checkpoints"
    assert load_checkpoint(ckpt_dir / "best.pt")["step"] == 2
    assert load_checkpoint(ckpt_dir / "last.pt")["step"] == 4
    assert sorted(p.name for p in ckpt_dir.glob("step_*.pt")) == [
        "step_4.pt"
    ]  # step_2.pt pruned, best.pt kept
    assert torch.equal(load_checkpoint(ckpt_dir / "best.pt")["model"]["w"], torch.full((4,), 1.0))


def test_resuming_from_a_weights_only_checkpoint_names_the_file_to_resume_from(
    tmp_path,
):
    run = tmp_path / "run"
    checkpoint.save_checkpoint(
        run / "checkpoints" / "averaged.pt",
        {"model": {}, "config": {}, "step": 8, "averaged_steps": [6, 8]},
    )
    with pytest.raises(CheckpointError) as e:
        checkpoint.load_training_checkpoint(run / "checkpoints" / "averaged.pt")
    assert "weights only" in str(e.value) and str(run.resolve() / "checkpoints" / "last.pt") in str(
        e.value
    )
