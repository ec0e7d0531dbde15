"""Retake docs/screenshots/: the demo (deploy/local/cluster.py, its three faults) with
each page shot in headless Chromium (Debian's /usr/bin/chromium, through Playwright)
when the demo says the fault it shows was detected, as an on-call opening the link
would see it. The PNGs are scaled down and reduced to a palette (a few dozen KB each).

    PYTHONPATH=. .venv/bin/python scripts/screenshots.py [--out docs/screenshots]

Takes ~10 minutes (the demo's faults play in order, each after the previous recovered).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUN = "demo"  # deploy/local/cluster.py's run
WIDTH = 1400  # the browser's viewport; the PNG is scaled to SCALED_WIDTH
SCALED_WIDTH = 1050
MAX_HEIGHT = 2600  # the Node page's charts go on; the top is what matters
TALL_JS = ("Math.max(...[...document.querySelectorAll('[data-testid=stMain] *')]"
           ".map(e => e.getBoundingClientRect().bottom)) + 40")
COLOURS = 96  # a palette: the pages are text, flat fills and a few chart colours

# (the demo's line that triggers them, [(file, path on the dashboard, a text to wait for)])
# Node names: the demo's loopback nodes are sim-node-0 and sim-node-1.
SHOTS: list[tuple[str, list[tuple[str, str, str]]]] = [
    ("detected: RankHung", [("run-hang.png", f"/run?run={RUN}", "Incident timeline")]),
    ("detected: GpuDown", [  # it is back after 60 s
        ("node-down.png", "/node?node=sim-node-1&gpu=0", "is DOWN"),
        ("cluster.png", "/", "DOWN")]),
    ("detected: TrainingStraggler", [
        ("run.png", f"/run?run={RUN}", "cause:"),
        ("node.png", "/node?node=sim-node-0&gpu=0", "GPU 0 now:"),
        ("alerts.png", "/alerts", "Active ("),
        ("audit.png", "/audit", "Newest action:")]),
]


def shoot(browser, url: str, path: str, wait_for: str, dest: Path) -> None:
    """Open `url + path` in a fresh context (a first visit), wait for `wait_for` and for
    the page's script to finish and its charts to draw, and save it full-page to
    `dest`, compressed."""
    context = browser.new_context(viewport={"width": WIDTH, "height": 1100})
    page = context.new_page()
    try:
        for attempt in range(3):
            page.goto(url + path)
            try:
                page.get_by_text(wait_for).first.wait_for(timeout=30_000)
                break
            except Exception as err:  # reloaded as a user would (a script Chromium lost
                # to a change of the host's interfaces leaves the page blank for good:
                # tests/e2e/test_dashboard_browser.py's `shows`); then shot as it is
                print(f"screenshots: {path}: {wait_for!r} not shown ({type(err).__name__}), "
                      f"try {attempt + 1}", file=sys.stderr)
        page.locator('[data-testid="stStatusWidget"]').wait_for(state="hidden", timeout=60_000)
        # the page scrolls inside Streamlit's main section, not the document: a full-page
        # shot of the viewport would cut it, so the viewport is made as tall as the page
        # (twice: what is drawn late, the Run page's incident timeline, adds to it)
        for _ in range(2):
            page.wait_for_timeout(2500)  # charts draw after their script has loaded
            tall = round(page.evaluate(TALL_JS))
            page.set_viewport_size({"width": WIDTH, "height": min(max(tall, 1100), MAX_HEIGHT)})
        page.wait_for_timeout(1000)
        raw = dest.with_suffix(".raw.png")
        page.screenshot(path=str(raw), full_page=True)
    finally:
        context.close()
    compress(raw, dest)


def compress(raw: Path, dest: Path) -> None:
    """Scale `raw` to SCALED_WIDTH and store it with a palette of COLOURS."""
    from PIL import Image

    with Image.open(raw) as im:
        im = im.convert("RGB")
        height = round(im.height * SCALED_WIDTH / im.width)
        im = im.resize((SCALED_WIDTH, height), Image.LANCZOS)
        im.quantize(colors=COLOURS, method=Image.Quantize.MEDIANCUT).save(
            dest, optimize=True)
    raw.unlink()
    print(f"screenshots: {dest} ({dest.stat().st_size // 1024} KB)", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "docs" / "screenshots")
    p.add_argument("--base-port", type=int, default=24400,
                   help="the demo's first port (default 24400, not the demo's own 19400)")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    state = Path(tempfile.mkdtemp(prefix="cp-screenshots-"))
    demo = subprocess.Popen([sys.executable, str(REPO / "deploy" / "local" / "cluster.py"),
                             "--state-dir", str(state), "--base-port", str(a.base_port)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    pending = list(SHOTS)
    url = None
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path="/usr/bin/chromium", args=[
                "--no-sandbox", "--disable-gpu", "--no-first-run"])
            for line in demo.stdout:
                print(f"demo| {line.rstrip()}", flush=True)
                if m := re.match(r"\s+dashboard\s+(http\S+)", line):
                    url = m.group(1)
                if pending and url and pending[0][0] in line:
                    _, shots = pending.pop(0)
                    time.sleep(5)  # one refresh: every page has read the alert
                    for name, path, wait_for in shots:
                        shoot(browser, url, path, wait_for, a.out / name)
                if not pending:
                    break
            browser.close()
    finally:
        demo.send_signal(signal.SIGINT)  # the demo stops everything it started
        try:
            demo.wait(timeout=120)
        except subprocess.TimeoutExpired:
            demo.kill()
    if pending:
        print(f"screenshots: the demo ended before {[t for t, _ in pending]}; its logs are "
              f"in {state}", file=sys.stderr)
        return 1
    shutil.rmtree(state, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
