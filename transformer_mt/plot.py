"""Attention pictures for `tmt translate --plot-attention` (the optional [plot] extra:
matplotlib)."""

from __future__ import annotations

from pathlib import Path

import torch

from .decoding import Translation, word_attention, words_of
from .errors import UserError


def require_matplotlib() -> None:
    """A clear error naming the extra, before any work is done."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(
            "--plot-attention needs matplotlib: pip install 'transformer-mt[plot]'"
        ) from None


def plot_attention(h: Translation, path: Path, *, all_heads: bool = False) -> None:
    """One PNG: source words x target words of the attention the alignment uses (the last layer,
    heads averaged), with a colour bar; or, with all_heads, a grid of every layer and head over
    pieces."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    src_words, tgt_words = words_of(h.source_pieces), words_of(h.pieces)
    if all_heads:
        L, H = h.attention_heads.shape[:2]
        fig, axes = plt.subplots(L, H, figsize=(2.2 + 2.6 * H, 1.2 + 2.6 * L), squeeze=False)
        for layer in range(L):
            for head in range(H):
                ax = axes[layer][head]
                image = ax.imshow(
                    h.attention_heads[layer, head].numpy(), cmap="viridis", vmin=0, vmax=1
                )
                ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=8)
                _label(ax, h.source_pieces + ["</s>"], h.pieces + ["</s>"], fontsize=5)
        fig.colorbar(image, ax=axes, shrink=0.6, label="attention")
    else:
        # (target words, source words)
        matrix = word_attention(torch.tensor(h.attention), h.source_pieces, h.pieces)
        fig, ax = plt.subplots(
            figsize=(1.5 + 0.45 * max(len(src_words), 4), 1.2 + 0.4 * max(len(tgt_words), 4))
        )
        image = ax.imshow(matrix.numpy(), cmap="viridis", vmin=0, vmax=1, aspect="auto")
        _label(ax, src_words, tgt_words, fontsize=9)
        ax.set_xlabel("source")
        ax.set_ylabel("translation")
        fig.colorbar(image, ax=ax, label="attention (last layer, heads averaged)")
        fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _label(ax, columns: list[str], rows: list[str], fontsize: int) -> None:
    ax.set_xticks(range(len(columns)), columns, rotation=60, ha="right", fontsize=fontsize)
    ax.set_yticks(range(len(rows)), rows, fontsize=fontsize)
