"""`tmt serve`: a translation server with a web page (Starlette on uvicorn, the [serve] extra).

How the work is bounded and shared:
- **Priced before it is queued.** Work is counted in *steps*, the unit the search pays: one
  hypothesis taking one decoding step. A line costs beam x its output budget (A x source pieces + B,
  capped at model.max_positions) steps, each weighted by 1 + (positions attended) / ATTENTION_UNIT
  (attention over a long source and prefix); attention and alignment add the n-best's teacher-forced
  passes, and a /score pair costs its target's length. A model call also pays STEP_OVERHEAD steps
  for each decoding step it takes, whatever its batch (a step's fixed cost, which dominates a call
  of one short line). A request over `max_work` steps as one call, or with a line over `batch_work`
  as a call of its own, is a 413 naming the `tmt serve` flag that raises the limit.
- **Cut into chunks, least-served first.** One worker thread, the only one that runs the model,
  keeps the jobs it took from the queue. Each model call (a batch) starts with the job that has
  received the least work so far (the smallest, among equals), and tops it up with the next lines of
  jobs of the same kind and options, up to `batch_lines` lines and `batch_work` steps (waiting up to
  `batch_wait` for more to arrive); a call that finishes its first job takes only jobs it finishes
  too. A long request is so served in chunks that interleave with newer ones: a new one-sentence
  request waits for the call in progress (at most `batch_work` steps), then rides in a short call
  with the other new small requests, however much is queued.
- **Stopped when nobody waits.** A call's search asks between decoding steps whether any of its jobs
  still has a client within its deadline (`should_stop`), and stops within a step when none has;
  jobs whose client left or whose deadline passed are dropped before their next chunk.
- **Survives its own failures.** A failing call is retried request by request, so a bad request
  fails alone (400 for a user error, 500 otherwise, as does a translator that answers the wrong
  number of lines); an unexpected error in the worker's own loop fails the batch in hand with 500
  and the worker goes on; if its thread dies anyway, /health answers 503 and new requests are
  refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .errors import UserError

# imported late below: `tmt --help` builds this command's flags without loading torch
if TYPE_CHECKING:
    from .decoding import Translation
    from .inference import Translator

log = logging.getLogger("transformer_mt")
PAGE = Path(__file__).parent / "static" / "index.html"
# Fitted to calls of ~4,096 steps on a model of the recipe's shape (4+4 layers, d_model 128, 8k
# vocabulary) on one CPU thread: 1 line of 1,000 pieces at beam 1, 1 of 130 or 22 of 16 at beam 5,
# 113 at beam 1, 1 at beam 64 all took 0.16-0.30 ms a step (beam 64 the dearest), where beam x
# budget alone differed up to 4-fold:
ATTENTION_UNIT = 640  # attended positions that cost as much as the rest of a hypothesis's step
STEP_OVERHEAD = 16  # steps' worth of fixed cost of each decoding step of a call
MAX_ALPHA, MAX_LEN_A = 5.0, 10.0  # per-request ranges of the length penalty and of the budget's A
TRANSLATE_KEYS = (
    "text",
    "beam",
    "nbest",
    "alpha",
    "max_len",
    "alignment",
    "attention",
    "prefix",
)
SCORE_KEYS = ("source", "target")


def require_serve_extra() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError(
            "tmt serve needs starlette and uvicorn: pip install 'transformer-mt[serve]'"
        ) from None


@dataclass(frozen=True)
class Limits:
    """What one request may ask, and how long the server holds work (the `tmt serve` flags).

    The work defaults are sized for the recipe model (4+4 layers, d_model 128, beam 5) on 2 CPU
    cores: a call of batch_work steps took 0.8 s on one core of a 2-core Xeon shared with a training
    run (0.16-0.30 ms a step, whatever the call's shape), a few times less on an idle machine; a
    one-sentence request waits for the call in progress and a short one of its own, well within the
    2 s that scripts/soak_serve.py checks. One call holds a line of up to ~140 pieces at beam 5;
    max_work lets 64 Multi30k sentences at beam 5 (about 10,000 steps) through six times over."""

    max_body: int = 1_000_000  # bytes of a request body
    max_lines: int = 64  # lines of one request
    max_queue: int = 64  # requests waiting or running; more get 503
    deadline: float = 30.0  # seconds a request may wait and run; then 504
    batch_wait: float = 0.01  # seconds the worker waits for more requests to join a batch
    batch_lines: int = 256  # lines of one model call
    max_work: int = 65_536  # steps of one request (module docstring)
    batch_work: int = 4_096  # steps of one model call, and so of one line


class Refused(Exception):
    """A request the server turns down: HTTP status, message, and headers."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


@dataclass(eq=False)  # compared by identity: a job is one request
class Job:
    """One request's work: what to do, what each line costs, how far it got, and where its answer
    goes."""

    kind: str  # "translate" or "score"
    lines: list[str]
    # translate's options (jobs with equal options share a batch), or the targets
    options: dict[str, Any]
    deadline: float
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    work: list[int] | None = None  # steps of each line (None: one each)
    steps: list[int] | None = None  # decoding steps (output budget) of each line; 0 when scored
    cancelled: bool = False  # its client left, or its deadline was seen to pass
    results: list = field(default_factory=list)  # the answers of lines[:len(results)]
    served: int = 0  # decoding steps done for it so far: the least-served job goes first

    def __post_init__(self) -> None:
        if self.work is None:
            self.work = [1] * len(self.lines)
        if self.steps is None:
            self.steps = [0] * len(self.lines)

    def key(self) -> tuple:
        return (
            # per-line prefixes do not split batches: _call takes each line's
            (self.kind, tuple(sorted((k, v) for k, v in self.options.items() if k != "prefix")))
            if self.kind == "translate"
            else ("score",)
        )

    def dead(self) -> bool:
        """Nobody waits for this any more: the client left or the deadline passed."""
        return self.cancelled or time.monotonic() > self.deadline

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        def settle() -> None:  # on the event loop's thread: futures are not thread-safe
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the loop has closed (the server stopped): nobody to tell
            pass


Slice = tuple[Job, int, int]  # a job's lines[start:end] in one model call


class WrongCount(Exception):
    """The translator answered a different number of lines than it was given."""


@dataclass
class Batcher:
    """The bounded queue and the one worker thread that runs the model (the scheduling: module
    docstring)."""

    translator: Translator
    limits: Limits
    jobs: "queue.Queue[Job | None]" = field(default_factory=queue.Queue)
    stats: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            (
                "served",
                "dropped",
                "failed",
                "batches",
                "pending",
                "left",
                "receiving",
                "worker_errors",
            ),
            0,
        )
    )
    lock: threading.Lock = field(default_factory=threading.Lock)
    # taken from the queue, not finished (worker thread only)
    active: list[Job] = field(default_factory=list)
    # the jobs of the batch in hand (worker thread only)
    running: list[Job] = field(default_factory=list)
    stopping: bool = False
    thread: threading.Thread | None = None
    death_reported: bool = False

    def start(self) -> None:
        self.thread = threading.Thread(target=self._work, name="tmt-model", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        if self.thread is not None:
            self.thread.join(timeout=60)

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.stats)

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.stats[key] += n

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /health: 503 once the worker thread has died (logged the first
        time)."""
        if self.alive():
            return 200, {"status": "ok", "worker": "alive", **self.snapshot()}
        if not self.death_reported:
            self.death_reported = True
            log.error(
                "the model's worker thread is not running: /health answers 503; restart tmt serve"
            )
        return 503, {
            "status": "the model's worker is not running",
            "worker": "dead",
            **self.snapshot(),
        }

    def submit(self, job: Job) -> None:
        if not self.alive():
            raise Refused(503, "the model's worker is not running: the server needs a restart")
        with self.lock:
            if self.stats["pending"] >= self.limits.max_queue:
                raise Refused(
                    503,
                    f"the queue is full ({self.limits.max_queue} requests): try again shortly",
                    {"Retry-After": "1"},
                )
            self.stats["pending"] += 1
        self.jobs.put(job)

    # ----------------------------------------------------------------------------- the worker
    # thread

    def _work(self) -> None:
        while True:
            try:
                if not self._step():
                    return
            except Exception:  # our own bug: fail what was in hand, keep serving the rest
                log.exception(
                    "the model's worker hit an unexpected error; the requests of that batch get 500"
                )
                self.count("worker_errors")
                self._fail(self.running or list(self.active))
            # the thread dies: nobody may wait for an answer that will not come
            except BaseException:
                log.critical(
                    "the model's worker thread died; /health now answers 503", exc_info=True
                )
                self._take(block=False)
                self._fail(list(self.active))
                raise
            finally:
                self.running = []

    def _step(self) -> bool:
        """Take what is queued, drop what nobody waits for, run one batch; False once stopped and
        idle."""
        self._take(block=not self.active and not self.stopping)
        for job in [j for j in self.active if j.dead()]:
            self._remove(job, "dropped")
        # no lines: nothing to run
        for job in [j for j in self.active if len(j.results) == len(j.lines)]:
            self._answer(job, "served", job.results)
        if not self.active:
            return not self.stopping
        self._run(self._gather())
        return True

    def _take(self, block: bool) -> None:
        """Move the queued jobs to `active` (waiting for one when `block`); the stop mark sets
        `stopping`."""
        while True:
            try:
                job = self.jobs.get(block=block)
            except queue.Empty:
                return
            block = False
            if job is None:
                self.stopping = True
            else:
                self.active.append(job)

    def _gather(self) -> list[Slice]:
        """The next batch: the next lines of the least-served job (of the smallest, among equals),
        topped up with the next lines of jobs of the same kind and options, within batch_lines lines
        and batch_work steps (waiting batch_wait for more). A batch that finishes its first job
        takes only jobs it finishes too, so a short request never waits for a chunk of a long one in
        its own call."""
        # stable: then arrival order
        self.active.sort(key=lambda j: (j.served, sum(j.work[len(j.results) :])))
        key, limits = self.active[0].key(), self.limits
        batch: list[Slice] = []
        lines = work = steps = 0
        whole = True  # every job in the batch so far ends in it
        candidates, stop_at = list(self.active), time.monotonic() + limits.batch_wait
        while True:
            for job in candidates:
                if job.key() != key:
                    continue
                start = end = len(job.results)
                n, w, t = lines, work, steps
                while (
                    end < len(job.lines)
                    and n < limits.batch_lines
                    and (
                        call_work(w + job.work[end], max(t, job.steps[end])) <= limits.batch_work
                        or not batch
                        and end == start
                    )
                ):
                    n, w, t, end = n + 1, w + job.work[end], max(t, job.steps[end]), end + 1
                if end > start and (end == len(job.lines) or not batch or not whole):
                    batch.append((job, start, end))
                    lines, work, steps, whole = n, w, t, whole and end == len(job.lines)
            if (
                lines >= limits.batch_lines
                or call_work(work, steps) >= limits.batch_work
                or self.stopping
            ):
                return batch
            try:
                job = self.jobs.get(timeout=max(stop_at - time.monotonic(), 0))
            except queue.Empty:
                return batch
            if job is None:
                self.stopping = True
                return batch
            self.active.append(job)
            candidates = [job]

    def _run(self, batch: list[Slice]) -> None:
        """One model call over the batch's live jobs, its results handed out; a failed call is
        retried request by request."""
        batch = self._drop_dead(batch)
        if not batch:
            return
        self.running = [j for j, _, _ in batch]
        try:
            results = self._call(batch)
        except Exception as e:  # a bad request fails itself, not the others or the server
            self._after_failure(batch, e)
            return
        self.count("batches")
        self._distribute(batch, results)

    def _drop_dead(self, batch: list[Slice]) -> list[Slice]:
        """The batch without the jobs nobody waits for any more (dropped before the call)."""
        for job in {j: None for j, _, _ in batch if j.dead()}:
            self._remove(job, "dropped")
        return [s for s in batch if s[0] in self.active]

    def _after_failure(self, batch: list[Slice], error: Exception) -> None:
        """A failed call: drop it if nobody waits, else rerun each request alone so that only the
        culprit fails."""
        # stopped between steps (search.Cancelled): nobody waits
        if all(j.dead() for j, _, _ in batch):
            for j, _, _ in batch:
                self._remove(j, "dropped")
        elif len(batch) > 1:  # find the culprit: each request alone
            for s in batch:
                self._run([s])
        else:
            if not isinstance(error, UserError):
                log.error(
                    "a request of %d lines failed: %s",
                    len(batch[0][0].lines),
                    error,
                    exc_info=not isinstance(error, WrongCount),
                )
            self._fail([batch[0][0]], error)

    def _distribute(self, batch: list[Slice], results: list) -> None:
        """Give each job its share of the call's results, answering those now complete."""
        at = 0
        for job, start, end in batch:
            answers, at = results[at : at + end - start], at + end - start
            # its client left (or its deadline passed) while the others kept the search going
            if job.dead():
                self._remove(job, "dropped")
                continue
            job.results.extend(answers)
            job.served += sum(job.work[start:end])
            if len(job.results) == len(job.lines):
                self._answer(job, "served", job.results)

    def _call(self, batch: list[Slice]) -> list:
        """One model call over the batch's lines; it stops between decoding steps once all its jobs
        are dead."""
        jobs = [j for j, _, _ in batch]
        lines = [line for j, start, end in batch for line in j.lines[start:end]]
        if jobs[0].kind == "translate":
            options = {k: v for k, v in jobs[0].options.items() if k != "prefix"}
            if any("prefix" in j.options for j in jobs):
                options["prefix"] = [
                    p
                    for j, start, end in batch
                    for p in j.options.get("prefix", [""] * len(j.lines))[start:end]
                ]
            results = self.translator.translate(
                lines, **options, should_stop=lambda: all(j.dead() for j in jobs)
            )
        else:
            targets = [t for j, start, end in batch for t in j.options["targets"][start:end]]
            results = self.translator.score(lines, targets)
        if len(results) != len(lines):
            raise WrongCount(
                f"the translator answered {len(results)} results for {len(lines)} lines"
            )
        return results

    def _fail(self, jobs: Sequence[Job], error: BaseException | None = None) -> None:
        """Answer each job not answered yet with its error: a user error as it is (400), anything
        else 500."""
        for job in [j for j in dict.fromkeys(jobs) if j in self.active]:
            self._answer(
                job,
                "failed",
                error=error
                if isinstance(error, UserError)
                else Refused(500, "the server failed on this request; its log says why"),
            )

    def _answer(
        self, job: Job, outcome: str, result: Any = None, error: BaseException | None = None
    ) -> None:
        """Count the job off, then answer it: a client that holds its answer sees /health
        without it."""
        self._remove(job, outcome)
        job.finish(result, error)

    def _remove(self, job: Job, outcome: str) -> None:
        """Take a job off the worker's list and count how it ended (once: a job not on the list is
        done)."""
        if job not in self.active:
            return
        self.active.remove(job)
        with self.lock:
            self.stats["pending"] -= 1
            self.stats[outcome] += 1


# --------------------------------------------------------------------------- requests


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; Refused(400) for anything else (NaN, Infinity, numbers out
    of range, integers of hundreds of digits, nesting too deep for the parser)."""
    try:
        body = json.loads(
            raw, parse_constant=_no_constant, parse_float=_finite, parse_int=_short_int
        )
    except RecursionError:
        raise Refused(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError and ours are ValueErrors
        raise Refused(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    return body


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is out of range")
    return value


def _short_int(text: str) -> int:
    if len(text) > 30:
        raise ValueError(f"an integer of {len(text)} digits")
    return int(text)


def check_keys(body: dict[str, Any], allowed: Sequence[str], endpoint: str) -> None:
    """Refuse keys the endpoint does not know, naming the closest one (as the config does)."""
    for key in body:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = (
                f" (did you mean {close[0]}?)" if close else f" (valid keys: {', '.join(allowed)})"
            )
            raise Refused(400, f"{key} is not a key of a {endpoint} body{hint}")


def parse_translate(
    body: dict[str, Any], limits: Limits, translator: Any
) -> tuple[list[str], dict[str, Any]]:
    """The lines and translate() options of a /translate body; Refused(400/413) when they are wrong.
    Omitted options take the server's decode settings, so equal requests share batches."""
    check_keys(body, TRANSLATE_KEYS, "/translate")
    decode = translator.defaults
    text = _text_list(body, "text", limits)
    beam = _integer(body, "beam", decode.beam, 1, max(64, decode.beam))
    nbest = _integer(body, "nbest", 1, 1, beam)
    alpha = _number(body, "alpha", decode.alpha, 0.0, max(MAX_ALPHA, decode.alpha))
    max_len = body.get("max_len", [decode.max_len_a, decode.max_len_b])
    top = translator.max_positions
    if not (
        isinstance(max_len, list)
        and len(max_len) == 2
        and all(_is_number(x) for x in max_len)
        and 0 <= max_len[0] <= MAX_LEN_A
        and max_len[1] == int(max_len[1])
        and 1 <= max_len[1] <= top
    ):
        raise Refused(
            400,
            "max_len must be [A, B]: output at most A x source length + B tokens, A from 0 to "
            f"{MAX_LEN_A:g}, B a whole number from 1 to {top}; got {max_len!r}",
        )
    flags: dict[str, Any] = {}
    for key in ("alignment", "attention"):
        flags[key] = body.get(key, False)
        if not isinstance(flags[key], bool):
            raise Refused(400, f"{key} must be true or false, got {flags[key]!r}")
    if "prefix" in body:
        prefix = _text_list(body, "prefix", limits)
        if len(prefix) != len(text):
            raise Refused(
                400, f"text has {len(text)} lines but prefix has {len(prefix)}: one per line"
            )
        if any(prefix):  # all empty: the same as none
            flags["prefix"] = prefix
    return text, {
        "beam": beam,
        "nbest": nbest,
        "alpha": float(alpha),
        "max_len": (float(max_len[0]), int(max_len[1])),
        **flags,
    }


def parse_score(body: dict[str, Any], limits: Limits) -> tuple[list[str], list[str]]:
    """The (sources, targets) of a /score body; Refused(400/413) when they are wrong."""
    check_keys(body, SCORE_KEYS, "/score")
    sources, targets = _text_list(body, "source", limits), _text_list(body, "target", limits)
    if len(sources) != len(targets):
        raise Refused(400, f"source has {len(sources)} lines but target has {len(targets)}")
    return sources, targets


def line_work(source: int, rows: int, steps: int) -> int:
    """Steps of `rows` hypotheses over `steps` decoding steps for a source of `source` pieces (EOS
    included), each weighted by the positions it attends to (the source and, on average, half the
    output so far)."""
    return math.ceil(rows * steps * (1 + (source + steps / 2) / ATTENTION_UNIT))


def call_work(work: int, steps: int) -> int:
    """Steps of a model call over lines of `work` steps in all, the longest taking `steps` decoding
    steps."""
    return work + STEP_OVERHEAD * steps


def translate_work(
    translator: Any, lines: list[str], options: dict[str, Any]
) -> tuple[list[int], list[int]]:
    """(steps, decoding steps) of each line: beam x its output budget (search.max_output_len's, of
    the source as translate cuts it, at least a target prefix's pieces + 1), plus the n-best's
    teacher-forced passes when attention or alignment is asked for."""
    import torch

    from .search import max_output_len

    a, b = options["max_len"]
    top = translator.max_positions
    rows = options["beam"] + (
        options["nbest"] if options["attention"] or options["alignment"] else 0
    )
    ids = translator.tokenizer.encode_src([line.strip() for line in lines])
    sources = [min(len(x), top - 1) + 1 for x in ids]
    prefix = options.get("prefix")
    room = (
        None
        if not prefix
        else torch.tensor([len(p) for p in translator.tokenizer.encode_tgt(prefix)])
    )
    budgets = max_output_len(torch.tensor(sources), a, b, top, room).tolist()
    steps = [budget if x else 0 for x, budget in zip(ids, budgets)]  # an empty line: no search
    return [line_work(s, rows, n) for s, n in zip(sources, steps)], steps


def score_work(
    translator: Any, sources: list[str], targets: list[str]
) -> tuple[list[int], list[int]]:
    """(steps, 0) of scoring each pair: one hypothesis over its target, in one pass (no decoding
    steps)."""
    top = translator.max_positions
    src = translator.tokenizer.encode_src([s.strip() for s in sources])
    tgt = translator.tokenizer.encode_tgt([t.strip() for t in targets])
    return [
        line_work(min(len(s), top - 1) + 1, 1, min(len(t) + 1, top)) for s, t in zip(src, tgt)
    ], [0] * len(src)


def check_work(work: list[int], steps: list[int], limits: Limits) -> None:
    """Refuse (413) a request over max_work steps, or with a line over batch_work (a line is never
    split)."""
    alone = [call_work(w, s) for w, s in zip(work, steps)]
    if alone and max(alone) > limits.batch_work:
        i = alone.index(max(alone))
        raise Refused(
            413,
            f"line {i + 1} alone needs {alone[i]:,} decoding steps; at most {limits.batch_work:,} "
            "per line (tmt serve --batch-work): shorten it, or ask a smaller beam or max_len",
        )
    total = call_work(sum(work), max(steps, default=0))
    if total > limits.max_work:
        raise Refused(
            413,
            f"this request needs {total:,} decoding steps (beam x output budget of each line); at "
            f"most {limits.max_work:,} per request (tmt serve --max-work): send fewer lines, or "
            "ask a smaller beam or max_len",
        )


def _text_list(body: dict[str, Any], key: str, limits: Limits) -> list[str]:
    value = body.get(key)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise Refused(400, f"{key} must be a string or a list of strings")
    if len(value) > limits.max_lines:
        raise Refused(
            413,
            f"{key} has {len(value)} lines; at most {limits.max_lines} per request (tmt serve "
            "--max-lines)",
        )
    for i, x in enumerate(value):
        try:
            x.encode("utf-8")
        # a lone surrogate ("\ud800"), which JSON allows and UTF-8 does not
        except UnicodeEncodeError:
            raise Refused(
                400, f"{key} line {i + 1} is not valid Unicode (a lone surrogate)"
            ) from None
    # one line each: newlines inside a string become spaces
    return [" ".join(x.split()) for x in value]


def _integer(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Refused(400, f"{key} must be an integer from {low} to {high}, got {value!r}")
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key, default)
    if not _is_number(value) or not low <= value <= high:
        raise Refused(400, f"{key} must be a number from {low:g} to {high:g}, got {value!r}")
    return value


def translation_json(
    source: str, hyps: list[Translation], attention: bool, alignment: bool
) -> dict[str, Any]:
    import torch

    from .decoding import word_attention, words_of

    out = []
    for h in hyps:
        item = h.to_json(alignment)
        if attention and h.attention is not None and h.pieces:
            weights = word_attention(torch.tensor(h.attention), h.source_pieces, h.pieces)
            item["attention"] = {
                "source": words_of(h.source_pieces),
                "target": words_of(h.pieces),
                "weights": [[round(w, 4) for w in row] for row in weights.tolist()],
            }
        out.append(item)
    return {"source": source, "hypotheses": out}


def checkpoint_name(path: Path | None) -> str | None:
    """RUN/FILE: which model this is, without the server's directories (…/RUN/checkpoints/FILE or
    …/RUN/FILE; an ensemble run's member RUN/members/N/FILE)."""
    if path is None:
        return None
    path = Path(path)
    run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    if run.parent.name == "members":
        return f"{run.parent.parent.name}/members/{run.name}/{path.name}"
    return f"{run.name}/{path.name}"


def model_info(translator: Translator, limits: Limits = Limits()) -> dict[str, Any]:
    cfg = translator.config
    name = checkpoint_name(translator.checkpoint)
    return {
        "checkpoint": name,
        "run": name.split("/")[0] if name else None,
        "step": translator.step,
        **(
            {"ensemble": [checkpoint_name(m) for m in translator.members]}
            if translator.members
            else {}
        ),
        "source_language": cfg.data.src_lang,
        "target_language": cfg.data.tgt_lang,
        "model": cfg.to_dict()["model"],
        "parameters": translator.parameters,
        "engine": translator.name,
        "tokenizer": {
            "digest": translator.tokenizer.digest,
            "joint": translator.tokenizer.joint,
            "source_vocabulary": translator.tokenizer.src_vocab_size,
            "target_vocabulary": translator.tokenizer.tgt_vocab_size,
        },
        "decode": dataclasses.asdict(translator.defaults),
        "precision": translator.precision,
        "device": str(translator.device),
        "limits": dataclasses.asdict(limits),
    }


# --------------------------------------------------------------------------- the application


def _due(limits: Limits) -> tuple[float, asyncio.Future, asyncio.AbstractEventLoop]:
    """A new job's deadline, its future and the loop that settles it (call on the event loop)."""
    loop = asyncio.get_running_loop()
    return time.monotonic() + limits.deadline, loop.create_future(), loop


async def answer(request: Any, batcher: Batcher, job: Job) -> list:
    """Queue the job and wait for it, watching its deadline, its client and the worker."""
    batcher.submit(job)
    while not job.future.done():
        await asyncio.wait(
            [job.future], timeout=min(0.05, max(job.deadline - time.monotonic(), 0.001))
        )
        if job.future.done():
            break
        if await request.is_disconnected():
            job.cancelled = True  # the worker drops it, or stops its search within a step
            batcher.count("left")
            raise Refused(499, "the client closed the connection")
        if time.monotonic() > job.deadline:
            job.cancelled = True
            raise Refused(504, f"not done within the {batcher.limits.deadline:g} s deadline")
        if not batcher.alive():
            raise Refused(503, "the model's worker is not running: the server needs a restart")
    return job.future.result()


async def read_json(request: Any, limits: Limits, batcher: Batcher) -> dict[str, Any]:
    """The request's JSON object, read up to limits.max_body bytes; a client that leaves meanwhile
    is one log line (499, which nobody reads)."""
    from starlette.requests import ClientDisconnect

    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limits.max_body:
        raise Refused(
            413, f"the body has {size} bytes; at most {limits.max_body} (tmt serve --max-body)"
        )
    raw = bytearray()
    batcher.count("receiving")
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limits.max_body:
                raise Refused(
                    413, f"the body is over {limits.max_body} bytes (tmt serve --max-body)"
                )
    except ClientDisconnect:
        log.info("a client left while sending its request to %s", request.url.path)
        batcher.count("left")
        raise Refused(499, "the client closed the connection") from None
    finally:
        batcher.count("receiving", -1)
    return parse_body(bytes(raw))


def create_app(translator: Translator, limits: Limits = Limits()) -> Any:
    """The Starlette application: the page, the JSON API, and the batcher's life."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    batcher = Batcher(translator, limits)

    async def refused(request: Request, exc: Refused) -> Response:
        return JSONResponse({"error": str(exc)}, status_code=exc.status, headers=exc.headers)

    # e.g. a target too long to score
    async def bad_input(request: Request, exc: UserError) -> Response:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        batcher.start()
        yield
        batcher.stop()

    info = model_info(translator, limits)
    routes = [
        Route("/", lambda r: HTMLResponse(PAGE.read_text(encoding="utf-8"))),
        Route("/info", lambda r: JSONResponse(info)),
        *_api_routes(translator, limits, batcher),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={Refused: refused, UserError: bad_input},
        lifespan=lifespan,
    )
    app.state.batcher = batcher  # for tests and tools that look inside
    return app


def _api_routes(translator: Translator, limits: Limits, batcher: Batcher) -> list:
    """POST /translate, POST /score and GET /health: requests priced, queued and answered."""
    from starlette.concurrency import run_in_threadpool
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def translate(request: Request) -> Response:
        text, options = parse_translate(
            await read_json(request, limits, batcher), limits, translator
        )
        # tokenizes: off the loop
        work, steps = await run_in_threadpool(translate_work, translator, text, options)
        check_work(work, steps, limits)
        job = Job("translate", text, options, *_due(limits), work=work, steps=steps)
        results = await answer(request, batcher, job)
        return JSONResponse(
            {
                "translations": [
                    translation_json(s, h, options["attention"], options["alignment"])
                    for s, h in zip(text, results)
                ]
            }
        )

    async def score(request: Request) -> Response:
        sources, targets = parse_score(await read_json(request, limits, batcher), limits)
        work, steps = await run_in_threadpool(score_work, translator, sources, targets)
        check_work(work, steps, limits)
        job = Job("score", sources, {"targets": targets}, *_due(limits), work=work, steps=steps)
        scored = await answer(request, batcher, job)
        tokens = sum(len(s.token_logprobs) for s in scored)
        return JSONResponse(
            {
                "scores": [s.to_json() for s in scored],
                "perplexity": math.exp(-sum(s.logprob for s in scored) / max(tokens, 1)),
            }
        )

    async def health(request: Request) -> Response:
        status, body = batcher.health()
        return JSONResponse(body, status_code=status)

    return [
        Route("/health", health),
        Route("/translate", translate, methods=["POST"]),
        Route("/score", score, methods=["POST"]),
    ]


def model_threads(threads: int | None = None) -> int:
    """Set the model's CPU threads (call before loading it): `threads`, else one less than the cores
    this process may use, so that the event loop (HTTP, JSON, tokenizing) keeps a core and the
    model's threads never wait for it (on 2 cores, two model threads beside a busy event loop
    doubled the p95 latency: scripts/soak_serve.py); an OMP_NUM_THREADS in the environment is left
    as it is."""
    import os

    import torch

    from .runtime import set_threads

    if threads is None and "OMP_NUM_THREADS" in os.environ:
        return torch.get_num_threads()
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    set_threads(threads or max(1, cores - 1))
    return torch.get_num_threads()


def serve(
    translator: Translator,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    limits: Limits = Limits(),
) -> None:
    """Run until SIGINT/SIGTERM: uvicorn then stops accepting, finishes what is in flight, and
    returns."""
    import torch
    import uvicorn

    log.info(
        "serving %s on http://%s:%d/ (model in one worker thread on %d CPU threads; queue %d, "
        "deadline %g s, %d steps a request, %d a call)",
        translator.checkpoint,
        host,
        port,
        torch.get_num_threads(),
        limits.max_queue,
        limits.deadline,
        limits.max_work,
        limits.batch_work,
    )
    uvicorn.run(
        create_app(translator, limits),
        host=host,
        port=port,
        log_level="warning",
        timeout_graceful_shutdown=int(limits.deadline) + 5,
    )
