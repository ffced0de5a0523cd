"""The dashboard at /ui in a real headless Chromium (Debian's `chromium`, driven by Playwright for
Python) against a real daemon (tiny random Llama, Ray trainer, gate, auth on): log in, read the
health of a daemon that served a tagged conversation with feedback, watch a new version appear
without a reload, refused by the gate, and promote it with a click; roll back with a click and see
the engine serve the old version; edit and forget memory notes; forget a conversation with a click and roll back the versions
trained on it; a request without the cookie and cross-site POSTs are refused; `clawback
dashboard`'s link logs in once. Screenshots go to $CLAWBACK_SCREENSHOTS (default: the test's tmp
dir)."""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from tests.conftest import DaemonProcess, free_port, query, wait_for

CHROMIUM = os.environ.get("CLAWBACK_CHROMIUM", "/usr/bin/chromium")  # install.sh --test installs it
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# The gate refuses every version (any token entropy is below 1000× the live one's: "collapse"), on
# 2 short probes; each goes live by a click on Promote.
TRAIN_ENV = {"CLAWBACK_JUDGE__BACKEND": "off", "CLAWBACK_TRAIN__METHOD": "binary", "CLAWBACK_TRAIN__BATCH_SIZE": "1",
             "CLAWBACK_GATE": '{"entropy_low": 1000, "probes": 2, "probe_max_tokens": 4, "held_out_share": 0, '
                              '"guard_replies": 0}'}
TRAIN_TIMEOUT_S = 300  # the first step starts Ray on a busy 2-core machine
UI_TIMEOUT_MS = TRAIN_TIMEOUT_S * 1000


def converse(c: httpx.Client, session: str, messages: list[dict], kind: str | None = "thumbs_up",
             text: str | None = None, max_tokens: int = 8, **sampling: float) -> list[dict]:
    """One tagged main call and a rating of its reply; the conversation so far, with the reply."""
    r = c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": max_tokens, "messages": messages,
                                             **sampling},
               headers={"x-session-id": session, "x-turn-type": "main"})
    r.raise_for_status()
    if kind is None:
        return [*messages, r.json()["choices"][0]["message"]]
    ack = c.post("/v1/feedback", json={"event_id": str(uuid.uuid4()), "kind": kind, "session_id": session,
                                       "text": text}).json()
    assert ack["type"] == "ack", ack
    return [*messages, r.json()["choices"][0]["message"]]


def live_version(c: httpx.Client) -> int | None:
    return c.get("/v1/adapters").json()["live"]


def state_of(c: httpx.Client, version: int) -> str | None:
    return next((a["state"] for a in c.get("/v1/adapters").json()["data"] if a["version"] == version), None)


@pytest.fixture
def daemon(tiny_model_dir: Path, tmp_path: Path):
    d = DaemonProcess(tmp_path / "data", tiny_model_dir, env=TRAIN_ENV).start()
    yield d
    d.stop()
    assert d.api_key not in d.log.read_text()  # the key never reaches the log


@pytest.fixture
def browser():
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("CLAWBACK_SCREENSHOTS") or tmp_path / "screenshots")
    out.mkdir(parents=True, exist_ok=True)
    return out


def log_in(page: Page, url: str, key: str) -> None:
    response = page.goto(f"{url}/ui/")
    assert page.url.endswith("/ui/login")  # no cookie yet: the login page
    assert "default-src 'none'" in response.headers["content-security-policy"]
    page.fill("#key", "cb-not-the-key")
    page.click("button[type=submit]")
    expect(page.get_by_role("alert")).to_contain_text("not this daemon's API key")
    page.fill("#key", key)
    page.click("button[type=submit]")
    expect(page.locator("#health-live")).to_be_visible()


def test_dashboard_in_chromium(daemon: DaemonProcess, browser, shots: Path, tmp_path: Path):
    d = daemon
    c = httpx.Client(base_url=d.url, headers={"authorization": f"Bearer {d.api_key}"}, timeout=120)
    chat = converse(c, "chat-1", [{"role": "user", "content": "What is a LoRA?"}])
    untagged = {"model": "clawback", "max_tokens": 4, "messages": [{"role": "user", "content": "an untagged call"}]}
    c.post("/v1/chat/completions", json=untagged).raise_for_status()
    wait_for(lambda: state_of(c, 1) == "refused", TRAIN_TIMEOUT_S, "v1 refused")

    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    console, requests = [], []
    page.on("console", lambda m: console.append(m.text))
    page.on("pageerror", lambda e: console.append(f"page error: {e}"))
    page.on("request", lambda r: requests.append(r.url))
    dialogs: list[str] = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.accept()))  # every confirmation
    log_in(page, d.url, d.api_key)
    cookie = next(ck for ck in context.cookies() if ck["name"] == "clawback_ui")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/ui"

    # The gate refused v1; Promote (as `clawback adapters promote 1`) puts it live and says what
    # that overrides.
    expect(page.locator("#health-live")).to_have_text("base")
    expect(page.locator("#versions tr[data-version=v1] .state")).to_contain_text("refusedcollapse: token entropy")
    page.click("#versions tr[data-version=v1] button:has-text('Promote')")
    expect(page.locator("#versions .notice")).to_contain_text("v1 is live; this overrides the gate: collapse: token")
    assert live_version(c) == 1

    # Health of a daemon that served a tagged conversation with feedback and trained once.
    expect(page.locator("#health-live")).to_have_text("v1")
    expect(page.locator("#health-main")).to_contain_text("1")
    expect(page.locator("#health dl")).to_contain_text("Untagged calls1")
    expect(page.locator("#feedback")).to_contain_text("consumed by step 1")
    expect(page.locator("#versions tr[data-version=v1]")).to_have_class("live")
    expect(page.locator("#steps")).to_contain_text("committed")
    expect(page.locator("#live-dot")).to_have_class("online")  # the event stream is open
    page.evaluate("window.sameDocument = true")  # gone if the page reloads

    # The conversation goes on (its first reply is now paired with a next state) and the second
    # rated reply (👎 with a reason: two memory notes) trains v2; the page shows it without a reload.
    converse(c, "chat-1", [*chat, {"role": "user", "content": "And what is a hot swap?"}], "thumbs_down",
             "Please answer in one sentence. Never use bold text.")
    expect(page.locator("#versions tr[data-version=v2]")).to_have_class("refused", timeout=UI_TIMEOUT_MS)
    page.click("#versions tr[data-version=v2] button:has-text('Promote')")
    expect(page.locator("#health-live")).to_have_text("v2")
    expect(page.locator("#versions tr[data-version=v2]")).to_have_class("live")
    # v1, refused and promoted by hand, is refused again once it leaves live.
    expect(page.locator("#versions tr[data-version=v1] .state")).to_contain_text("refusedcollapse")
    expect(page.locator("#steps tbody tr")).to_have_count(2)
    expect(page.locator("#health-main")).to_contain_text("1 of 2 paired with a next state · 1 waiting for one")
    expect(page.locator(".chart .uplot")).not_to_have_count(0)  # uPlot drew the curves
    feedback_chart = page.locator(".chart").first  # good green, bad red, whatever the series' order in JSON
    expect(feedback_chart.locator(".u-series:has(.u-label:text-is('good')) .u-marker")).to_have_css(
        "border-color", "rgb(26, 127, 75)")
    expect(feedback_chart.locator(".u-series:has(.u-label:text-is('bad')) .u-marker")).to_have_css(
        "border-color", "rgb(179, 38, 30)")
    assert page.evaluate("window.sameDocument") is True
    page.screenshot(path=str(shots / "dashboard.png"), full_page=True)

    # Back to v1 with a click (refused again, it goes back by Promote, not Roll back): the engine serves v1 again.
    expect(page.locator("#versions tr[data-version=v1] button:has-text('Roll back')")).to_have_count(0)
    page.click("#versions tr[data-version=v1] button:has-text('Promote')")
    expect(page.locator("#versions tr[data-version=v1]")).to_have_class("live")
    assert dialogs[-1].startswith("Put v1 live whatever the gate says? It is refused"), dialogs  # asked first
    expect(page.locator("#health-live")).to_have_text("v1")
    assert live_version(c) == 1
    r = c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 4,
                                             "messages": [{"role": "user", "content": "which version?"}]})
    assert r.headers["x-clawback-adapter"] == "v1"
    assert page.evaluate("window.sameDocument") is True

    # Nothing came from another origin, and the CSP never had to block anything.
    assert all(u.startswith(d.url) for u in requests), [u for u in requests if not u.startswith(d.url)]
    assert not [m for m in console if "Content Security Policy" in m or "page error" in m], console

    # Phone-sized screen: no sideways scrolling.
    phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True)
    phone.add_cookies([cookie])
    small = phone.new_page()
    small.goto(f"{d.url}/ui/")
    expect(small.locator("#health-live")).to_have_text("v1")
    assert small.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    small.screenshot(path=str(shots / "dashboard-phone.png"), full_page=True)

    # Same origin but without the CSRF token: refused, nothing changes.
    status = page.evaluate("""fetch('/ui/adapters/rollback', {method: 'POST',
                                    body: new URLSearchParams({version: 'base'})}).then(r => r.status)""")
    assert status == 403
    _cross_site_posts_refused(page, d, tmp_path)
    assert live_version(c) == 1

    # Memory notes: edit one, forget the other (the store calls of `clawback memory edit|forget`).
    notes = page.locator("#memory tr[data-note]")
    expect(notes).to_have_count(2)
    edited, other = (page.locator(f"#memory tr[data-note='{notes.nth(i).get_attribute('data-note')}']") for i in (0, 1))
    edited.locator("input[name=text]").fill("Answer in two sentences.")
    edited.locator("button:has-text('Save')").click()
    expect(notes.last.locator("input[name=text]")).to_have_value("Answer in two sentences.")  # said last: nearest
    expect(edited.locator("input[name=text]")).to_have_value("Answer in two sentences.")
    other.locator("button:has-text('Forget')").click()
    expect(notes).to_have_count(1)
    assert [n["text"] for n in c.get("/v1/memory").json()["data"]] == ["Answer in two sentences."]

    # Browse a conversation.
    page.click("#conversations a:has-text('chat-1')")
    expect(page.locator("#conversation")).to_contain_text("What is a LoRA?")
    expect(page.locator("#conversation")).to_contain_text("Next user: And what is a hot swap?")
    expect(page.locator("#conversation .said")).to_have_count(2)  # both replies rated
    expect(page.locator("#conversation .origin")).to_have_text(["reward +1 from the person's 👍",
                                                                "reward -1 from the person's 👎"])

    # Forget it from its page (`forget()`, as `clawback forget`): what was deleted, the versions
    # trained on it and the rollback that stops serving them, which a click does.
    page.click("#conversation button.forget")
    expect(page.locator("#conversation")).to_contain_text("Forgot session chat-1")
    expect(page.locator("#conversation")).to_contain_text("2 calls")
    expect(page.locator("#conversation")).to_contain_text("1 memory notes")  # the note learnt from it
    assert c.get("/v1/memory").json()["data"] == []
    expect(page.locator("#forgotten-trained")).to_contain_text("v1, v2 were trained on it")
    expect(page.locator("#conversations")).not_to_contain_text("chat-1")  # the list refreshed itself
    assert not query(d.data_dir / "clawback.db", "SELECT 1 FROM calls WHERE session_id = 'chat-1'")
    assert query(d.data_dir / "clawback.db", "SELECT 1 FROM calls WHERE session_id LIKE 'anon-%'")  # the others stay
    page.click("#conversation button:has-text('Roll back to base')")
    expect(page.locator("#health-live")).to_have_text("base")
    assert live_version(c) is None

    # Without the cookie: the page sends you to log in, its parts and actions refuse.
    anon = httpx.Client(base_url=d.url, timeout=60)
    assert anon.get("/ui/").headers["location"] == "/ui/login"
    assert anon.get("/ui/part/versions").status_code == 401
    assert anon.get("/ui/events").status_code == 401
    keyed = c.post("/ui/adapters/rollback", data={"version": "1"})  # the bearer key is not a session
    assert keyed.status_code == 401
    assert c.post("/ui/forget", data={"session_id": "x"}).status_code == 401
    page.click("text=Log out")
    page.wait_for_url("**/ui/login")
    assert page.request.get(f"{d.url}/ui/part/health").status == 401
    assert live_version(c) is None

    open_page = _one_time_link(browser, d)

    # A page that stays open (its event stream) does not hold up the daemon's shutdown. (Not the
    # phone page: it shared the session that was just logged out.)
    expect(open_page.locator("#live-dot")).to_have_class("online")
    d.proc.terminate()
    d.proc.wait(60)  # raises TimeoutExpired if the open stream held the shutdown


def _one_time_link(browser, d: DaemonProcess) -> Page:
    """`clawback dashboard` prints a link that logs in once; returns the page it logged in."""
    out = subprocess.run([sys.executable, "-m", "clawback.daemon.cli", "dashboard", "--no-browser",
                          "--data-dir", str(d.data_dir), "--port", str(d.port)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    link = out.stdout.split()[-1]
    assert link.startswith(f"{d.url}/ui/login?token=")
    assert d.api_key not in out.stdout
    first = browser.new_context().new_page()
    first.goto(link)
    assert first.url == f"{d.url}/ui/"
    expect(first.locator("#health-live")).to_have_text("base")
    second = browser.new_context().new_page()
    second.goto(link)
    expect(second.get_by_role("alert")).to_contain_text("used already")
    return first


def _cross_site_posts_refused(page: Page, d: DaemonProcess, tmp_path: Path) -> None:
    """A page elsewhere submits a form to the dashboard in the logged-in browser: from another site
    (localhost) the SameSite=Strict cookie stays home; from another port of the same host (same
    site: the cookie is sent) the origin check refuses it."""
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "index.html").write_text(
        f'<form id="f" method="post" action="{d.url}/ui/adapters/rollback"><input name="version" value="base"></form>'
        '<script>document.getElementById("f").submit()</script>')
    port = free_port()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(evil))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for origin, expected in ((f"http://localhost:{port}", 401), (f"http://127.0.0.1:{port}", 403)):
            with page.expect_response(lambda r: r.url.endswith("/ui/adapters/rollback")) as answer:
                page.goto(f"{origin}/index.html")
            assert answer.value.status == expected, (origin, answer.value.status)
    finally:
        server.shutdown()
    page.goto(f"{d.url}/ui/")


# Training on, but the gate holds out nearly every rated call, so that no step runs (no Ray); cut
# replies are not trained on.
EXPLAINED_TOML = """
[train]
method = "binary"
batch_size = 1
drop_cut_replies = true
[judge]
backend = "off"
[gate]
held_out_share = 0.99
"""


def test_dashboard_says_why_groups_and_pages(ending_model_dir: Path, tmp_path: Path, browser):
    """What a newcomer reads on the page: a held-out sample is not "dropped" and a dropped one says
    why; the paired share counts the calls still waiting; calls without a session are one row; a
    long list comes in pages that a live update keeps; no chart of a single point; the login page
    names this daemon's key file (a data dir of its own here)."""
    from clawback.daemon.display import SAMPLE_REASONS, sample_reason

    data = tmp_path / "data"
    data.mkdir()
    (data / "clawback.toml").write_text(EXPLAINED_TOML)
    d = DaemonProcess(data, ending_model_dir).start()
    db = data / "clawback.db"
    try:
        c = httpx.Client(base_url=d.url, headers={"authorization": f"Bearer {d.api_key}"}, timeout=120)
        # The ending model's replies end by themselves when sampled as the simulator does.
        first = converse(c, "held", [{"role": "user", "content": "Say hi."}], max_tokens=160, temperature=0.7, seed=7)
        converse(c, "cut", [{"role": "user", "content": "Tell me a story."}], max_tokens=2, temperature=0.7,
                 seed=7)  # cut by its token limit
        chat = converse(c, "s00", [{"role": "user", "content": "Hello."}], kind=None, max_tokens=2)
        converse(c, "s00", [*chat, {"role": "user", "content": "And then?"}], kind=None, max_tokens=2)  # pairs it
        for i in range(1, 10):
            converse(c, f"s{i:02d}", [{"role": "user", "content": f"Question {i}."}], kind=None, max_tokens=2)
        for i in range(3):  # untagged: each becomes a session of its own
            c.post("/v1/chat/completions", json={"model": "clawback", "max_tokens": 2, "messages": [
                {"role": "user", "content": f"untagged {i}"}]}).raise_for_status()
        states = lambda: {r[0]: (r[1], r[2]) for r in query(  # noqa: E731
            db, "SELECT c.session_id, s.state, s.reason FROM samples s JOIN calls c USING (call_id) "
                "WHERE c.session_id IN ('held', 'cut')")}
        wait_for(lambda: states().get("held") == ("dropped", "held_out") and states().get("cut", ("",))[0] == "dropped",
                 TRAIN_TIMEOUT_S, "both rated samples settled")
        cut_reason = states()["cut"][1]
        assert first[-1]["content"], "the ending model ends its reply"

        page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
        page.goto(f"{d.url}/ui/login")
        expect(page.locator("#key-hint")).to_contain_text(str(data / "api_key"))
        page.fill("#key", d.api_key)
        page.click("button[type=submit]")

        expect(page.locator("#health-main")).to_contain_text("1 of 13 paired with a next state · 12 waiting for one")
        expect(page.locator("#health-not-trained")).to_contain_text("1 held out: held out for the gate")
        feedback = page.locator("#feedback li")
        expect(feedback).to_have_count(2)
        held = feedback.nth(1)  # newest first: "cut", then "held"
        expect(held.locator(".sample")).to_contain_text("held out for the gate: it checks new versions")
        expect(held.locator(".sample .bad")).to_have_count(0)  # not shown as a failure
        expect(feedback.nth(0).locator(".sample")).to_contain_text(f"not trained on: {sample_reason(cut_reason)}")
        assert cut_reason.split(":")[0] in SAMPLE_REASONS, cut_reason  # worded, not a code

        expect(page.locator("#no-charts")).to_be_visible()  # one version (base): nothing to chart
        expect(page.locator(".chart")).to_have_count(0)

        conversations = page.locator("#conversations")
        expect(page.locator("#anonymous-calls")).to_contain_text("Calls without a session")
        expect(page.locator("#anonymous-calls td.opt")).to_have_text("3")
        expect(conversations).not_to_contain_text("anon-")
        expect(conversations.locator(".pager")).to_contain_text("1–10 of 12")
        conversations.locator("button:has-text('Older')").click()
        expect(conversations.locator(".pager")).to_contain_text("11–12 of 12")
        expect(conversations.locator("tbody tr:not(#anonymous-calls)")).to_have_count(2)
        converse(c, "s10", [{"role": "user", "content": "One more."}], kind=None, max_tokens=2)
        expect(conversations.locator(".pager")).to_contain_text("11–13 of 13")  # the refresh kept the page

        page.click("#conversations a:text-is('held')")  # the oldest: on this second page
        expect(page.locator("#conversation .meta")).to_contain_text("sample: held out for the gate")
    finally:
        d.stop()
