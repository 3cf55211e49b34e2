"""`--engine ctranslate2`: translate and score with a CTranslate2 export (`tmt export`), through the
same interface and output formats as our PyTorch engine.

Beam search asks CTranslate2 for the beam's finished hypotheses by log-probability and ranks them
with our GNMT length penalty (CTranslate2's own penalty divides by |Y|^alpha); each sentence gets
our length budget (a x |source| + b, its end-of-sentence included), so the two engines search the
same space (scripts/ct2_agreement.py counts the identical outputs).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .checkpoint import resolve_checkpoint, run_dir_of
from .config import ConfigError, load_config
from .decoding import DecodeOptions, Engine
from .export import (
    MANIFEST,
    ExportError,
    cached_export,
    export_tokenizer,
    import_ctranslate2,
    is_export,
)
from .search import Cancelled, Hypothesis, Sampling, StopCheck, length_penalty, max_output_len
from .vocab import BOS, EOS, PAD

# pieces without EOS, log P (None: not known yet), per token
Hyp = tuple[list[str], float | None, list[float]]
COMPUTE_TYPES = {
    None: "default",
    "auto": "auto",
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "int8": "int8",
}


class CT2Engine(Engine):
    """CTranslate2 over an export directory, behind the same interface as our engine (no attention
    or alignment: those need ours)."""

    name = "ctranslate2"

    def __init__(
        self,
        directory: str | Path,
        *,
        device: str = "auto",
        precision: str | None = None,
        threads: int = 0,
    ):
        """precision: the compute type (fp32, bf16, fp16, int8; default: as the export stores its
        weights)."""
        ct2 = import_ctranslate2()
        self.directory = Path(directory)
        manifest = json.loads((self.directory / MANIFEST).read_text())
        self.config = load_config(self.directory / "tmt_config.yaml")
        self.tokenizer = export_tokenizer(self.directory, manifest)
        self.checkpoint, self.step = self.directory / "model.bin", manifest.get("step")
        self.max_positions = manifest["max_positions"]
        self.parameters = manifest.get("parameters", 0)
        self.device = _device(ct2, device)
        compute = COMPUTE_TYPES[precision]
        supported = ct2.get_supported_compute_types(self.device)
        if compute not in ("default", "auto") and compute not in supported:
            raise ConfigError(
                f"--precision {precision}: CTranslate2 on this {self.device} supports "
                f"{', '.join(sorted(supported))}"
            )
        self.precision = manifest["quantization"] if compute == "default" else compute
        self.model = ct2.Translator(
            str(self.directory),
            device=self.device,
            compute_type=compute,
            inter_threads=1,
            intra_threads=threads or torch.get_num_threads(),
        )
        self._specials = [self.tokenizer.tgt.id_to_piece(PAD), self.tokenizer.tgt.id_to_piece(BOS)]

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
        """Our search's hypotheses, as CTranslate2 finds them. token_scores=False leaves
        token_logprobs empty and skips the scoring pass that computes them. should_stop is asked
        before the search and before each scoring pass (CTranslate2 searches in one call). A
        sampling seed was set by seeded_generator (the generator itself is ours only). A prefix
        goes to CTranslate2 as target_prefix; hypotheses that have one are rescored (their
        log-probabilities from score_batch, prefix included, as ours counts them)."""
        stop = should_stop or (lambda: False)
        prefix = prefix if prefix and any(prefix) else None
        # our search's per-sentence output budget, for the source's pieces plus EOS
        budgets = max_output_len(
            torch.tensor([len(x) + 1 for x in ids], dtype=torch.long),
            options.max_len_a,
            options.max_len_b,
            self.max_positions,
            None if prefix is None else torch.tensor([len(p) for p in prefix], dtype=torch.long),
        ).tolist()
        pieces = None if prefix is None else [self.tokenizer.tgt.id_to_piece(p) for p in prefix]
        _stop_if(stop)
        found = dict(enumerate(self._search(ids, budgets, options, pieces)))
        _stop_if(stop)
        # Hypotheses the budget cut are scored (with EOS) to be ranked; then, when asked for, the
        # ones kept get per-token log-probabilities: at most two scoring passes, the second over the
        # n-best only.
        self._rescore(ids, found, lambda h: h[1] is None)
        found = {
            i: sorted(hyps, key=lambda h: -_rank(h[0], h[1], options))[: options.nbest]
            for i, hyps in found.items()
        }
        if token_scores:
            _stop_if(stop)
            self._rescore(ids, found, lambda h: True)
        piece_to_id = self.tokenizer.tgt.piece_to_id
        return [
            [Hypothesis(piece_to_id(list(p)), lp, _rank(p, lp, options), tl) for p, lp, tl in hyps]
            for _, hyps in sorted(found.items())
        ]

    def score(self, src_ids: list[list[int]], tgt_ids: list[list[int]]) -> list[list[float]]:
        """Forced decoding by CTranslate2's score_batch."""
        return self._score(src_ids, [self.tokenizer.tgt.id_to_piece(t) for t in tgt_ids])

    def seeded_generator(self, sampling: Sampling) -> torch.Generator:
        """CTranslate2 is seeded once per call or stream (search() then leaves the seed alone)."""
        if sampling.seed is not None:
            import_ctranslate2().set_random_seed(sampling.seed)
        return torch.Generator()

    def _rescore(
        self, ids: list[list[int]], found: dict[int, list[Hyp]], which: Callable[[Hyp], bool]
    ) -> None:
        """Replace the log-probability of the hypotheses `which` picks by score_batch's, with its
        per-token ones."""
        todo = [(i, k) for i, hyps in found.items() for k, h in enumerate(hyps) if which(h)]
        for (i, k), lp in zip(
            todo, self._score([ids[i] for i, _ in todo], [found[i][k][0] for i, k in todo])
        ):
            found[i][k] = (found[i][k][0], sum(lp), lp)

    # -----------------------------------------------------------------------------------------
    # internals

    def _search(
        self,
        ids: list[list[int]],
        budgets: list[int],
        decode: DecodeOptions,
        prefix: list[list[str]] | None = None,
    ) -> list[list[Hyp]]:
        """(pieces, log-probability or None, []) of each source's hypotheses, within its own length
        budget.

        CTranslate2 takes one max_decoding_length per call, so sentences go in groups of one budget
        each. At the budget our search ends every live hypothesis with EOS, where CTranslate2 keeps
        the best `beam` extensions of them (a hypothesis cut there, log-probability None, is
        rescored with EOS) and returns only `beam` of all it finished, by its own penalty. So a
        sentence whose search reached its budget is searched again, returning every hypothesis
        (patience 2: no search of ours finishes more than 2 x beam - 1 within the budget), to the
        budget and to one token less: the cut hypotheses of the second are the live ones our last
        step ends. See _penalty for what can still differ."""
        beam, sampling = decode.beam, decode.sampling
        lp = _penalty(decode.alpha)
        options: dict[str, Any] = dict(
            beam_size=beam,
            num_hypotheses=beam,
            length_penalty=lp,
            return_scores=True,
            return_end_token=True,
            min_decoding_length=0,
            max_input_length=0,  # inference.py cut the batch: decoded as it is, as ours decodes it
        )
        if sampling is not None:
            options.update(
                beam_size=1,
                num_hypotheses=1,
                sampling_topk=sampling.topk if sampling.temperature else 1,
                sampling_topp=sampling.topp,
                sampling_temperature=sampling.temperature or 1.0,
                # ours samples without them too
                suppress_sequences=[[p] for p in self._specials],
            )
        if prefix is not None:
            options["target_prefix"] = prefix
        found = self._by_budget(ids, budgets, budgets, options)
        if beam > 1 and sampling is None:  # a hypothesis of budget - 1 pieces ended at the budget
            again = [
                i
                for i, hyps in enumerate(found)
                if budgets[i] > 1 and any(len(h[0]) == budgets[i] - 1 for h in hyps)
            ]
            every = {**options, "patience": 2.0, "num_hypotheses": 2 * beam}
            if prefix is not None:
                every["target_prefix"] = [prefix[i] for i in again]
            src, limit = [ids[i] for i in again], [budgets[i] for i in again]
            full = self._by_budget(src, limit, limit, every)
            shorter = self._by_budget(src, limit, [b - 1 for b in limit], every)
            for i, a, b in zip(again, full, shorter):
                found[i] = _unique(a + b)
        return found

    def _by_budget(
        self, ids: list[list[int]], budgets: list[int], steps: list[int], options: dict[str, Any]
    ) -> list[list[Hyp]]:
        """Hypotheses of each source decoded for at most `steps` tokens, judged against its
        `budget`.

        Our search masks PAD and BOS after the softmax; CTranslate2 suppresses tokens before it,
        which renormalises every step's log-probabilities and reorders near-ties. So sources are
        searched with nothing suppressed (the log-probabilities ours ranks by), and only one whose
        hypotheses picked PAD or BOS (a model that gives them weight) is searched again with the two
        suppressed. options["target_prefix"], when there, has one prefix per source."""
        out = self._decode(ids, budgets, steps, options)
        odd = [
            i for i, hyps in enumerate(out) if any(set(self._specials) & set(h[0]) for h in hyps)
        ]
        suppressed = {**options, "suppress_sequences": [[p] for p in self._specials]}
        if "target_prefix" in options:
            suppressed["target_prefix"] = [options["target_prefix"][i] for i in odd]
        again = self._decode(
            [ids[i] for i in odd], [budgets[i] for i in odd], [steps[i] for i in odd], suppressed
        )
        for i, hyps in zip(odd, again):
            out[i] = hyps
        return out

    def _decode(
        self, ids: list[list[int]], budgets: list[int], steps: list[int], options: dict[str, Any]
    ) -> list[list[Hyp]]:
        """One asynchronous CTranslate2 call per distinct number of steps, so the calls queue back
        to back. A hypothesis of a source with a target prefix gets log-probability None (to be
        rescored): CTranslate2's own score leaves the prefix out."""
        eos = self.tokenizer.tgt.id_to_piece(EOS)
        options = dict(options)
        prefix = options.pop("target_prefix", None)
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(steps):
            groups.setdefault(n, []).append(i)
        pending = [
            (
                members,
                self.model.translate_batch(
                    [self.tokenizer.src.id_to_piece(ids[i]) for i in members],
                    max_decoding_length=n,
                    asynchronous=True,
                    **options,
                    **({} if prefix is None else {"target_prefix": [prefix[i] for i in members]}),
                ),
            )
            for n, members in groups.items()
        ]
        out: list[list[Hyp]] = [[] for _ in ids]
        for members, results in pending:
            for i, r in zip(members, results):
                r = r.result()
                out[i] = [
                    _hypothesis(h, s, eos, budgets[i], options["length_penalty"])
                    for h, s in zip(r.hypotheses, r.scores)
                ]
                if prefix is not None and prefix[i]:
                    out[i] = [(p, None, tl) for p, _, tl in out[i]]
        return out

    def _score(self, src_ids: list[list[int]], tgt_pieces: list[list[str]]) -> list[list[float]]:
        src = [self.tokenizer.src.id_to_piece(x) for x in src_ids]
        results = self.model.score_batch(src, tgt_pieces, max_input_length=0)
        return [list(r.log_probs) for r in results]


def _rank(pieces: list[str], logprob: float, options: DecodeOptions) -> float:
    """What ranks a hypothesis, as in our search: log P / lp(|Y| + 1) under beam search, else
    log P."""
    return logprob / length_penalty(len(pieces) + 1, options.alpha) if options.searches else logprob


def _stop_if(should_stop: Callable[[], bool]) -> None:
    if should_stop():
        raise Cancelled("stopped between CTranslate2's passes")


def _penalty(alpha: float) -> float:
    """CTranslate2's length penalty (score / |Y|^p) for our GNMT alpha. It must not be 0: with 0
    CTranslate2 stops once its best hypothesis is finished, where ours (and its own with a penalty)
    waits for `beam` finished ones. It also decides which `beam` of up to 2 x beam - 1 finished
    hypotheses a search that ended before its budget returns, so p approximates GNMT's ratios over
    usual lengths: log((5 + 20) / (5 + 5)) = 0.66 log(20 / 5).

    What can still differ from our search (scripts/ct2_agreement.py measures it): our best
    hypothesis left out by that choice (the two penalties rank it differently); at the budget, a
    live hypothesis that took the place of one ending in EOS one step before and none of whose
    extensions is among CTranslate2's best `beam` at the budget; a model that puts PAD or BOS among
    its best candidates (searched again with them suppressed, see _by_budget); and near-ties that
    float rounding orders differently in the two engines."""
    return max(alpha * 0.66, 1e-3)


def _hypothesis(pieces: list[str], score: float, eos: str, budget: int, lp: float) -> Hyp:
    """(pieces without EOS, log-probability or None when cut at the budget, [])."""
    if pieces and pieces[-1] == eos and len(pieces) <= budget:
        return pieces[:-1], score * len(pieces) ** lp, []  # undo CTranslate2's length normalisation
    return pieces[: budget - 1], None, []


def _unique(hyps: list[Hyp]) -> list[Hyp]:
    """Hypotheses with distinct pieces, a known log-probability preferred to None."""
    out: dict[tuple[str, ...], Hyp] = {}
    for h in hyps:
        key = tuple(h[0])
        if key not in out or out[key][1] is None:
            out[key] = h
    return list(out.values())


def _device(ct2: Any, device: str) -> str:
    if device == "auto":
        return "cuda" if ct2.get_cuda_device_count() > 0 else "cpu"
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: CTranslate2 runs on cpu or cuda")
    return device


def load_ct2_engine(
    checkpoint: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    device: str = "auto",
    precision: str | None = None,
) -> CT2Engine:
    """CTranslate2 for an export directory, or for a checkpoint / run directory (exported once, as
    float32, into the run's ct2-cache/; CTranslate2 converts to the compute type on load)."""
    if checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike)):
        if len(checkpoint) > 1:
            raise ExportError(
                "CTranslate2 decodes one model: ensembles need --engine torch (or average the "
                "checkpoints with tmt average)"
            )
        checkpoint = checkpoint[0]
    if checkpoint is not None and is_export(checkpoint):
        directory = Path(checkpoint)
    else:
        path = resolve_checkpoint(checkpoint)
        directory = cached_export(path, run_dir_of(path) / "ct2-cache")
    return CT2Engine(directory, device=device, precision=precision)
