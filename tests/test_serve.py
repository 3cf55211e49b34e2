"""`tmt serve` through a real uvicorn server on a free loopback port: every endpoint, every refusal,
batching that changes no output, a graceful SIGTERM, and (marked browser) the page in headless
Chromium.

Where a test needs the model's worker busy, it does not race a long request against the clock: the
server runs in this process around the tiny model behind a gate (`Gated`), whose calls wait for a
threading.Event, and the test waits for what /health reports before it goes on. (The batcher alone:
test_serve_batcher.py.)"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from transformer_mt.checkpoint import resolve_checkpoint
from transformer_mt.cli import main
from transformer_mt.search import Cancelled

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
ROOT = Path(__file__).resolve().parents[1]
# One torch thread for the in-process servers' decoding (conftest.py): a small shared machine.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(tiny_run):
    """The tiny model (conftest.py), which has learned to copy its input: its translations are real
    sentences, so the page has words to show and attention to draw. 300 updates."""
    return tiny_run.dir


@pytest.fixture(scope="module")
def translator(run_dir):
    from transformer_mt.inference import load_translator

    return load_translator(run_dir, device="cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(run_dir: Path, *flags: str):
    """`tmt serve` in a subprocess, up once /health answers; stopped (SIGTERM) afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "transformer_mt",
            "serve",
            "-c",
            str(run_dir),
            "--port",
            str(port),
            "--device",
            "cpu",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            if proc.poll() is not None:
                pytest.fail(f"tmt serve exited: {proc.stdout.read().decode()}")
            try:
                if get(url + "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        else:
            pytest.fail("tmt serve did not answer /health within 60 s")
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def get(url: str) -> tuple[int, dict | str]:
    with urllib.request.urlopen(url, timeout=60) as r:
        body = r.read().decode()
        return r.status, json.loads(
            body
        ) if r.headers.get_content_type() == "application/json" else body


def post(url: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read()), r.headers  # case-insensitive lookups
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def alone(translator: Any, lines: list[str], beam: int) -> list[str]:
    """What `tmt translate` gives for each line translated by itself."""
    return [translator.translate_text([line], beam=beam)[0] for line in lines]


def heavy(n: int = 64, words: int = 30) -> list[str]:
    """n lines of `words` words that the tiny model knows: long searches."""
    rng = random.Random(n)
    known = "alpha beta gamma delta echo fox golf hotel".split()  # of the tiny corpus (conftest.py)
    return [" ".join(rng.choice(known) for _ in range(words)) for _ in range(n)]


def wait_until(condition: Any, what: str, timeout: float = 60) -> None:
    """Poll until `condition()` holds; the timeout only guards against a hang (a failure, never a
    verdict)."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            pytest.fail(f"waited {timeout:g} s for {what}")
        time.sleep(0.01)


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=60) as r:
        return json.loads(r.read())


class Gated:
    """The tiny model's translator behind a gate: each translate() call is recorded, then waits for
    `release` (set once, it lets every call through); `cancelled` counts searches stopped because
    nobody waited."""

    def __init__(self, inner: Any):
        self.inner, self.calls, self.cancelled = inner, [], 0
        self.entered, self.release = threading.Event(), threading.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def translate(self, lines: list[str], **options: Any) -> list:
        self.calls.append((list(lines), {k: v for k, v in options.items() if k != "should_stop"}))
        self.entered.set()
        assert self.release.wait(120)
        try:
            return self.inner.translate(lines, **options)
        except Cancelled:
            self.cancelled += 1
            raise


@contextmanager
def in_process(gated: Gated, **limits: Any):
    """create_app around `gated` on a uvicorn server in a thread of this process; the gate opens at
    the end."""
    import uvicorn

    from transformer_mt.serve import Limits, create_app

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(gated, Limits(**limits)), host="127.0.0.1", port=port, log_level="warning"
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "the server to start")
        yield f"http://127.0.0.1:{port}"
    finally:
        gated.release.set()
        server.should_exit = True
        thread.join(60)


# --------------------------------------------------------------------------- the API


def test_every_endpoint_answers_and_translate_matches_tmt_translate(run_dir, translator, sentences):
    lines = sentences(3, 1)
    with server(run_dir) as (url, _):
        status, page = get(url + "/")
        assert status == 200 and '<label for="source">' in page
        assert "http://" not in page and "https://" not in page  # no CDN: the page works offline
        status, info = get(url + "/info")
        # the best validation (step 150 or 300) depends on the CPU's kernels: ask the file served
        served = resolve_checkpoint(run_dir)
        step = torch.load(served, map_location="cpu", weights_only=True)["step"]
        assert status == 200 and info["step"] == step and info["source_language"] == "en"
        assert (
            info["parameters"] > 0 and info["decode"]["beam"] == 2 and info["tokenizer"]["digest"]
        )
        assert info["checkpoint"] == f"run/{served.name}" and info["run"] == "run"
        # no directory of the server's in what clients see
        assert str(run_dir.parent) not in json.dumps(info)
        status, body, _ = post(
            url + "/translate", {"text": lines, "nbest": 2, "alignment": True, "attention": True}
        )
        assert status == 200
        got = body["translations"]
        assert [t["source"] for t in got] == lines
        assert [t["hypotheses"][0]["text"] for t in got] == alone(translator, lines, beam=2)
        assert all(len(t["hypotheses"]) == 2 and "alignment" in t["hypotheses"][0] for t in got)
        # it learned to copy
        assert sum(t["hypotheses"][0]["text"] == line for t, line in zip(got, lines)) >= 2
        attention = got[0]["hypotheses"][0]["attention"]
        assert attention["source"] == lines[0].split()
        assert attention["target"] == got[0]["hypotheses"][0]["text"].split()
        assert len(attention["weights"]) == len(attention["target"])
        status, body, _ = post(
            url + "/score", {"source": lines, "target": [t["hypotheses"][0]["text"] for t in got]}
        )
        assert status == 200 and body["perplexity"] > 1
        for s, t in zip(body["scores"], got):
            assert s["logprob"] == pytest.approx(t["hypotheses"][0]["logprob"], abs=1e-4)
        assert get(url + "/health")[1]["status"] == "ok"


def test_the_length_budget_and_alpha_are_per_request(translator):
    """max_len [0, 2] allows one token and EOS: the copy is cut there, where the run's budget lets
    it go on."""
    line = "alpha beta gamma delta echo fox"
    gated = Gated(translator)
    gated.release.set()  # no gate here
    with in_process(gated, batch_wait=0) as url:
        full = post(url + "/translate", {"text": [line]})
        short = post(url + "/translate", {"text": [line], "max_len": [0, 2], "alpha": 0.0})
    assert full[0] == short[0] == 200
    assert len(full[1]["translations"][0]["hypotheses"][0]["tokens"]) >= 3
    assert len(short[1]["translations"][0]["hypotheses"][0]["tokens"]) <= 1


BAD_REQUESTS = [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"text": 3}, 400, "text must be"),
    ({"text": ["a"], "beam": "wide"}, 400, "beam must be"),
    ({"text": ["a"], "beam": 2, "nbest": 3}, 400, "nbest must be"),
    ({"text": ["a"], "alignment": "yes"}, 400, "alignment must be"),
    ({"text": ["a"], "beams": 5}, 400, "did you mean beam?"),
    (b'{"text": ["a"], "alpha": NaN}', 400, "NaN is not a number"),
    (b'{"text": ["a"], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "nested too deeply"),
    (b'{"text": ["a"], "beam": 1' + b"0" * 5000 + b"}", 400, "digits"),
    ({"text": ["a"] * 9}, 413, "at most 8"),
    ({"text": ["a" * 13000]}, 413, "bytes"),
    ({"text": heavy(8, 12), "beam": 8}, 413, "--max-work"),
]


def test_bad_requests_are_refused_with_a_reason_and_the_server_keeps_serving(run_dir):
    with server(run_dir, "--max-lines", "8", "--max-body", "12000", "--max-work", "1000") as (
        url,
        _,
    ):
        for body, status, needle in BAD_REQUESTS:
            got, answer, _ = post(url + "/translate", body)
            assert (got, needle in answer["error"]) == (status, True), (body[:60], answer)
        assert post(url + "/translate", {"text": ["alpha beta"]})[0] == 200
        assert get(url + "/health")[1]["pending"] == 0


def test_a_full_queue_is_503_with_retry_after(translator):
    gated = Gated(translator)
    with in_process(gated, max_queue=1) as url:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(post, url + "/translate", {"text": ["alpha"]})
            assert gated.entered.wait(60)  # the one place in the queue is taken
            status, answer, headers = post(url + "/translate", {"text": ["beta"]})
            assert (
                status == 503
                and headers.get("Retry-After") == "1"
                and "queue is full" in answer["error"]
            )
            gated.release.set()
            assert busy.result()[0] == 200
        # the answer can reach the client before the worker frees its place in the queue
        wait_until(lambda: health(url)["pending"] == 0, "the queue to empty")
        assert post(url + "/translate", {"text": ["gamma"]})[0] == 200


def test_a_request_past_its_deadline_is_504_and_its_search_stopped(translator):
    """Both requests outlive their deadline while the worker is held: the one in the model stops at
    its next decoding step once the gate opens, the queued one never reaches the model."""
    gated = Gated(translator)
    with in_process(gated, deadline=0.5, batch_wait=0) as url:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(post, url + "/translate", {"text": heavy(4)})
            assert gated.entered.wait(60)
            status, answer, _ = post(url + "/translate", {"text": ["alpha"]})
            assert status == 504 and "deadline" in answer["error"]
            assert running.result()[0] == 504
        gated.release.set()
        wait_until(lambda: health(url)["pending"] == 0, "the worker to drop both")
        stats = health(url)
    assert stats["dropped"] == 2 and stats["served"] == 0
    assert gated.cancelled == 1 and len(gated.calls) == 1


def test_a_client_that_disconnects_has_its_work_dropped(translator):
    gated = Gated(translator)
    with in_process(gated, batch_wait=0) as url:
        port = int(url.rsplit(":", 1)[1])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(post, url + "/translate", {"text": ["alpha beta"]})
            assert gated.entered.wait(60)  # the worker is busy with that one
            body = json.dumps({"text": heavy(8)}).encode()
            # send, then leave without reading
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(
                    b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                wait_until(lambda: health(url)["pending"] == 2, "the request to be queued")
            wait_until(lambda: health(url)["left"] == 1, "the server to see the client leave")
            gated.release.set()
            assert busy.result()[0] == 200
        wait_until(lambda: health(url)["pending"] == 0, "the worker to drop it")
        stats = health(url)
    assert stats["dropped"] == 1 and stats["served"] == 1
    # the left request never reached the model
    assert [lines for lines, _ in gated.calls] == [["alpha beta"]]


def test_32_concurrent_clients_get_what_each_would_get_alone(translator, sentences):
    lines = sentences(32, 5)
    gated = Gated(translator)
    with in_process(gated, batch_wait=0, batch_work=100_000) as url:
        with concurrent.futures.ThreadPoolExecutor(33) as pool:
            busy = pool.submit(post, url + "/translate", {"text": ["alpha"]})
            assert gated.entered.wait(60)
            answers = [pool.submit(post, url + "/translate", {"text": [line]}) for line in lines]
            wait_until(lambda: health(url)["pending"] == 33, "all 32 requests to be queued")
            gated.release.set()
            answers = [a.result() for a in answers]
            assert busy.result()[0] == 200
        stats = health(url)
    assert all(a[0] == 200 for a in answers)
    assert [a[1]["translations"][0]["hypotheses"][0]["text"] for a in answers] == alone(
        translator, lines, beam=2
    )
    assert stats["served"] == 33 and stats["batches"] == 2  # the 32 shared one model call


def test_sigterm_finishes_the_request_in_flight_then_exits(run_dir):
    """SIGTERM arrives while a request is in flight (its body half sent): the server stops
    accepting, answers that request once its body is complete, then exits."""
    body = json.dumps({"text": ["alpha beta gamma"]}).encode()
    with server(run_dir) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
            s.sendall(
                b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body[:10]
            )
            wait_until(
                lambda: get(url + "/health")[1]["receiving"] == 1, "the server to read the request"
            )
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: refuses(port), "the server to stop accepting")
            s.sendall(body[10:])
            response = b""
            while chunk := s.recv(65536):
                response += chunk
        assert response.startswith(b"HTTP/1.1 200"), response[:200]
        assert (
            json.loads(response.split(b"\r\n\r\n", 1)[1])["translations"][0]["source"]
            == "alpha beta gamma"
        )
        # uvicorn finishes the work, then lets SIGTERM end the process as usual (status 143 in a
        # shell)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)


def refuses(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def test_serve_without_the_extra_names_it(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    assert main(["serve", "-c", str(run_dir)]) == 2
    assert "transformer-mt[serve]" in capsys.readouterr().err


# --------------------------------------------------------------------------- the page, in a real
# browser


@pytest.mark.browser
def test_the_page_translates_in_headless_chromium_and_draws_the_heatmap(run_dir):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert browser and driver, (
        "install Debian's chromium and chromium-driver (make test-browser does)"
    )
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1100,1400",
    ):
        options.add_argument(arg)
    with server(run_dir) as (url, _):
        page = webdriver.Chrome(service=Service(driver), options=options)
        try:
            page.get(url + "/")
            WebDriverWait(page, 30).until(
                lambda p: "step 300" in p.find_element(By.ID, "model").text
            )
            page.find_element(By.CSS_SELECTOR, "label[for=source]")  # the text box is labelled
            page.find_element(By.ID, "source").send_keys("alpha beta gamma delta")
            page.find_element(By.ID, "translate").click()
            WebDriverWait(page, 60).until(
                lambda p: p.find_elements(By.CSS_SELECTOR, ".translation")
            )
            shown = page.find_element(By.CSS_SELECTOR, ".translation").text
            assert shown == "alpha beta gamma delta"  # the model copies
            assert page.find_elements(By.CSS_SELECTOR, "ol.alternatives li")
            assert page.find_element(By.ID, "heatmap-section").is_displayed()
            inked = page.execute_script(
                "const c = document.getElementById('heatmap');const d = "
                "c.getContext('2d').getImageData(0, 0, c.width, c.height).data;let n = 0; for "
                "(let i = 3; i < d.length; i += 4) n += d[i] > 0; return n;"
            )
            assert inked > 100  # the heatmap was drawn
            out = ROOT / "runs" / "browser"
            out.mkdir(parents=True, exist_ok=True)
            assert page.save_screenshot(str(out / "page.png"))
        finally:
            page.quit()


def test_a_bad_request_in_a_shared_batch_fails_alone(run_dir):
    """A target too long to score is that request's 400; the requests batched with it are
    answered."""
    good = {"source": ["alpha beta"], "target": ["alpha beta"]}
    bad = {"source": ["alpha"], "target": [" ".join(["alpha"] * 200)]}  # over model.max_positions
    with server(run_dir, "--batch-wait", "0.5") as (url, _):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda body: post(url + "/score", body), [good, bad, good]))
        assert [a[0] for a in answers] == [200, 400, 200]
        assert "max_positions" in answers[1][1]["error"]


def test_requests_held_for_another_batch_are_batched_together(translator, sentences):
    """Requests with two sets of options queued together make two model calls, not one per
    request."""
    gated = Gated(translator)
    with in_process(gated, batch_wait=0) as url:
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            busy = pool.submit(post, url + "/translate", {"text": ["alpha"]})
            assert gated.entered.wait(60)
            bodies = [{"text": [line], "beam": 2 + i % 2} for i, line in enumerate(sentences(8, 9))]
            answers = [pool.submit(post, url + "/translate", body) for body in bodies]
            wait_until(lambda: health(url)["pending"] == 9, "the 8 requests to be queued")
            gated.release.set()
            assert busy.result()[0] == 200 and all(a.result()[0] == 200 for a in answers)
    assert len(gated.calls) == 3
    assert sorted((options["beam"], len(lines)) for lines, options in gated.calls[1:]) == [
        (2, 4),
        (3, 4),
    ]
