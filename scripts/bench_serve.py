"""`make bench`, serving row: requests/s and p50/p95 latency of `tmt serve` at 1, 8 and 32
concurrent clients, one sentence per request, against one-at-a-time serving of the same requests.

The model is the Multi30k recipe's (runs/multi30k_en_de, from `make bench-quality`) when it exists,
else the demo's (runs/demo, from `make demo`); requests are the first sentences of its test set.
Each concurrency level runs `--rounds` times, interleaved, and the table gives medians.

usage: python scripts/bench_serve.py [--requests 256] [--rounds 3] [--json bench_serve.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchlib import cpu_model, replace_section  # noqa: E402

from transformer_mt.data import read_lines  # noqa: E402

MULTI30K = ROOT.parent / "shared" / "data" / "multi30k"


def model_and_sentences(n: int) -> tuple[Path, list[str]]:
    if (ROOT / "runs" / "multi30k_en_de" / "checkpoints" / "best.pt").is_file():
        return ROOT / "runs" / "multi30k_en_de", read_lines(MULTI30K / "test_2016_flickr.en.gz")[:n]
    if (ROOT / "runs" / "demo" / "checkpoints" / "best.pt").is_file():
        return ROOT / "runs" / "demo", read_lines(ROOT / "data" / "demo" / "test.en")[:n]
    sys.exit("bench_serve: no model: run `make demo` (or `make bench-quality`) first")


def post(url: str, line: str) -> tuple[int, float]:
    start = time.perf_counter()
    request = urllib.request.Request(
        url,
        data=json.dumps({"text": [line]}).encode(),
        headers={"Content-Type": "application/json"},
    )
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "bench_serve.json"))
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args()
    run, lines = model_and_sentences(args.requests)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformer_mt",
            "serve",
            "-c",
            str(run),
            "--port",
            str(port),
            "--max-queue",
            "1024",
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                time.sleep(0.2)
        post(url + "/translate", lines[0])  # warm-up
        levels = (1, 8, 32)
        runs: dict[int, list[dict]] = {c: [] for c in levels}
        for r in range(args.rounds):
            for clients in levels:
                runs[clients].append(load(url + "/translate", lines, clients))
                print(
                    f"[bench_serve] round {r + 1}: {clients} clients: "
                    f"{runs[clients][-1]['requests_per_s']:.1f} "
                    f"req/s",
                    flush=True,
                )
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "model": str(run.relative_to(ROOT)),
        "requests": len(lines),
        "rounds": args.rounds,
        "levels": {
            str(c): {k: statistics.median(x[k] for x in v) for k in v[0]} | {"runs": v}
            for c, v in runs.items()
        },
    }
    Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    write_section(result, Path(args.out))
    return 0


def write_section(res: dict, path: Path) -> None:
    one = res["levels"]["1"]["requests_per_s"]
    rows = [
        f"| {c} | {v['requests_per_s']:.1f} | {v['requests_per_s'] / one:.2f}x | {v['p50_ms']:.0f} "
        "| "
        f"{v['p95_ms']:.0f} | {v['errors']} |"
        for c, v in res["levels"].items()
    ]
    best = max(res["levels"].items(), key=lambda kv: kv[1]["requests_per_s"])
    text = f"""## Serving (`tmt serve`, `scripts/bench_serve.py`)

{res["date"]}, {res["cpu"]}, {res["cores"]} cores; model `{res["model"]}`; {res["requests"]} requests of one
sentence each, beam search with the run's settings; medians of {res["rounds"]} interleaved rounds.
One client at a time is one-at-a-time serving: each request is its own batch.

| concurrent clients | requests/s | × one at a time | p50 ms | p95 ms | error responses |
| ---: | ---: | ---: | ---: | ---: | ---: |
{chr(10).join(rows)}

With {best[0]} clients the server answers {best[1]["requests_per_s"] / one:.2f}x as many requests per second as
one at a time: concurrent requests share batches.
"""
    replace_section(path, "serving", text)


if __name__ == "__main__":
    sys.exit(main())
