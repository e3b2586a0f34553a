"""The VisualDL dashboard as a user sees it: a real 2-step run of the bundled tiny config with `report_to: visualdl`
and `log_completions: true`, `visualdl --logdir` started as its own process, and the pages opened in headless
Chromium (driven by Playwright's Python package). The scalar page must list the run's sections, draw the reward and
accuracy charts from the run's own values, and the text page must show the step's completions.

Needs the system's Chromium (`apt-get install chromium`; the package's /usr/bin/chromium, or $PADDLE_RL_CHROMIUM)
and Playwright's Python package (the `.[test]` extra; Playwright's own browser downloads are not used). Without
Chromium the test skips, saying so, unless PADDLE_RL_REQUIRE_BROWSER=1 (set by .ci/run), where it fails instead.
A screenshot of each page is kept in the test's tmp folder (printed with -s)."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from urllib.parse import parse_qs, urlparse

import pytest

from extras import extra
from paddle_rl.monitor import read_metrics
from paddle_rl.monitor.completions import read_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# .ci/run sets this: where the browser is installed on purpose, its absence fails instead of skipping
REQUIRED = os.environ.get("PADDLE_RL_REQUIRE_BROWSER") == "1"
CHROMIUM = os.environ.get("PADDLE_RL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
# offline and quiet: no component updates, sync, first-run pages or background fetches
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
# 2 steps of 4 prompts x 4 samples, evaluations at steps 0 and 2 on 32 held-out prompts (as tests/test_completions.py)
TINY = ["max_steps=2", "eval_steps=2", "save_steps=2", "global_batch_size=4", "global_mini_batch_size=4",
        "rollout_n=4", "max_eval_samples=32", "disable_tqdm=true", "save_strategy=no"]
TAGS = ["reward/mean", "reward/accuracy", "eval/accuracy"]
# the non-transparent pixels of each chart's canvas (echarts draws axes, labels and lines into it)
CANVAS_PIXELS = """() => Array.from(document.querySelectorAll('canvas')).map(c => {
  const ctx = c.getContext('2d');
  if (!ctx || !c.width || !c.height) return 0;
  const d = ctx.getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++;
  return n; })"""


def _chromium() -> str:
    if CHROMIUM is None or not os.access(CHROMIUM, os.X_OK):
        reason = ("no Chromium here (apt-get install chromium, or set PADDLE_RL_CHROMIUM to its binary): the "
                  "dashboard cannot be opened in a browser")
        if REQUIRED:
            pytest.fail(f"PADDLE_RL_REQUIRE_BROWSER=1: {reason}")
        pytest.skip(reason)
    return CHROMIUM


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory):
    """(run folder, VisualDL's URL): the run trained, VisualDL serving its logging_dir until the module ends."""
    chromium = _chromium()
    extra("playwright")  # the driver: in the test extra
    out = tmp_path_factory.mktemp("dashboard") / "run"
    logs = out / "logs"
    run = subprocess.run([sys.executable, "-m", "paddle_rl", "train", "configs/tiny_arith_grpo.yaml", *TINY,
                          f"output_dir={out}", f"logging_dir={logs}", "report_to=visualdl", "log_completions=true"],
                         cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    assert run.returncode == 0, run.stderr[-3000:]
    port = _free_port()
    visualdl = shutil.which("visualdl")
    cmd = ([visualdl] if visualdl else [sys.executable, "-m", "visualdl"])
    log = open(out / "visualdl.log", "w")
    server = subprocess.Popen(cmd + ["--logdir", str(logs), "--host", "127.0.0.1", "--port", str(port),
                                     "--disable-telemetry"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/app/api/scalar/tags", timeout=2) as r:
                    if json.load(r)["data"]["tags"]:
                        break
            except OSError:
                pass
            assert server.poll() is None, f"visualdl exited: {(out / 'visualdl.log').read_text()[-2000:]}"
            assert time.time() < deadline, f"visualdl did not serve {logs} in 60 s"
            time.sleep(0.5)
        yield out, url, chromium
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@pytest.fixture(scope="module")
def browser(dashboard):
    from playwright.sync_api import sync_playwright
    _, _, chromium = dashboard
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def _tag(response) -> str:
    """The tag a `/api/scalar/list?run=..&tag=..` request asked for."""
    return parse_qs(urlparse(response.url).query)["tag"][0]


def test_scalar_page_draws_the_runs_reward_and_accuracy(dashboard, browser):
    out, url, _ = dashboard
    rows = {r["step"]: r for r in read_metrics(str(out / "metrics.jsonl"))}
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, locale="en-US")  # VisualDL follows the locale
    requested = []  # the data the page fetched to draw its charts
    page.on("response", lambda r: requested.append(r) if "/api/scalar/list" in r.url else None)
    page.goto(f"{url}/app/scalar", wait_until="load", timeout=60000)
    page.locator("canvas").first.wait_for(timeout=60000)
    # the sections, named by the metric prefixes, with their tag counts
    sections = page.inner_text("body").split("\n")
    for section in ("reward", "eval", "actor", "time"):
        assert section in sections, f"section {section!r} missing from the scalar page: {sections[:60]}"
    reward_tags = [k for k in rows[1] if k.startswith("reward/")]
    assert sections[sections.index("reward") + 1] == str(len(reward_tags))
    # filter to the three charts: exactly their canvases, each drawn
    page.get_by_placeholder("Search tags in RegExp").fill("^(" + "|".join(TAGS) + ")$")
    page.wait_for_function("() => document.querySelectorAll('canvas').length === 3", timeout=30000)
    # a chart's canvas (axes, labels) is there before its data: wait for the three tags' answers themselves, which
    # come ~2.5 s after the filter here and later on a loaded machine
    deadline = time.time() + 30
    while not set(TAGS) <= {_tag(r) for r in requested if r.status == 200} and time.time() < deadline:
        page.wait_for_timeout(200)  # Playwright delivers the page's events while it waits
    page.wait_for_timeout(1500)  # echarts' entry animation
    shot = out / "visualdl_scalars.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    pixels = page.evaluate(CANVAS_PIXELS)
    assert len(pixels) == 3 and all(n > 1000 for n in pixels), pixels
    # the charts' data: each tag fetched by the page, holding the run's values at the run's steps
    fetched = {}
    for response in requested:
        if _tag(response) in TAGS and response.status == 200:
            fetched[_tag(response)] = response.json()["data"]
    assert sorted(fetched) == sorted(TAGS), sorted(fetched)
    for tag, points in fetched.items():
        # VisualDL's list: [wall time ms, step, value] per point
        drawn = {int(p[1]): float(p[2]) for p in points}
        expected = {step: float(row[tag]) for step, row in rows.items() if tag in row}
        assert sorted(drawn) == sorted(expected), (tag, drawn, expected)
        for step, value in expected.items():
            assert drawn[step] == pytest.approx(value, rel=1e-6, abs=1e-6), (tag, step)
    page.close()


def test_text_page_shows_the_completions(dashboard, browser):
    out, url, _ = dashboard
    records = read_records(str(out / "completions.jsonl"))
    page = browser.new_page(viewport={"width": 1400, "height": 1000}, locale="en-US")  # VisualDL follows the locale
    page.goto(f"{url}/app/text", wait_until="load", timeout=60000)
    page.get_by_text("prompt:").first.wait_for(timeout=60000)
    shot = out / "visualdl_text.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")
    text = " ".join(page.inner_text("body").split())
    assert "completions" in text
    # the step on show (VisualDL's step slider): its first completion's response, as completions.jsonl holds it
    shown = [int(w) for w in text.split("Step ")[1:2][0].split()[:1]] if "Step " in text else []
    assert shown and shown[0] in {r["step"] for r in records}, text[:1500]
    first = [r for r in records if r["step"] == shown[0]][0]
    response = " ".join(first["response"].split())
    assert response[:40] in text, (response[:40], text[:1500])
    assert "finish_reason:" in text and "reward/math:" in text and "advantage:" in text
    page.close()
