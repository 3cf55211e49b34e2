"""`make bench`, soak row: `tmt serve` on the loopback under minutes of mixed traffic, bounded in
time and in count: one-sentence and long requests, n-best lists with attention, /score, malformed
and oversized bodies, clients that leave mid-request, a client that sends its body slowly, and one
client that keeps sending the most expensive request the server's limits allow (from /info, priced
with the server's own pricing).

It records the responses by status, the p50/p95 latency of the one-sentence requests (all sent while
the expensive client runs), the worker's health (/health every second: deaths, and errors it
survived), and the server's resident memory after the warm-up and at the end (VmRSS in
/proc/PID/status); writes bench_soak.json and its section of BENCHMARKS.md from that JSON; and
prints whether the targets are met: no 500, no worker death, RSS growth <= 10%, p95 of one-sentence
requests <= 2 s.

The model is the Multi30k recipe's (runs/multi30k_en_de) unless --checkpoint names another;
sentences are the Multi30k test set's when ../shared/data has it, else the run's own test split.

usage: python -m scripts.soak_serve [--checkpoint RUN] [--minutes 5] [--json bench_soak.json]
       [--out BENCHMARKS.md] [--max-work N --batch-work N --max-lines N]
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

from scripts.benchlib import (
    BENCHMARKS,
    ROOT,
    TEST_PREFIX,
    TMT,
    cpu_model,
    md_table,
    now,
    read_json,
    reported_flags,
    run_test_source,
    write_json,
    write_section,
)
from transformer_mt.checkpoint import resolve_checkpoint, run_dir_of
from transformer_mt.data import read_lines
from transformer_mt.errors import UserError
from transformer_mt.serve import call_work, translate_work
from transformer_mt.tokenizer import Tokenizer

MULTI30K = Path(f"{TEST_PREFIX}.en.gz")
TARGETS = {"p95_s": 2.0, "rss_growth": 0.10}
MAX_REQUESTS = 20_000  # per client: the soak is bounded in count as well as in time


@dataclass
class Tally:
    """What the clients saw: responses by client and status, and the latencies of one-sentence
    requests."""

    statuses: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    one_sentence: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, client: str, status: Any, seconds: float | None = None) -> None:
        with self.lock:
            self.statuses[client][str(status)] += 1
            if seconds is not None:
                self.one_sentence.append(seconds)


class Server:
    """`tmt serve` in a subprocess on a free loopback port."""

    def __init__(self, checkpoint: Path, options: list[str] = ()):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"soak_serve_{self.port}.log", "w")
        cmd = [*TMT, "serve", "-c", str(checkpoint), "--host", "127.0.0.1"]
        self.proc = subprocess.Popen(
            [*cmd, "--port", str(self.port), *options],
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        for _ in range(600):
            if self.proc.poll() is not None:
                sys.exit(
                    f"soak_serve: tmt serve exited with {self.proc.returncode}: see {self.log.name}"
                )
            try:
                if self.health()[0] == 200:
                    return
            except OSError:
                time.sleep(0.2)
        sys.exit("soak_serve: tmt serve did not answer /health within two minutes")

    def get(self, path: str) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def health(self) -> tuple[int, dict]:
        return self.get("/health")

    def rss_mb(self) -> float:
        """The server's resident memory (VmRSS), in MB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError("no VmRSS in /proc/PID/status")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def post(url: str, body: bytes | dict, timeout: float) -> int:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def raw_request(
    port: int,
    body: bytes,
    *,
    send: int,
    pause: float = 0.0,
    pieces: int = 1,
    read: bool = True,
    timeout: float = 120,
) -> Any:
    """POST /translate over a plain socket: the first `send` bytes of the body in `pieces` (a pause
    after each), then the status line's code if `read`, else nothing (the client leaves)."""
    head = (
        "POST /translate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
        f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        step = max(1, -(-send // pieces))
        for at in range(0, send, step):
            s.sendall(body[at : at + step])
            time.sleep(pause)
        if not read:
            return "left"
        first = s.recv(64)
        return int(first.split()[1]) if first.startswith(b"HTTP/") else "no answer"


# --------------------------------------------------------------------------- what the clients send


def sentences(run: Path) -> list[str]:
    """The Multi30k test set's sources when ../shared has them, else the run's own test split's."""
    lines = read_lines(MULTI30K if MULTI30K.is_file() else run_test_source(run))
    return [s for s in lines if s.strip()]


def most_expensive(
    pool: list[str],
    price: Callable[[list[str], dict], tuple[list[int], list[int]]],
    options: dict,
    limits: dict,
) -> dict:
    """A request of these options as close to the limits as the pool allows: lines as long as one
    call may be (batch_work), as many as the request may hold (max_lines, max_work)."""

    def alone(line: str) -> int:
        work, steps = price([line], options)
        return call_work(work[0], steps[0])

    lines: list[str] = []
    ordered = sorted(pool, key=len, reverse=True)
    for i in range(len(ordered)):
        line = ordered[i]
        for extra in ordered[i + 1 : i + 40]:  # lengthen it while one call still holds it
            if alone(f"{line} {extra}") > limits["batch_work"]:
                break
            line = f"{line} {extra}"
        if alone(line) > limits["batch_work"]:
            continue
        work, steps = price(lines + [line], options)
        if (
            len(lines) == limits["max_lines"]
            or call_work(sum(work), max(steps)) > limits["max_work"]
        ):
            break
        lines.append(line)
    return {"text": lines, **options}


def malformed(limits: dict, over_work: dict) -> list[bytes]:
    """Bodies every one of which must be a 400 or a 413."""
    deep = b'{"text": ["a"], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    return [
        b"{not json",
        b"[1, 2]",
        b'{"text": ["a"], "alpha": NaN}',
        b'{"text": ["a"], "beam": Infinity}',
        b'{"text": ["a"], "beam": 1' + b"0" * 5000 + b"}",
        deep,
        b'{"text": ["a"], "beams": 5}',
        b'{"text": ["\\ud800"]}',
        b'{"text": ["\xff"]}',
        b'{"text": 3}',
        json.dumps({"text": ["a"] * (limits["max_lines"] + 1)}).encode(),
        json.dumps(over_work).encode(),
    ]


# --------------------------------------------------------------------------- the clients


@dataclass
class Soak:
    server: Server
    pool: list[str]
    info: dict
    expensive: list[dict]
    end: float = 0.0
    tally: Tally = field(default_factory=Tally)
    health: collections.Counter = field(default_factory=collections.Counter)

    @property
    def timeout(self) -> float:
        return self.info["limits"]["deadline"] + 60

    def loop(
        self,
        name: str,
        send: Callable[[random.Random], Any],
        seed: int,
        pause: float = 0.0,
    ) -> None:
        rng = random.Random(seed)
        for _ in range(MAX_REQUESTS):
            if time.monotonic() >= self.end:
                return
            try:
                send(rng)
            except OSError as e:  # a refused or reset connection is a result too
                self.tally.add(name, f"error {type(e).__name__}")
            time.sleep(rng.uniform(0, pause))

    def one_sentence(self, rng: random.Random) -> None:
        start = time.perf_counter()
        status = post(
            self.server.url + "/translate",
            {"text": [rng.choice(self.pool)]},
            self.timeout,
        )
        self.tally.add(
            "one sentence",
            status,
            time.perf_counter() - start if status == 200 else None,
        )

    def long(self, rng: random.Random) -> None:
        most = self.info["limits"]["max_lines"]
        n = rng.randint(min(16, most), most)  # 16 lines or more, where the server takes them
        self.tally.add(
            "long",
            post(
                self.server.url + "/translate",
                {"text": rng.sample(self.pool, n)},
                self.timeout,
            ),
        )

    def nbest(self, rng: random.Random) -> None:
        beam = self.info["decode"]["beam"]
        body = {
            "text": rng.sample(self.pool, rng.randint(1, 4)),
            "beam": beam,
            "nbest": min(3, beam),
            "attention": rng.random() < 0.5,
            "alignment": rng.random() < 0.5,
        }
        self.tally.add("n-best", post(self.server.url + "/translate", body, self.timeout))

    def score(self, rng: random.Random) -> None:
        pairs = rng.sample(self.pool, rng.randint(1, 8))
        body = {"source": pairs, "target": [rng.choice(self.pool) for _ in pairs]}
        self.tally.add("score", post(self.server.url + "/score", body, self.timeout))

    def bad(self, rng: random.Random) -> None:
        bodies = malformed(
            self.info["limits"],
            {**self.expensive[0], "beam": 2 * self.expensive[0]["beam"]},
        )
        if rng.random() < 0.1:
            # a body over max_body: its length is refused before it is sent (a sender that went
            # on would meet a closed socket)
            big = b"{" + b" " * self.info["limits"]["max_body"] + b"}"
            self.tally.add(
                "malformed",
                raw_request(self.server.port, big, send=0, timeout=self.timeout),
            )
        else:
            self.tally.add(
                "malformed",
                post(self.server.url + "/translate", rng.choice(bodies), self.timeout),
            )

    def leaving(self, rng: random.Random) -> None:
        body = json.dumps({"text": rng.sample(self.pool, 8)}).encode()
        half = rng.random() < 0.5  # leave mid-body, or once the whole request is in
        self.tally.add(
            "leaves",
            raw_request(
                self.server.port,
                body,
                send=len(body) // 2 if half else len(body),
                pause=rng.uniform(0, 0.3),
                read=False,
            ),
        )

    def slow(self, rng: random.Random) -> None:
        body = json.dumps({"text": rng.sample(self.pool, 2)}).encode()
        self.tally.add(
            "slow body",
            raw_request(
                self.server.port,
                body,
                send=len(body),
                pieces=10,
                pause=0.2,
                timeout=self.timeout,
            ),
        )

    def most_expensive(self, rng: random.Random) -> None:
        body = self.expensive[rng.randrange(len(self.expensive))]
        self.tally.add("most expensive", post(self.server.url + "/translate", body, self.timeout))

    def watch(self) -> None:
        """/health every second: a 503 (or no answer) is the worker (or the server) down."""
        while time.monotonic() < self.end:
            try:
                status, body = self.server.health()
                self.health[f"{status} {body.get('worker', '')}".strip()] += 1
            except OSError as e:
                self.health[f"error {type(e).__name__}"] += 1
            time.sleep(1.0)

    def clients(self) -> list[tuple[str, Callable, float]]:
        return [("one sentence", self.one_sentence, 0.2)] * 3 + [
            ("long", self.long, 0.5),
            ("n-best", self.nbest, 0.5),
            ("score", self.score, 0.5),
            ("malformed", self.bad, 0.2),
            ("leaves", self.leaving, 0.5),
            ("slow body", self.slow, 0.0),
            ("most expensive", self.most_expensive, 0.0),
        ]

    def warm_up(self) -> None:
        """Every kind of request once, every expensive shape included: the memory baseline comes
        after."""
        for name, send, _ in self.clients()[2:]:
            send(random.Random(0))
        for i in range(1, len(self.expensive)):
            self.tally.add(
                "most expensive",
                post(self.server.url + "/translate", self.expensive[i], self.timeout),
            )
        self.tally = Tally()

    def run(self, minutes: float) -> None:
        self.end = time.monotonic() + 60 * minutes
        with concurrent.futures.ThreadPoolExecutor(len(self.clients()) + 1) as pool:
            jobs = [
                pool.submit(self.loop, name, send, seed, pause)
                for seed, (name, send, pause) in enumerate(self.clients())
            ] + [pool.submit(self.watch)]
            for job in jobs:
                job.result()


# --------------------------------------------------------------------------- figures and report


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def verdict(result: dict) -> dict[str, bool]:
    """Each target, met or not, from the figures."""
    statuses = collections.Counter()
    for by_status in result["responses"].values():
        statuses.update(by_status)
    p95 = result["one_sentence"]["p95_s"]
    return {
        "no 500": statuses.get("500", 0) == 0,
        "no worker death": result["worker"]["deaths"] == 0
        and result["worker"]["server_exited"] is False,
        f"RSS growth <= {TARGETS['rss_growth']:.0%}": (
            result["rss_mb"]["growth"] is not None
            and result["rss_mb"]["growth"] <= TARGETS["rss_growth"]
        ),
        f"p95 of one-sentence requests <= {TARGETS['p95_s']:g} s": p95 is not None
        and p95 <= TARGETS["p95_s"],
    }


# tmt serve's limits this soak may set (default: the server's own)
LIMITS = {"max_work": int, "batch_work": int, "max_lines": int, "deadline": float}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.soak_serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--checkpoint",
        default=str(ROOT / "runs" / "multi30k_en_de"),
        help="run directory or checkpoint (default: runs/multi30k_en_de, the recipe model)",
    )
    parser.add_argument("--minutes", type=float, default=5.0, help="mixed traffic (default: 5)")
    for limit, kind in LIMITS.items():
        parser.add_argument(f"--{limit.replace('_', '-')}", type=kind, help="tmt serve's")
    parser.add_argument("--json", default=str(ROOT / "bench_soak.json"))
    parser.add_argument("--out", default=str(BENCHMARKS))
    parser.add_argument("--report-only", action="store_true", help="rewrite --out from --json")
    args = parser.parse_args(argv)
    if args.report_only:
        write_report(read_json(args.json), Path(args.out))
        return 0
    try:
        checkpoint = resolve_checkpoint(args.checkpoint)
    except UserError as e:
        sys.exit(f"soak_serve: {e} (the recipe model comes from `make bench-quality`)")
    run = run_dir_of(checkpoint)
    given = {k: getattr(args, k) for k in LIMITS if getattr(args, k) is not None}
    options = [a for k, v in given.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    server = Server(checkpoint, options)
    try:
        result = soak(server, run, sentences(run), args.minutes)
    finally:
        if server.proc.poll() is None:
            server.stop()
    result["model"] = str(run.relative_to(ROOT)) if run.is_relative_to(ROOT) else run.name
    result["default_limits"] = not given
    result["targets_met"] = verdict(result)
    write_json(args.json, result)
    write_report(result, Path(args.out))
    for target, met in result["targets_met"].items():
        print(f"[soak_serve] {target}: {'met' if met else 'NOT met'}")
    return 0  # the report says which targets were missed; `make bench` goes on to its next row


def soak(server: Server, run: Path, pool: list[str], minutes: float) -> dict:
    """Warm up, take the memory baseline, run the traffic, and gather the figures."""
    info = server.get("/info")[1]
    limits = info["limits"]
    decode = info["decode"]
    priced = SimpleNamespace(
        tokenizer=Tokenizer.load(run), max_positions=info["model"]["max_positions"]
    )
    base = {
        "nbest": 1,
        "alpha": decode["alpha"],
        "max_len": (decode["max_len_a"], decode["max_len_b"]),
        "attention": False,
        "alignment": False,
    }

    def price(lines: list[str], options: dict) -> tuple[list[int], list[int]]:
        return translate_work(priced, lines, {**base, **options})

    shapes = [
        {"beam": decode["beam"]},
        {"beam": max(64, decode["beam"])},
        {"beam": 16, "nbest": 16, "attention": True, "alignment": True},
    ]
    expensive = [most_expensive(pool, price, shape, limits) for shape in shapes]
    expensive = [e for e in expensive if e["text"]]
    state = Soak(server, pool, info, expensive)
    start = time.monotonic()
    state.warm_up()
    rss_start = server.rss_mb()
    print(
        f"[soak_serve] {server.url}: warm, {rss_start:.0f} MB; {minutes:g} min of traffic",
        flush=True,
    )
    state.run(minutes)
    rss_end = server.rss_mb() if server.proc.poll() is None else None
    exited = server.proc.poll() is not None
    stats = server.health()[1] if not exited else {}
    one = state.tally.one_sentence
    return {
        "date": now(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cpu_flags": reported_flags(),
        "minutes": minutes,
        "seconds": round(time.monotonic() - start, 1),
        "limits": limits,
        "decode": decode,
        "expensive_requests": [
            {
                "lines": len(e["text"]),
                **{k: v for k, v in e.items() if k != "text"},
                "steps": call_work(sum(work), max(steps)),
            }
            for e in expensive
            for work, steps in [price(e["text"], e)]
        ],
        "responses": {k: dict(v) for k, v in sorted(state.tally.statuses.items())},
        "one_sentence": {
            "requests": len(one),
            "p50_s": percentile(one, 0.5),
            "p95_s": percentile(one, 0.95),
            "max_s": max(one, default=None),
        },
        "worker": {
            "health_polls": dict(state.health),
            "deaths": sum(n for k, n in state.health.items() if not k.startswith("200")),
            "errors_survived": stats.get("worker_errors"),
            "server_exited": exited,
        },
        "server_stats": stats,
        "rss_mb": {
            "start": round(rss_start, 1),
            "end": rss_end and round(rss_end, 1),
            "growth": (rss_end - rss_start) / rss_start if rss_end else None,
        },
    }


def write_report(res: dict, path: Path) -> str:
    """The `soak` section, from the JSON alone."""
    rows = [
        (client, sum(by.values()), ", ".join(f"{s}: {n}" for s, n in sorted(by.items())))
        for client, by in res["responses"].items()
    ]
    one, rss, worker, limits = res["one_sentence"], res["rss_mb"], res["worker"], res["limits"]

    def ms(s: float | None) -> str:
        return "–" if s is None else f"{1000 * s:.0f}"

    shapes = "; ".join(
        f"{e['lines']} lines at beam {e['beam']}"
        + (f", {e['nbest']}-best with attention" if e.get("attention") else "")
        + f" ({e['steps']:,} steps)"
        for e in res["expensive_requests"]
    )
    met = "; ".join(
        f"{t}: {'met' if ok else '**not met**'}" for t, ok in res["targets_met"].items()
    )
    growth = "–" if rss["growth"] is None else f"{100 * rss['growth']:+.1f}%"
    which = "default " if res.get("default_limits", True) else ""
    return write_section(
        path,
        "soak",
        "## Serving under load (`tmt serve`, `scripts/soak_serve.py`)",
        f"{res['date']}, {res['cpu']} ({', '.join(res['cpu_flags']) or 'no AVX2'}), {res['cores']} "
        f"cores; model `{res['model']}`; {res['minutes']:g} minutes of mixed traffic on the "
        f"loopback after a warm-up, with the server's {which}limits ({limits['max_work']:,} steps "
        f"a request, {limits['batch_work']:,} a model call, {limits['max_lines']} lines, "
        f"{limits['deadline']:g} s deadline). The most expensive client cycled through {shapes}.",
        md_table(["client", "requests", "responses by status"], rows, "lrl"),
        f"One-sentence requests: {one['requests']} answered, p50 {ms(one['p50_s'])} ms, p95 "
        f"{ms(one['p95_s'])} ms, max {ms(one['max_s'])} ms. Worker: {worker['deaths']} health "
        f"checks not OK of {sum(worker['health_polls'].values())}, {worker['errors_survived']} "
        f"errors survived. Server memory (VmRSS): {rss['start']} MB after the warm-up, "
        f"{rss['end']} MB at the end ({growth}).",
        f"Targets: {met}.",
    )


if __name__ == "__main__":
    sys.exit(main())
