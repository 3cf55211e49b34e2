"""`make bench`, serving row: requests/s and p50/p95 latency of `tmt serve` at 1, 8 and 32
concurrent clients, one sentence per request, against one-at-a-time serving of the same requests.

The model is the Multi30k recipe's (runs/multi30k_en_de, from `make bench-quality`) when it exists,
else the demo's (runs/demo, from `make demo`), unless --checkpoint names another; requests are the
first sentences of its test set (or of --src). Each concurrency level runs `--rounds` times,
interleaved, and the table gives medians. Writes the `serving` section of BENCHMARKS.md and
bench_serve.json.

usage: python -m scripts.bench_serve [--requests 256] [--rounds 3] [--checkpoint RUN --src FILE]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from scripts.benchlib import (
    BENCHMARKS,
    ROOT,
    TMT,
    cpu_model,
    logger,
    md_table,
    medians,
    now,
    read_json,
    run_test_source,
    write_json,
    write_section,
)

log = logger("bench_serve")


def default_run() -> Path:
    """The recipe's model, else the demo's."""
    for run in (ROOT / "runs" / "multi30k_en_de", ROOT / "runs" / "demo"):
        if (run / "checkpoints" / "best.pt").is_file():
            return run
    sys.exit("bench_serve: no model: run `make demo` (or `make bench-quality`) first")


def post(url: str, line: str) -> tuple[int, float]:
    """One one-sentence request: its status and latency in seconds."""
    start = time.perf_counter()
    body = json.dumps({"text": [line]}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    return status, time.perf_counter() - start


def load(url: str, lines: list[str], clients: int) -> dict:
    """Every line once, from `clients` threads at a time: requests/s, latency percentiles,
    errors."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda line: post(url, line), lines))
    seconds = time.perf_counter() - start
    latencies = sorted(t for _, t in results)
    return {
        "requests_per_s": len(lines) / seconds,
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p95_ms": 1000 * latencies[int(0.95 * (len(latencies) - 1))],
        "errors": sum(status != 200 for status, _ in results),
    }


def serve(run: Path) -> tuple[subprocess.Popen, str]:
    """`tmt serve` on a free loopback port, once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [*TMT, "serve", "-c", str(run), "--port", str(port), "--max-queue", "1024"]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if server.poll() is not None:
            sys.exit(f"bench_serve: tmt serve exited with {server.returncode}")
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return server, url
        except OSError:
            time.sleep(0.2)
    server.kill()
    sys.exit("bench_serve: tmt serve did not answer /health within two minutes")


def measure(run: Path, lines: list[str], levels: list[int], rounds: int) -> dict[int, list]:
    """Every level `rounds` times, interleaved, against one server."""
    server, url = serve(run)
    try:
        post(url + "/translate", lines[0])  # warm-up
        runs: dict[int, list[dict]] = {c: [] for c in levels}
        for r in range(rounds):
            for clients in levels:
                runs[clients].append(load(url + "/translate", lines, clients))
                rate = runs[clients][-1]["requests_per_s"]
                log(f"round {r + 1}: {clients} clients: {rate:.1f} req/s")
        return runs
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)


def write_report(res: dict, path: Path) -> str:
    """The `serving` section, from the JSON alone."""
    levels = res["levels"]
    one = levels[min(levels, key=int)]["requests_per_s"]
    rows = [
        (c, f"{v['requests_per_s']:.1f}", f"{v['requests_per_s'] / one:.2f}x")
        + (f"{v['p50_ms']:.0f}", f"{v['p95_ms']:.0f}", v["errors"])
        for c, v in levels.items()
    ]
    head = ["concurrent clients", "requests/s", "× one at a time", "p50 ms", "p95 ms"]
    best, v = max(levels.items(), key=lambda kv: kv[1]["requests_per_s"])
    return write_section(
        path,
        "serving",
        "## Serving (`tmt serve`, `scripts/bench_serve.py`)",
        f"{res['date']}, {res['cpu']}, {res['cores']} cores; model `{res['model']}`; "
        f"{res['requests']} requests of one sentence each, beam search with the run's settings; "
        f"medians of {res['rounds']} interleaved rounds. One client at a time is one-at-a-time "
        "serving: each request is its own batch.",
        md_table([*head, "error responses"], rows, "rrrrrr"),
        f"With {best} clients the server answers {v['requests_per_s'] / one:.2f}x as many requests "
        "per second as one at a time: concurrent requests share batches.",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench_serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32], help="levels")
    ap.add_argument("--checkpoint", type=Path, help="run directory (default: recipe, else demo)")
    ap.add_argument("--src", type=Path, help="sentences to send (default: the model's test set)")
    ap.add_argument("--json", default=str(ROOT / "bench_serve.json"))
    ap.add_argument("--out", default=str(BENCHMARKS))
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from --json")
    args = ap.parse_args(argv)
    if args.report_only:
        write_report(read_json(args.json), Path(args.out))
        return 0
    from transformer_mt.data import read_lines

    run = args.checkpoint or default_run()
    lines = [s for s in read_lines(args.src or run_test_source(run)) if s.strip()]
    lines = lines[: args.requests]
    runs = measure(run, lines, args.clients, args.rounds)
    res = {
        "date": now(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "model": str(run.relative_to(ROOT)) if run.is_relative_to(ROOT) else str(run),
        "requests": len(lines),
        "rounds": args.rounds,
        "levels": {str(c): medians(v) | {"runs": v} for c, v in runs.items()},
    }
    write_json(args.json, res)
    write_report(res, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
