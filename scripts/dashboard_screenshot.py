"""The README's dashboard screenshot, from a short real session with a real model.

Starts `clawback serve` on MODEL (default: the default model) in a fresh data dir, has a person
hold two short tagged conversations with it (a 👍, a 👎 with a correction, a correction without a
thumb), logs in to /ui in Debian's headless Chromium and writes the page to docs/dashboard.png.
Training stays on with the daemon's batch size, so the page shows the samples waiting for a step.

    .venv/bin/python scripts/dashboard_screenshot.py [--model NAME] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SESSIONS = [
    ("homework", [("A pen costs $3. How much do 7 pens cost?", "thumbs_up", None),
                  ("And 12 pens?", "thumbs_down", "Start with 'Sure' and give just the total."),
                  ("What about 20 pens?", None, "Shorter, please: one sentence.")]),
    ("python", [("How do I reverse a list in Python?", "thumbs_up", None),
                ("And a string?", None, None)]),
]


def main() -> int:
    from playwright.sync_api import sync_playwright

    from clawback.daemon.config import DEFAULT_MODEL
    from clawback.engines.supervisor import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    ap.add_argument("--chromium", default=os.environ.get("CLAWBACK_CHROMIUM", "/usr/bin/chromium"))
    args = ap.parse_args()

    data_dir, port = Path(tempfile.mkdtemp(prefix="clawback-shot-")), free_port()
    url = f"http://127.0.0.1:{port}"
    log = (data_dir / "daemon.log").open("ab")
    proc = subprocess.Popen([sys.executable, "-m", "clawback.cli", "serve", "--model", args.model, "--port", str(port),
                             "--data-dir", str(data_dir)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "CLAWBACK_JUDGE__BACKEND": "off"})
    try:
        deadline = time.time() + 1800
        while time.time() < deadline:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1)
        key = (data_dir / "api_key").read_text().strip()
        c = httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=1800)
        for session, turns in SESSIONS:
            messages: list[dict] = []
            for text, kind, correction in turns:
                messages.append({"role": "user", "content": text})
                r = c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 96, "messages": messages},
                           headers={"x-session-id": session, "x-turn-type": "main"})
                r.raise_for_status()
                messages.append(r.json()["choices"][0]["message"])
                print(f"{session}: {text!r} -> {messages[-1]['content']!r}", flush=True)
                for k, t in ((kind, None), ("correction" if correction else None, correction)):
                    if k:
                        c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": k, "session_id": session,
                                                     **({"text": t} if t else {})}).raise_for_status()
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{url}/ui/")
            page.fill("#key", key)
            page.click("button[type=submit]")
            page.wait_for_selector("#health-live")
            time.sleep(2)  # the charts draw after the first data arrives
            page.screenshot(path=str(args.out), full_page=True)
            browser.close()
        print(f"wrote {args.out}")
        return 0
    finally:
        proc.terminate()
        proc.wait(120)


if __name__ == "__main__":
    sys.exit(main())
