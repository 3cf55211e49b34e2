"""The server's batcher and request handling without a server or a model: a fake translator that
records its calls and holds the worker on a threading.Event, and the Starlette app called in-process
through ASGI. The work limit, the batch bounds, scheduling, cancellation between decoding steps, the
worker's health, and bodies no parser should choke on; every verdict follows from the order of
events, none from the clock."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from transformer_mt.config import Config, ModelConfig
from transformer_mt.data import pad_sources
from transformer_mt.decoding import DecodeOptions, Scored, Translation
from transformer_mt.model import Transformer
from transformer_mt.search import Cancelled, search
from transformer_mt.serve import (
    Batcher,
    Job,
    Limits,
    Refused,
    create_app,
    parse_body,
    translate_work,
)
from transformer_mt.vocab import EOS

pytest.importorskip("starlette")
WAIT = 30  # seconds: a guard against a hang, never a verdict


class FakeTokenizer:
    digest, joint, src_vocab_size, tgt_vocab_size = "fake", True, 100, 100

    def encode_src(self, lines: list[str]) -> list[list[int]]:
        return [[7] * len(line.split()) for line in lines]  # one piece a word

    encode_tgt = encode_src


class Fake:
    """A translator without a model: each line's translation is the line upper-cased. It records
    every call, and holds the worker in its first call until `release` is set when built with
    hold=True. With `steps`, a call runs that many 'decoding steps', asking should_stop before each,
    and pauses before step `pause_at` until `go` is set when a line reads "pause"."""

    checkpoint = Path("/srv/secret/place/run7/checkpoints/best.pt")
    members: tuple[Path, ...] = ()  # one model, not an ensemble
    step, parameters, name, precision, device, max_positions = (
        10,
        1000,
        "fake",
        "fp32",
        "cpu",
        64,
    )

    def __init__(self, hold: bool = False, steps: int = 0, pause_at: int = 3):
        self.config = Config()
        self.defaults = DecodeOptions.from_config(self.config.decode)
        self.tokenizer = FakeTokenizer()
        self.calls: list[tuple[list[str], dict[str, Any]]] = []
        self.entered, self.release, self.paused, self.go = (threading.Event() for _ in range(4))
        if not hold:
            self.release.set()
        self.steps, self.pause_at, self.steps_done = steps, pause_at, 0

    def translate(self, lines: list[str], **options: Any) -> list[list[Translation]]:
        should_stop = options.pop("should_stop", None)
        self.calls.append((list(lines), options))
        self.entered.set()
        assert self.release.wait(WAIT)
        for step in range(self.steps):
            if step == self.pause_at and "pause" in lines:
                self.paused.set()
                assert self.go.wait(WAIT)
            if should_stop is not None and should_stop():
                raise Cancelled("stopped")
            self.steps_done += 1
        return [[Translation(line.upper(), line.split(), -1.0, -1.0, [-0.5])] for line in lines]

    def score(self, sources: list[str], targets: list[str]) -> list[Scored]:
        self.calls.append((list(sources), {"targets": list(targets)}))
        return [Scored(s, t, -1.0, t.split(), [-1.0]) for s, t in zip(sources, targets)]


def texts(result: list) -> list[str]:
    return [hyps[0].text for hyps in result]


async def submit(
    batcher: Batcher,
    lines: list[str],
    options: Optional[dict] = None,
    *,
    kind: str = "translate",
    work: Optional[list[int]] = None,
) -> Job:
    loop = asyncio.get_running_loop()
    job = Job(
        kind,
        lines,
        {"beam": 2} if options is None else options,
        time.monotonic() + 3600,
        loop.create_future(),
        loop,
        work=work,
    )
    batcher.submit(job)
    return job


def run(coroutine: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coroutine, WAIT))


def limits(**changes: Any) -> Limits:
    return Limits(**{"batch_wait": 0.0, **changes})


async def settled(batcher: Batcher, pending: int = 0) -> dict[str, int]:
    """The stats once the worker has nothing left (a job leaves `pending` before its future is
    settled, so awaiting a job's answer is enough for that job; this waits for the dropped ones)."""
    while batcher.snapshot()["pending"] != pending:
        await asyncio.sleep(0.001)  # a poll: the worker's answers arrive through this loop
    return batcher.snapshot()


# --------------------------------------------------------------------------- the work limit and its
# pricing


def test_work_is_beam_times_the_output_budget_of_each_line():
    fake = Fake()
    options = {
        "beam": 2,
        "nbest": 1,
        "alpha": 0.6,
        "max_len": (1.0, 5),
        "attention": False,
        "alignment": False,
    }
    lines = ["a b c", "a b c d e f g h i j", ""]
    two, steps = translate_work(fake, lines, options)
    assert steps == [
        4 + 5,
        11 + 5,
        0,
    ]  # the output budgets: A x (pieces + EOS) + B, none for an empty line
    four = translate_work(fake, lines, {**options, "beam": 4})[0]
    assert two[2] == four[2] == 0
    assert two[0] < two[1]  # a longer source has a longer budget
    assert all(
        abs(f - 2 * t) <= 1 for t, f in zip(two, four)
    )  # linear in the beam (up to rounding up)
    longer = translate_work(fake, lines, {**options, "max_len": (2.0, 5)})[0]
    assert longer[0] > two[0] and longer[1] > two[1]
    shown = translate_work(fake, lines, {**options, "nbest": 2, "attention": True})[0]
    assert all(
        abs(s - 2 * t) <= 1 for t, s in zip(two, shown)
    )  # + the 2-best's teacher-forced passes


def test_a_request_over_the_work_limits_is_413_naming_the_flag_and_never_reaches_the_model():
    fake = Fake()
    app = create_app(fake, limits(max_work=2000, batch_work=400))
    status, body = run(
        call(app, "/translate", {"text": ["one two three four five"] * 40, "beam": 4})
    )
    assert status == 413 and "--max-work" in body["error"] and "2,000" in body["error"]
    status, body = run(call(app, "/translate", {"text": ["word " * 60], "beam": 8}))
    assert status == 413 and "--batch-work" in body["error"] and "line 1" in body["error"]
    status, body = run(call(app, "/score", {"source": ["a"] * 60, "target": ["word " * 60] * 60}))
    assert status == 413 and "--max-work" in body["error"]
    assert fake.calls == []


# --------------------------------------------------------------------------- batches and scheduling


def test_no_call_gets_more_than_batch_lines_even_from_jobs_held_for_another_batch():
    """Jobs of two kinds arriving while the worker is busy: the old worker held the second kind and
    later batched all of them without the line bound."""
    fake = Fake(hold=True)

    async def scenario() -> None:
        batcher = Batcher(fake, limits(batch_lines=4))
        batcher.start()
        first = await submit(batcher, ["busy"])
        assert fake.entered.wait(WAIT)  # the worker is in its first call
        jobs = [
            await submit(batcher, [f"{k} {i} {j}" for j in range(3)], {"beam": 2 + k % 2})
            for i in range(6)
            for k in (0, 1)
        ]
        score = await submit(
            batcher,
            [f"s{i}" for i in range(5)],
            {"targets": [f"t{i}" for i in range(5)]},
            kind="score",
        )
        fake.release.set()
        assert texts(await first.future) == ["BUSY"]
        for job in jobs:  # each request's lines come back whole and in order, however they were cut
            assert texts(await job.future) == [line.upper() for line in job.lines]
        assert [(s.source, s.target) for s in await score.future] == [
            (f"s{i}", f"t{i}") for i in range(5)
        ]
        batcher.stop()

    run(scenario())
    assert max(len(lines) for lines, _ in fake.calls) <= 4
    for (
        lines,
        options,
    ) in fake.calls:  # one kind of work and one set of options per call
        if "targets" not in options and lines != ["busy"]:
            assert {int(line.split()[0]) % 2 for line in lines} == {options["beam"] - 2}


def test_a_request_of_no_lines_is_answered_without_a_model_call():
    fake = Fake()

    async def scenario() -> None:
        batcher = Batcher(fake, limits())
        batcher.start()
        assert await (await submit(batcher, [])).future == []
        assert texts(await (await submit(batcher, ["a"])).future) == ["A"]
        batcher.stop()

    run(scenario())
    assert fake.calls == [(["a"], {"beam": 2})]


def test_a_job_is_counted_off_before_its_answer_goes_out(monkeypatch):
    """A client that holds its answer must see /health without it: what `pending` and the outcome
    counts say at the moment each job is answered (served, empty, or failed)."""
    fake = Fake()
    seen: list[dict[str, int]] = []
    finish = Job.finish

    def recording_finish(job: Job, *args: Any, **kwargs: Any) -> None:
        seen.append(batcher.snapshot())
        finish(job, *args, **kwargs)

    monkeypatch.setattr(Job, "finish", recording_finish)

    async def scenario() -> None:
        batcher.start()
        assert texts(await (await submit(batcher, ["a"])).future) == ["A"]
        assert await (await submit(batcher, [])).future == []
        loop = asyncio.get_running_loop()
        broken = Job("translate", ["b"], {}, time.monotonic() + 3600, loop.create_future(), loop)
        broken.key = lambda: 1 / 0  # a bug in the worker's own loop: this job fails with a 500
        batcher.submit(broken)
        with pytest.raises(Refused):
            await broken.future
        batcher.stop()

    batcher = Batcher(fake, limits())
    run(scenario())
    assert [(s["pending"], s["served"], s["failed"]) for s in seen] == [
        (0, 1, 0),
        (0, 2, 0),
        (0, 2, 1),
    ]


def test_a_long_request_is_served_in_chunks_and_a_short_one_rides_in_the_next_call():
    fake = Fake(hold=True)

    async def scenario() -> None:
        batcher = Batcher(fake, limits(batch_work=300))
        batcher.start()
        long = await submit(batcher, [f"long {i}" for i in range(10)], work=[100] * 10)
        assert fake.entered.wait(WAIT)
        short = await submit(batcher, ["short"], work=[10])
        other = await submit(batcher, ["other options"], {"beam": 5}, work=[10])
        fake.release.set()
        assert texts(await long.future) == [f"LONG {i}" for i in range(10)]
        assert texts(await short.future) == ["SHORT"] and texts(await other.future) == [
            "OTHER OPTIONS"
        ]
        batcher.stop()

    run(scenario())
    calls = [lines for lines, _ in fake.calls]
    assert calls[0] == [
        "long 0",
        "long 1",
        "long 2",
    ]  # 300 steps: a chunk, not the whole request
    assert calls[1] == [
        "short"
    ]  # the least-served first, in a call of its own: no chunk of the long one
    assert calls.index(["other options"]) <= 2  # not behind the rest of the long request
    assert all(len(lines) <= 3 for lines in calls)


# --------------------------------------------------------------------------- stopping work nobody
# waits for


@pytest.mark.parametrize("how", ["client left", "deadline passed"])
def test_a_running_search_stops_within_a_step_once_nobody_waits(how):
    fake = Fake(steps=100)

    async def scenario() -> None:
        batcher = Batcher(fake, limits())
        batcher.start()
        job = await submit(batcher, ["pause"])
        assert fake.paused.wait(WAIT)  # three steps done, the search is running
        if how == "client left":
            job.cancelled = True
        else:
            job.deadline = time.monotonic() - 1
        fake.go.set()
        stats = await settled(batcher)
        assert stats["dropped"] == 1 and stats["served"] == 0 and not job.future.done()
        batcher.stop()

    run(scenario())
    assert fake.steps_done == fake.pause_at  # stopped at the very next step


def test_a_search_goes_on_while_one_of_its_requests_still_waits():
    fake = Fake(hold=True, steps=20)

    async def scenario() -> None:
        batcher = Batcher(fake, limits())
        batcher.start()
        first = await submit(batcher, ["busy"])
        assert fake.entered.wait(WAIT)
        leaving, staying = (
            await submit(batcher, ["pause"]),
            await submit(batcher, ["stay"]),
        )
        fake.release.set()
        await first.future
        assert fake.paused.wait(WAIT)
        leaving.cancelled = True
        fake.go.set()
        assert texts(await staying.future) == ["STAY"]
        stats = await settled(batcher)
        assert stats["dropped"] == 1 and stats["served"] == 2
        batcher.stop()

    run(scenario())
    assert fake.calls[1][0] == ["pause", "stay"]


@pytest.mark.parametrize("beam", [1, 3])
def test_the_search_asks_should_stop_between_steps_and_stops_at_once(beam):
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(
            d_model=16,
            heads=2,
            encoder_layers=1,
            decoder_layers=1,
            d_ff=32,
            max_positions=64,
        ),
        30,
        30,
        True,
    ).eval()
    steps, asked = [], []
    decode_step = model.decode_step

    def counted(*args: Any, **kwargs: Any) -> Any:  # a step that never ends a sentence early
        steps.append(1)
        logits = decode_step(*args, **kwargs)
        logits[:, EOS] = -1e9
        return logits

    model.decode_step = counted
    ids = [[5, 6, 7, 8], [9, 10]]
    stop_on_third = lambda: asked.append(1) or len(asked) == 3  # noqa: E731
    d = Config().decode
    options = dict(beam=beam, alpha=d.alpha, max_len_a=d.max_len_a, max_len_b=d.max_len_b)
    with pytest.raises(Cancelled):
        search(model, pad_sources(ids), **options, should_stop=stop_on_third)
    assert len(steps) == 2  # two steps ran, the third was never started
    steps.clear()
    assert len(search(model, pad_sources(ids), **options, should_stop=lambda: False)) == 2
    assert len(steps) >= 2


# --------------------------------------------------------------------------- the worker's health


class Die(BaseException):
    """Escapes every `except Exception`: the worker thread dies of it."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_health_is_503_with_a_log_line_once_the_worker_died(caplog):
    fake = Fake()
    fake.translate = lambda lines, **options: (_ for _ in ()).throw(Die())
    app = create_app(fake, limits())
    batcher = app.state.batcher
    batcher.start()
    assert run(call(app, "/health", method="GET"))[0] == 200
    status, body = run(call(app, "/translate", {"text": ["a"]}))
    assert status == 500  # the request in hand is answered, not left to its deadline
    batcher.thread.join(WAIT)
    with caplog.at_level(logging.ERROR, logger="transformer_mt"):
        status, body = run(call(app, "/health", method="GET"))
    assert status == 503 and body["worker"] == "dead"
    assert any("worker thread is not running" in r.getMessage() for r in caplog.records)
    assert run(call(app, "/translate", {"text": ["a"]}))[0] == 503


def test_an_unexpected_error_in_the_worker_fails_that_batch_and_the_worker_goes_on():
    fake = Fake()

    async def scenario() -> None:
        batcher = Batcher(fake, limits())
        batcher.start()
        loop = asyncio.get_running_loop()
        broken = Job(
            "translate",
            ["a"],
            {"beam": 2},
            time.monotonic() + 3600,
            loop.create_future(),
            loop,
        )
        broken.key = lambda: 1 / 0  # a bug in the worker's own loop, outside any model call
        batcher.submit(broken)
        with pytest.raises(Refused) as refused:
            await broken.future
        assert refused.value.status == 500
        after = await submit(batcher, ["b"])
        assert texts(await after.future) == ["B"]
        assert batcher.alive() and batcher.snapshot()["worker_errors"] == 1
        batcher.stop()

    run(scenario())


def test_a_translator_answering_the_wrong_number_of_lines_fails_that_request_only():
    fake = Fake(hold=True)
    translate = fake.translate
    fake.translate = lambda lines, **o: (
        translate(lines, **o)[:-1] if "bad" in lines else translate(lines, **o)
    )

    async def scenario() -> None:
        batcher = Batcher(fake, limits())
        batcher.start()
        first = await submit(batcher, ["busy"])
        assert fake.entered.wait(WAIT)
        bad, good = await submit(batcher, ["x", "bad"]), await submit(batcher, ["good"])
        fake.release.set()
        await first.future
        with pytest.raises(Refused) as refused:
            await bad.future
        assert refused.value.status == 500
        assert texts(await good.future) == ["GOOD"]
        batcher.stop()

    run(scenario())
    assert ["good", "x", "bad"] in [
        lines for lines, _ in fake.calls
    ]  # they did share a call (the smaller first)


# --------------------------------------------------------------------------- bodies


async def call(
    app: Any,
    path: str,
    body: Any = None,
    *,
    method: str = "POST",
    parts: Optional[list[bytes]] = None,
    leaves: bool = False,
) -> tuple[int, Any]:
    """One request to the ASGI app, in-process: `parts` are the body's chunks (default: the JSON of
    `body`); with `leaves`, the client disconnects once they are sent (the last chunk promising
    more)."""
    parts = (
        parts
        if parts is not None
        else [body if isinstance(body, bytes) else json.dumps(body).encode()]
    )
    messages = [
        {"type": "http.request", "body": p, "more_body": leaves or i < len(parts) - 1}
        for i, p in enumerate(parts)
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict] = []

    async def receive() -> dict:
        if messages:
            return messages.pop(0)
        if leaves:
            return {"type": "http.disconnect"}
        await asyncio.Event().wait()  # the client stays (is_disconnected() cancels this wait)

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    return sent[0]["status"], json.loads(text) if text.startswith("{") else text


def deep(n: int) -> bytes:
    return b'{"text": ["a"], "x": ' + b"[" * n + b"]" * n + b"}"


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b'{"text": ["a"], "beam": 1' + b"0" * 5000 + b"}", "5001 digits"),
        (deep(5000), "nested too deeply"),
        (b'{"text": ["a"], "alpha": NaN}', "NaN is not a number"),
        (b'{"text": ["a"], "alpha": Infinity}', "Infinity is not a number"),
        (b'{"text": ["a"], "alpha": -Infinity}', "Infinity is not a number"),
        (b'{"text": ["a"], "alpha": 1e999}', "1e999 is out of range"),
        (
            b'{"text": ["a"], "beams": 5}',
            "beams is not a key of a /translate body (did you mean beam?)",
        ),
        (
            b'{"text": ["a"], "bogus": true}',
            "bogus is not a key of a /translate body (valid keys: text, beam",
        ),
        (b'{"text": ["\\ud800"]}', "not valid Unicode"),
        (b'{"text": ["\xff"]}', "not valid JSON"),
        (b'{"text": ["a"], "alpha": -0.5}', "alpha must be a number from 0"),
        (b'{"text": ["a"], "alpha": "high"}', "alpha must be a number"),
        (b'{"text": ["a"], "max_len": [1]}', "max_len must be [A, B]"),
        (b'{"text": ["a"], "max_len": [1, 2.5]}', "max_len must be [A, B]"),
        (b'{"text": ["a"], "max_len": [1, 100000]}', "max_len must be [A, B]"),
    ],
)
def test_a_malformed_translate_body_is_400_with_a_reason(raw, needle):
    fake = Fake()
    status, body = run(call(create_app(fake, limits()), "/translate", raw))
    assert status == 400 and needle in body["error"], body
    assert fake.calls == []


def test_a_malformed_score_body_is_400_naming_the_key():
    status, body = run(
        call(create_app(Fake(), limits()), "/score", {"source": ["a"], "targets": ["b"]})
    )
    assert (
        status == 400
        and "targets is not a key of a /score body (did you mean target?)" in body["error"]
    )


def test_parse_body_accepts_ordinary_json():
    assert parse_body(b'{"text": ["a"], "alpha": 0.5, "beam": 4}') == {
        "text": ["a"],
        "alpha": 0.5,
        "beam": 4,
    }
    with pytest.raises(Refused):
        parse_body(b"[1]")


def test_a_client_that_leaves_while_sending_its_body_is_one_log_line(caplog):
    fake = Fake()
    app = create_app(fake, limits())
    with caplog.at_level(logging.INFO, logger="transformer_mt"):
        run(call(app, "/translate", parts=[b'{"text": ["a b'], leaves=True))  # raises nothing
    lines = [r for r in caplog.records if r.name == "transformer_mt"]
    assert (
        len(lines) == 1
        and "left while sending" in lines[0].getMessage()
        and lines[0].exc_info is None
    )
    assert app.state.batcher.snapshot()["left"] == 1 and fake.calls == []


# --------------------------------------------------------------------------- options and what a
# client sees


def test_alpha_and_the_length_budget_are_per_request():
    fake = Fake()
    app = create_app(fake, limits())
    app.state.batcher.start()
    try:
        status, body = run(
            call(app, "/translate", {"text": ["a b"], "alpha": 0.25, "max_len": [2, 3]})
        )
        assert status == 200 and body["translations"][0]["hypotheses"][0]["text"] == "A B"
        assert run(call(app, "/translate", {"text": ["c"]}))[0] == 200
    finally:
        app.state.batcher.stop()
    asked, default = fake.calls[0][1], fake.calls[1][1]
    assert asked["alpha"] == 0.25 and tuple(asked["max_len"]) == (2.0, 3)
    d = fake.defaults
    assert default["alpha"] == d.alpha and tuple(default["max_len"]) == (
        d.max_len_a,
        d.max_len_b,
    )


def test_info_names_the_run_not_the_servers_directories():
    status, info = run(call(create_app(Fake(), limits()), "/info", method="GET"))
    assert status == 200 and info["checkpoint"] == "run7/best.pt" and info["run"] == "run7"
    assert "/srv" not in json.dumps(info) and "secret" not in json.dumps(info)
    assert info["limits"]["max_work"] == limits().max_work


# --------------------------------------------------------------------------- the soak benchmark's
# verdict


def test_the_soak_reports_its_targets_from_its_figures(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "scripts"))
    import soak_serve

    good = {
        "responses": {
            "one sentence": {"200": 90, "503": 2},
            "malformed": {"400": 5, "413": 3},
        },
        "worker": {
            "deaths": 0,
            "server_exited": False,
            "health_polls": {"200 alive": 300},
            "errors_survived": 0,
        },
        "rss_mb": {"start": 500.0, "end": 540.0, "growth": 0.08},
        "one_sentence": {"requests": 90, "p50_s": 0.3, "p95_s": 1.9, "max_s": 2.5},
    }
    assert all(soak_serve.verdict(good).values())
    bad = {
        **good,
        "responses": {**good["responses"], "long": {"500": 1}},
        "rss_mb": {**good["rss_mb"], "growth": 0.2},
        "one_sentence": {**good["one_sentence"], "p95_s": 2.1},
        "worker": {**good["worker"], "deaths": 1},
    }
    assert not any(soak_serve.verdict(bad).values())
    report = {
        **good,
        "date": "today",
        "cpu": "a CPU",
        "cores": 2,
        "cpu_flags": ["avx2"],
        "model": "runs/x",
        "minutes": 5,
        "limits": Limits().__dict__,
        "targets_met": soak_serve.verdict(good),
        "expensive_requests": [{"lines": 16, "beam": 5, "steps": 65000}],
    }
    soak_serve.write_report(report, tmp_path / "BENCHMARKS.md")
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "p95 1900 ms" in text and "+8.0%" in text and "not met" not in text


def test_the_model_leaves_a_core_to_the_http_side(monkeypatch):
    from transformer_mt.serve import model_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert (
        model_threads() == 1 == torch.get_num_threads()
    )  # 2 cores: one for the model, one for HTTP
    assert model_threads(2) == 2
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    assert model_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # read by torch when it starts: then left as it is
    torch.set_num_threads(2)
    assert model_threads() == 2


# --------------------------------------------------------------------------- prefixes (issue 24)


def test_the_server_takes_one_prefix_per_line_prices_it_and_batches_it_with_other_requests():
    pytest.importorskip("starlette")
    from transformer_mt.serve import Batcher, create_app, parse_translate, translate_work

    fake = Fake()
    app = create_app(fake, limits())
    status, body = run(call(app, "/translate", {"text": ["a b", "c"], "prefix": ["x"]}))
    assert status == 400 and "prefix" in body["error"] and not fake.calls
    text, parsed = parse_translate({"text": ["a b", "c"], "prefix": ["x\ny ", ""]}, limits(), fake)
    assert parsed["prefix"] == ["x y", ""]  # one line each, as text is
    text, parsed = parse_translate({"text": "a b", "prefix": "x"}, limits(), fake)
    assert text == ["a b"] and parsed["prefix"] == ["x"]
    assert "prefix" not in parse_translate({"text": ["a"], "prefix": [""]}, limits(), fake)[1]

    options = {"beam": 2, "nbest": 1, "max_len": (1.0, 2), "attention": False, "alignment": False}
    long = " ".join(["w"] * 20)
    assert translate_work(fake, ["a", ""], {**options, "prefix": [long, long]})[1] == [21, 0]
    assert translate_work(fake, ["a", ""], options)[1] == [4, 0]

    # A request with prefixes and one without share a call, each line with its own prefix.
    held = Fake(hold=True)

    async def scenario() -> None:
        batcher = Batcher(held, limits())
        batcher.start()
        first = await submit(batcher, ["one"], {"beam": 2})
        assert held.entered.wait(30)
        with_prefix = await submit(batcher, ["two", "three"], {"beam": 2, "prefix": ["P", ""]})
        without = await submit(batcher, ["four"], {"beam": 2})
        held.release.set()
        for job in (first, with_prefix, without):
            await job.future
        batcher.stop()

    run(scenario())
    lines, options = held.calls[1]  # one call, in the scheduler's order
    assert sorted(lines) == ["four", "three", "two"] and options["beam"] == 2
    assert dict(zip(lines, options["prefix"])) == {"two": "P", "three": "", "four": ""}
