"""`tmt serve` through a real uvicorn server on a free loopback port: every endpoint, every refusal,
batching that changes no output, a graceful SIGTERM, and (marked browser) the page in headless Chromium."""

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
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from test_cli import WORDS, random_lines, write_config, write_lines
from transformer_mt.cli import main

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A tiny model that has learned to copy its input (about 7 s on one core): its translations are
    real sentences, so the page has words to show and attention to draw."""
    root = tmp_path_factory.mktemp("serve")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = random.Random(0)
    for split, n in (("train", 400), ("valid", 12), ("test", 5)):
        src = random_lines(n, rng)
        write_lines(corpus / f"{split}.en", src)
        write_lines(corpus / f"{split}.de", src)
    overrides = {"train.max_steps": 300, "train.valid_every": 1000, "train.valid_bleu": "false", "train.threads": 1,
                 "train.lr_factor": 1.0, "train.warmup": 60, "model.d_model": 64, "model.d_ff": 128, "model.heads": 4}
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    assert main(["-q", "train", str(write_config(root, corpus, root / "run")), *sets]) == 0
    return root / "run"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(run_dir: Path, *flags: str):
    """`tmt serve` in a subprocess, up once /health answers; stopped (SIGTERM) afterwards."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "transformer_mt", "serve", "-c", str(run_dir), "--port", str(port),
                             "--device", "cpu", *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
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
        return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body


def post(url: str, body: bytes | dict, timeout: float = 120) -> tuple[int, dict, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read()), r.headers  # case-insensitive lookups
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def alone(run_dir: Path, lines: list[str], beam: int) -> list[str]:
    """What `tmt translate` gives for each line translated by itself."""
    from transformer_mt.translate import load_translator

    translator = load_translator(run_dir, device="cpu")
    return [translator.translate_text([line], beam=beam)[0] for line in lines]


def heavy(n: int = 64, words: int = 30) -> list[str]:
    rng = random.Random(n)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


BUSY = {"text": heavy(2048, 60), "beam": 16}  # keeps the model's worker busy for seconds


# --------------------------------------------------------------------------- the API


def test_every_endpoint_answers_and_translate_matches_tmt_translate(run_dir):
    lines = random_lines(3, random.Random(1))
    with server(run_dir) as (url, _):
        status, page = get(url + "/")
        assert status == 200 and '<label for="source">' in page
        assert "http://" not in page and "https://" not in page  # no CDN: the page works offline
        status, info = get(url + "/info")
        assert status == 200 and info["step"] == 300 and info["source_language"] == "en"
        assert info["parameters"] > 0 and info["decode"]["beam"] == 2 and info["tokenizer"]["digest"]
        status, body, _ = post(url + "/translate", {"text": lines, "nbest": 2, "alignment": True, "attention": True})
        assert status == 200
        got = body["translations"]
        assert [t["source"] for t in got] == lines
        assert [t["hypotheses"][0]["text"] for t in got] == alone(run_dir, lines, beam=2)
        assert all(len(t["hypotheses"]) == 2 and "alignment" in t["hypotheses"][0] for t in got)
        assert [t["hypotheses"][0]["text"] for t in got] == lines  # the model copies
        attention = got[0]["hypotheses"][0]["attention"]
        assert attention["source"] == attention["target"] == lines[0].split()
        assert len(attention["weights"]) == len(attention["target"])
        status, body, _ = post(url + "/score", {"source": lines, "target": [t["hypotheses"][0]["text"] for t in got]})
        assert status == 200 and body["perplexity"] > 1
        for s, t in zip(body["scores"], got):
            assert s["logprob"] == pytest.approx(t["hypotheses"][0]["logprob"], abs=1e-4)
        assert get(url + "/health")[1]["status"] == "ok"


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    ({"text": 3}, 400, "text must be"),
    ({"text": ["a"], "beam": "wide"}, 400, "beam must be"),
    ({"text": ["a"], "beam": 2, "nbest": 3}, 400, "nbest must be"),
    ({"text": ["a"], "alignment": "yes"}, 400, "alignment must be"),
    ({"text": ["a"] * 9}, 413, "at most 8"),
    ({"text": ["a" * 3000]}, 413, "bytes"),
])
def test_bad_requests_are_refused_with_a_reason_and_the_server_keeps_serving(run_dir, body, status, needle):
    with server(run_dir, "--max-lines", "8", "--max-body", "2000") as (url, _):
        got, answer, _ = post(url + "/translate", body)
        assert got == status and needle in answer["error"]
        assert post(url + "/translate", {"text": ["alpha beta"]})[0] == 200


def test_a_full_queue_is_503_with_retry_after(run_dir):
    with server(run_dir, "--max-queue", "1", "--max-lines", "64") as (url, _):
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(lambda _: post(url + "/translate", {"text": heavy(), "beam": 8}), range(12)))
        statuses = sorted(a[0] for a in answers)
        assert 200 in statuses and 503 in statuses and set(statuses) <= {200, 503}
        assert all(a[2].get("Retry-After") == "1" for a in answers if a[0] == 503)
        assert post(url + "/translate", {"text": ["alpha"]})[0] == 200


def test_a_request_past_its_deadline_is_504_and_its_work_dropped(run_dir):
    with server(run_dir, "--deadline", "0.001") as (url, _):
        status, answer, _ = post(url + "/translate", {"text": heavy(), "beam": 8})
        assert status == 504 and "deadline" in answer["error"]
        time.sleep(0.5)
        assert get(url + "/health")[1]["dropped"] >= 1


def test_a_client_that_disconnects_has_its_work_dropped(run_dir):
    with server(run_dir, "--max-lines", "4096", "--batch-wait", "0") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(post, url + "/translate", BUSY)
            time.sleep(0.3)  # the worker is busy with that one
            body = json.dumps({"text": heavy(8)}).encode()
            with socket.create_connection(("127.0.0.1", port)) as s:  # send, then leave without reading
                s.sendall(b"POST /translate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                time.sleep(0.2)
            assert busy.result()[0] == 200
        time.sleep(0.5)
        health = get(url + "/health")[1]
        assert health["dropped"] == 1 and health["served"] == 1 and health["pending"] == 0


def test_32_concurrent_clients_get_what_each_would_get_alone(run_dir):
    lines = random_lines(32, random.Random(5))
    with server(run_dir) as (url, _):
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            answers = list(pool.map(lambda line: post(url + "/translate", {"text": [line]}), lines))
        assert all(a[0] == 200 for a in answers)
        assert [a[1]["translations"][0]["hypotheses"][0]["text"] for a in answers] == alone(run_dir, lines, beam=2)
        health = get(url + "/health")[1]
        assert health["served"] == 32 and health["batches"] < 32  # requests shared batches


def test_sigterm_finishes_the_request_in_flight_then_exits(run_dir):
    with server(run_dir, "--max-lines", "4096") as (url, proc):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            busy = pool.submit(post, url + "/translate", BUSY)
            time.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            assert busy.result()[0] == 200
        # uvicorn finishes the work, then lets SIGTERM end the process as usual (status 143 in a shell)
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)


def test_serve_without_the_extra_names_it(run_dir, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)  # import uvicorn now raises ImportError
    assert main(["serve", "-c", str(run_dir)]) == 2
    assert "transformer-mt[serve]" in capsys.readouterr().err


# --------------------------------------------------------------------------- the page, in a real browser


@pytest.mark.browser
def test_the_page_translates_in_headless_chromium_and_draws_the_heatmap(run_dir):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert browser and driver, "install Debian's chromium and chromium-driver (make test-browser does)"
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1100,1400"):
        options.add_argument(arg)
    with server(run_dir) as (url, _):
        page = webdriver.Chrome(service=Service(driver), options=options)
        try:
            page.get(url + "/")
            WebDriverWait(page, 30).until(lambda p: "step 300" in p.find_element(By.ID, "model").text)
            page.find_element(By.CSS_SELECTOR, "label[for=source]")  # the text box is labelled
            page.find_element(By.ID, "source").send_keys("alpha beta gamma delta")
            page.find_element(By.ID, "translate").click()
            WebDriverWait(page, 60).until(lambda p: p.find_elements(By.CSS_SELECTOR, ".translation"))
            shown = page.find_element(By.CSS_SELECTOR, ".translation").text
            assert shown == "alpha beta gamma delta"  # the model copies
            assert page.find_elements(By.CSS_SELECTOR, "ol.alternatives li")
            assert page.find_element(By.ID, "heatmap-section").is_displayed()
            inked = page.execute_script("const c = document.getElementById('heatmap');"
                                        "const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;"
                                        "let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n;")
            assert inked > 100  # the heatmap was drawn
            out = ROOT / "runs" / "browser"
            out.mkdir(parents=True, exist_ok=True)
            assert page.save_screenshot(str(out / "page.png"))
        finally:
            page.quit()


def test_a_bad_request_in_a_shared_batch_fails_alone(run_dir):
    """A target too long to score is that request's 400; the requests batched with it are answered."""
    good = {"source": ["alpha beta"], "target": ["alpha beta"]}
    bad = {"source": ["alpha"], "target": [" ".join(["alpha"] * 200)]}  # over model.max_positions
    with server(run_dir, "--batch-wait", "0.5") as (url, _):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda body: post(url + "/score", body), [good, bad, good]))
        assert [a[0] for a in answers] == [200, 400, 200]
        assert "max_positions" in answers[1][1]["error"]


def test_requests_held_for_another_batch_are_batched_together(run_dir):
    """Requests with two sets of options arriving together make two batches, not one per held request."""
    with server(run_dir, "--batch-wait", "0.5", "--max-lines", "4096") as (url, _):
        with concurrent.futures.ThreadPoolExecutor(9) as pool:
            busy = pool.submit(post, url + "/translate", BUSY)
            time.sleep(0.3)
            bodies = [{"text": [line], "beam": 2 + i % 2} for i, line in enumerate(random_lines(8, random.Random(9)))]
            answers = list(pool.map(lambda body: post(url + "/translate", body), bodies))
            assert busy.result()[0] == 200
        assert all(a[0] == 200 for a in answers)
        assert get(url + "/health")[1]["batches"] <= 1 + 2 + 1  # the busy one, beam 2, beam 3 (+1 for timing)
