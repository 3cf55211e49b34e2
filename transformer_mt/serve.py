"""`tmt serve`: a translation server with a web page (Starlette on uvicorn, the [serve] extra).

Requests wait in a bounded queue; one worker thread, the only one that runs the model, gathers what
is waiting (for a bounded time, up to a bounded number of lines) into one search call: concurrent
clients share batches, and a client that leaves or outlives its deadline costs nothing more.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .errors import UserError

if TYPE_CHECKING:  # imported late below: `tmt --help` builds this command's flags without loading torch
    from .translate import BaseTranslator, Translation

log = logging.getLogger("transformer_mt")
PAGE = Path(__file__).parent / "static" / "index.html"


def require_serve_extra() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UserError("tmt serve needs starlette and uvicorn: pip install 'transformer-mt[serve]'") from None


@dataclass(frozen=True)
class Limits:
    """What one request may ask, and how long the server holds work (the `tmt serve` flags)."""

    max_body: int = 1_000_000  # bytes of a request body
    max_lines: int = 64  # lines of one request
    max_queue: int = 64  # requests waiting or running; more get 503
    deadline: float = 30.0  # seconds a request may wait and run; then 504
    batch_wait: float = 0.01  # seconds the worker waits for more requests to join a batch
    batch_lines: int = 256  # lines of one batch


class Refused(Exception):
    """A request the server turns down: HTTP status, message, and headers."""

    def __init__(self, status: int, message: str, headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.headers = status, headers or {}


@dataclass
class Job:
    """One request's work: what to do, and where its answer goes."""

    kind: str  # "translate" or "score"
    lines: list[str]
    options: dict[str, Any]  # translate's options (jobs with equal options share a batch), or the targets
    deadline: float
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    cancelled: bool = False

    def key(self) -> tuple:
        return (self.kind, tuple(sorted(self.options.items()))) if self.kind == "translate" else ("score",)

    def finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        def settle() -> None:  # on the event loop's thread: futures are not thread-safe
            if self.future.done():
                return
            if error is not None:
                self.future.set_exception(error)
            else:
                self.future.set_result(result)

        self.loop.call_soon_threadsafe(settle)


@dataclass
class Batcher:
    """The bounded queue and the one worker thread that runs the model."""

    translator: BaseTranslator
    limits: Limits
    jobs: "queue.Queue[Optional[Job]]" = field(default_factory=queue.Queue)
    stats: dict[str, int] = field(default_factory=lambda: {"served": 0, "dropped": 0, "batches": 0, "pending": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._work, name="tmt-model", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.jobs.put(None)
        self.thread.join(timeout=60)

    def snapshot(self) -> dict[str, int]:
        with self.lock:
            return dict(self.stats)

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.stats["pending"] >= self.limits.max_queue:
                raise Refused(503, f"the queue is full ({self.limits.max_queue} requests): try again shortly",
                              {"Retry-After": "1"})
            self.stats["pending"] += 1
        self.jobs.put(job)

    def _work(self) -> None:
        held: list[Job] = []  # taken from the queue but waiting for a batch of their own kind
        while True:
            first = held.pop(0) if held else self.jobs.get()
            if first is None:
                return
            batch = [first] + [j for j in held if j is not None and j.key() == first.key()]
            held = [j for j in held if j not in batch]
            lines, stop_at = sum(len(j.lines) for j in batch), time.monotonic() + self.limits.batch_wait
            while lines < self.limits.batch_lines:
                try:
                    job = self.jobs.get(timeout=max(stop_at - time.monotonic(), 0))
                except queue.Empty:
                    break
                if job is None or job.key() != first.key() or lines + len(job.lines) > self.limits.batch_lines:
                    held.append(job)  # another kind of work, the stop mark, or one that would overflow
                    if job is None or lines + len(job.lines) > self.limits.batch_lines:
                        break
                    continue
                batch.append(job)
                lines += len(job.lines)
            self._run([j for j in batch if self._alive(j)])

    def _alive(self, job: Job) -> bool:
        """Drop work nobody waits for any more (the client left, or its deadline passed)."""
        if job.cancelled or time.monotonic() > job.deadline:
            self._done(job, dropped=True)
            return False
        return True

    def _run(self, batch: list[Job]) -> None:
        if not batch:
            return
        lines = [line for j in batch for line in j.lines]
        try:
            if batch[0].kind == "translate":
                results: list = self.translator.translate(lines, **batch[0].options)
            else:
                targets = [t for j in batch for t in j.options["targets"]]
                results = self.translator.score(lines, targets)
        except Exception as e:  # noqa: BLE001  a bad request fails itself, not the others or the server
            if len(batch) > 1:  # find the culprit: each request alone
                for j in batch:
                    self._run([j])
                return
            if not isinstance(e, UserError):
                log.exception("a request of %d lines failed", len(lines))
            batch[0].finish(error=e)
            self._done(batch[0])
            return
        with self.lock:
            self.stats["batches"] += 1
        start = 0
        for j in batch:
            j.finish(results[start:start + len(j.lines)])
            start += len(j.lines)
            self._done(j)

    def _done(self, job: Job, dropped: bool = False) -> None:
        with self.lock:
            self.stats["pending"] -= 1
            self.stats["dropped" if dropped else "served"] += 1


# --------------------------------------------------------------------------- requests


def parse_translate(body: dict[str, Any], limits: Limits, default_beam: int) -> tuple[list[str], dict[str, Any]]:
    """The lines and translate() options of a /translate body; Refused(400/413) when they are wrong."""
    text = _text_list(body, "text", limits)
    beam = _integer(body, "beam", default_beam, 1, max(64, default_beam))
    nbest = _integer(body, "nbest", 1, 1, beam)
    flags = {}
    for key in ("alignment", "attention"):
        flags[key] = body.get(key, False)
        if not isinstance(flags[key], bool):
            raise Refused(400, f"{key} must be true or false, got {flags[key]!r}")
    return text, {"beam": beam, "nbest": nbest, **flags}


def _text_list(body: dict[str, Any], key: str, limits: Limits) -> list[str]:
    value = body.get(key)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise Refused(400, f"{key} must be a string or a list of strings")
    if len(value) > limits.max_lines:
        raise Refused(413, f"{key} has {len(value)} lines; at most {limits.max_lines} per request")
    return [" ".join(x.split()) for x in value]  # one line each: newlines inside a string become spaces


def _integer(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise Refused(400, f"{key} must be an integer from {low} to {high}, got {value!r}")
    return value


def translation_json(source: str, hyps: list[Translation], attention: bool, alignment: bool) -> dict[str, Any]:
    import torch

    from .translate import word_attention, words_of

    out = []
    for h in hyps:
        item = h.to_json(alignment)
        if attention and h.attention is not None and h.pieces:
            weights = word_attention(torch.tensor(h.attention), h.source_pieces, h.pieces)
            item["attention"] = {"source": words_of(h.source_pieces), "target": words_of(h.pieces),
                                 "weights": [[round(w, 4) for w in row] for row in weights.tolist()]}
        out.append(item)
    return {"source": source, "hypotheses": out}


def model_info(translator: BaseTranslator) -> dict[str, Any]:
    cfg = translator.config
    return {"checkpoint": str(translator.checkpoint), "step": translator.step,
            "source_language": cfg.data.src_lang, "target_language": cfg.data.tgt_lang,
            "model": cfg.to_dict()["model"], "parameters": translator.parameters, "engine": translator.engine,
            "tokenizer": {"digest": translator.tokenizer.digest, "joint": translator.tokenizer.joint,
                          "source_vocabulary": translator.tokenizer.src_vocab_size,
                          "target_vocabulary": translator.tokenizer.tgt_vocab_size},
            "decode": cfg.to_dict()["decode"], "precision": translator.precision, "device": str(translator.device)}


# --------------------------------------------------------------------------- the application


def _due(limits: Limits) -> tuple[float, asyncio.Future, asyncio.AbstractEventLoop]:
    """A new job's deadline, its future and the loop that settles it (call on the event loop)."""
    loop = asyncio.get_running_loop()
    return time.monotonic() + limits.deadline, loop.create_future(), loop


async def answer(request: Any, batcher: Batcher, job: Job) -> list:
    """Queue the job and wait for it, watching its deadline and its client."""
    batcher.submit(job)
    while not job.future.done():
        await asyncio.wait([job.future], timeout=min(0.05, max(job.deadline - time.monotonic(), 0.001)))
        if job.future.done():
            break
        if await request.is_disconnected():
            job.cancelled = True  # the worker drops it unless it is already running
            raise Refused(499, "the client closed the connection")
        if time.monotonic() > job.deadline:
            job.cancelled = True
            raise Refused(504, f"not done within the {batcher.limits.deadline:g} s deadline")
    return job.future.result()


async def read_json(request: Any, limits: Limits) -> dict[str, Any]:
    """The request's JSON object, read up to limits.max_body bytes."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limits.max_body:
        raise Refused(413, f"the body has {size} bytes; at most {limits.max_body}")
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limits.max_body:
            raise Refused(413, f"the body is over {limits.max_body} bytes")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise Refused(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise Refused(400, "the body must be a JSON object")
    return body


def create_app(translator: BaseTranslator, limits: Limits = Limits()) -> Any:
    """The Starlette application: the page, the JSON API, and the batcher's life."""
    import contextlib

    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, JSONResponse, Response
    from starlette.routing import Route

    batcher = Batcher(translator, limits)

    async def translate(request: Request) -> Response:
        text, options = parse_translate(await read_json(request, limits), limits, translator.decode.beam)
        results = await answer(request, batcher, Job("translate", text, options, *_due(limits)))
        return JSONResponse({"translations": [translation_json(s, h, options["attention"], options["alignment"])
                                              for s, h in zip(text, results)]})

    async def score(request: Request) -> Response:
        body = await read_json(request, limits)
        sources, targets = _text_list(body, "source", limits), _text_list(body, "target", limits)
        if len(sources) != len(targets):
            raise Refused(400, f"source has {len(sources)} lines but target has {len(targets)}")
        scored = await answer(request, batcher, Job("score", sources, {"targets": targets}, *_due(limits)))
        tokens = sum(len(s.token_logprobs) for s in scored)
        return JSONResponse({"scores": [s.to_json() for s in scored],
                             "perplexity": math.exp(-sum(s.logprob for s in scored) / max(tokens, 1))})

    async def refused(request: Request, exc: Refused) -> Response:
        return JSONResponse({"error": str(exc)}, status_code=exc.status, headers=exc.headers)

    async def bad_input(request: Request, exc: UserError) -> Response:  # e.g. a target too long to score
        return JSONResponse({"error": str(exc)}, status_code=400)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        batcher.start()
        yield
        batcher.stop()

    info = model_info(translator)
    routes = [Route("/", lambda r: HTMLResponse(PAGE.read_text(encoding="utf-8"))),
              Route("/health", lambda r: JSONResponse({"status": "ok", **batcher.snapshot()})),
              Route("/info", lambda r: JSONResponse(info)),
              Route("/translate", translate, methods=["POST"]), Route("/score", score, methods=["POST"])]
    return Starlette(routes=routes, exception_handlers={Refused: refused, UserError: bad_input}, lifespan=lifespan)


def serve(translator: BaseTranslator, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits = Limits()) -> None:
    """Run until SIGINT/SIGTERM: uvicorn then stops accepting, finishes what is in flight, and returns."""
    import uvicorn

    log.info("serving %s on http://%s:%d/ (model in one worker thread; queue %d, deadline %g s)",
             translator.checkpoint, host, port, limits.max_queue, limits.deadline)
    uvicorn.run(create_app(translator, limits), host=host, port=port, log_level="warning",
                timeout_graceful_shutdown=int(limits.deadline) + 5)
