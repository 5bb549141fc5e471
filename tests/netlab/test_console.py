"""The console in a real browser (Debian's chromium, driven by playwright) against a 3-host lab
with the mesh: members appear with their state, a job started from the CLI appears and its
output tail grows without a reload, a service's replicas show, a crashed host turns dead
within seconds, hostile text (a member's label, a job's output) is shown as text, and the
page loads nothing from anywhere but the console. Each view's screenshot is written to
docs/console/ (the README shows them)."""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .support import call, in_netns, swarmctl, three_hosts, until

pytestmark = [pytest.mark.netlab, pytest.mark.slow]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# headless, and nothing of Chromium's own reaching out (no network here: each would be refused)
ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SHOTS = Path(__file__).parents[2] / "docs" / "console"
HOSTILE = '<img src=x onerror="window.pwned=1">'
JOB = """
import time
print('<script>window.pwned = 2</script> \\x1b]52;c;ZXZpbA==\\x07 <b>not bold</b>', flush=True)
for i in range(60):
    print('tick', i, flush=True)
    time.sleep(0.5)
"""
APP = r'''
import http.server, os
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(os.environ["PORT"])), H).serve_forever()
'''
# requests through the host's own gateway: how many answered 200
CLIENT = """
import http.client, sys
c, ok = http.client.HTTPConnection("127.0.0.1", 8080, timeout=30), 0
for i in range(int(sys.argv[1])):
    c.request("GET", "/hello/x"); r = c.getresponse(); r.read(); ok += r.status == 200
print(ok)
"""


@pytest.fixture(scope="module")
def lab():
    if not os.path.exists(CHROMIUM):
        pytest.skip("no chromium (make setup installs Debian's)")
    with three_hosts("w", mesh=True, daemon_args=["--gateway-listen", "127.0.0.1:8080"]) as lab:
        yield lab


@pytest.fixture(scope="module")
def console(lab):
    env = {**os.environ, "SWARMD_SOCKET": lab.state.host("h1").socket}
    proc = subprocess.Popen([sys.executable, "-m", "swarmctl.main", "console", "--url", "--interval", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    url = proc.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:"), proc.stderr.read() if proc.poll() is not None else url
    yield url
    proc.terminate()
    proc.communicate(timeout=10)


@pytest.fixture(scope="module")
def page(console):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1320, "height": 900})
        page.seen = []  # every URL the page asked for
        page.errors = []  # script errors and dialogs: a hostile text that ran would show here
        page.on("request", lambda r: page.seen.append(r.url))
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        page.on("dialog", lambda d: (page.errors.append(f"dialog: {d.message}"), d.dismiss()))
        page.goto(console)
        yield page
        browser.close()


def shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"))


def rows(page, selector: str) -> list[dict[str, str]]:
    return page.eval_on_selector_all(selector, "rs => rs.map(r => ({...r.dataset, text: r.textContent}))")


def test_the_swarm_view_lists_the_members_alive_and_shows_a_hostile_label_as_text(lab, page):
    call(lab, "h2", "labels.set", labels={"note": HOSTILE, "zone": "lab"})
    h2 = lab.state.host("h2").peer_id
    until(lambda: [r["state"] for r in rows(page, "#members tbody tr")] == ["alive", "alive"], 30,
          "both other members alive on the page", interval=0.3, detail=lambda: rows(page, "#members tbody tr"))
    until(lambda: any(HOSTILE in r["text"] for r in rows(page, "#members tbody tr") if r["peer"] == h2), 30,
          "h2's label on the page", interval=0.3)
    assert page.locator("img").count() == 0 and page.evaluate("window.pwned") is None and not page.errors
    until(lambda: page.locator("#map circle.member").count() == 3, 30, "three members on the map", interval=0.3)

    def apart() -> bool:  # 10 ms links: the three points of a triangle, not one spot
        xy = page.eval_on_selector_all("#map circle.member", "cs => cs.map(c => [+c.getAttribute('cx'), "
                                                              "+c.getAttribute('cy')])")
        return len(xy) == 3 and min(math.dist(a, b) for a, b in itertools.combinations(xy, 2)) > 40

    until(apart, 30, "the members apart on the map", interval=0.3)
    until(lambda: page.locator("#map line.path").count() >= 2, 60, "the mesh's paths on the map", interval=0.5)
    shot(page, "swarm")


def test_a_job_from_the_cli_appears_and_its_output_grows_without_a_reload(lab, page, tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    r = swarmctl(lab, "h1", "jobs", "run", "--detach", "--name", "ticker", "--nodes", "2", "--workdir", str(tmp_path),
                 "--", "python", "job.py")
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip()
    page.click("nav a[data-view=jobs]")
    row = page.locator(f"#job-list tr[data-job='{job}']")
    row.wait_for(timeout=30_000)
    row.click()
    output = page.locator("#job-output")
    until(lambda: "tick 2" in output.text_content(), 60, "the job's first ticks on the page", interval=0.3)
    first = output.text_content().count("tick")
    until(lambda: output.text_content().count("tick") >= first + 4, 30, "more ticks, with no reload", interval=0.3)
    text = output.text_content()
    assert "<script>window.pwned = 2</script>" in text and "<b>not bold</b>" in text, text[:500]
    assert "\x1b" not in text and "\x07" not in text, "control characters shown as replacement characters"
    assert page.evaluate("window.pwned") is None and page.locator("#job-output b, #job-output script").count() == 0
    until(lambda: page.locator("#job-timeline .bar").count() == 1, 10, "the attempt on the timeline", interval=0.3)
    shot(page, "jobs")
    assert swarmctl(lab, "h1", "jobs", "cancel", job).returncode == 0


def test_a_service_shows_its_replicas(lab, page, tmp_path):
    (tmp_path / "app.py").write_text(APP)
    r = swarmctl(lab, "h1", "serve", "up", "hello", "--replicas", "2", "--workdir", str(tmp_path), "--",
                 "python", "app.py")
    assert r.returncode == 0, r.stderr
    page.click("nav a[data-view=services]")
    row = page.locator("#service-list tr[data-service='hello']")
    row.wait_for(timeout=60_000)
    until(lambda: row.locator("td").nth(2).text_content() == "2", 120, "two replicas serving", interval=0.5,
          detail=lambda: row.text_content())
    row.click()
    until(lambda: page.locator("#service-replicas tbody tr").count() == 2, 30, "the replicas listed", interval=0.3)
    for host in ("h1", "h2"):
        # the page reads the registry; each gateway polls it every second for its own table, and
        # answers 503 "no replica" (Retry-After: 1) until then (CI once sent all 40 before h1's did)
        until(lambda: sum(r.get("ejected") is False for r in call(lab, host, "serve.show", name="hello")["replicas"])
              == 2, 30, f"{host}'s gateway routing to both replicas", interval=0.5,
              detail=lambda: call(lab, host, "serve.show", name="hello")["replicas"])
        done = in_netns(lab, host, sys.executable, "-c", CLIENT, "40")
        assert done.stdout.strip() == "40", (done.stdout, done.stderr[-2000:])

    def served() -> int:
        found = re.search(r"(\d+) requests", page.locator("#service-gateway").text_content())
        return int(found.group(1)) if found else 0

    until(lambda: served() >= 40, 30, "h1's gateway's requests on the page", interval=0.5,
          detail=lambda: page.locator("#service-gateway").text_content())
    shot(page, "services")
    page.fill("#service-wanted", "1")
    page.click("#service-scale")
    until(lambda: row.locator("td").nth(1).text_content() == "1", 30, "the service scaled to one on the page",
          interval=0.3, detail=lambda: page.locator("#service-said").text_content())


def test_this_node_draws_its_counters_over_time(page):
    page.click("nav a[data-view=node]")
    until(lambda: page.locator("#node-charts polyline.series").count() >= 3, 30, "the node's charts", interval=0.3)
    assert "peer_id" in page.locator("#node-facts").text_content()
    shot(page, "node")


def test_a_crashed_host_turns_dead_on_the_page_within_seconds(lab, page, console):
    page.click("nav a[data-view=swarm]")
    h3 = lab.state.host("h3").peer_id
    lab.crash("h3")
    began = time.monotonic()
    until(lambda: any(r["peer"] == h3 and r["state"] == "dead" for r in rows(page, "#members tbody tr")), 30,
          "h3 dead on the page", interval=0.2)
    print(f"h3 shown dead {time.monotonic() - began:.1f} s after its crash")
    origin = console.split("/login", 1)[0] + "/"
    elsewhere = sorted({u for u in page.seen if not u.startswith(origin)})
    assert page.seen and not elsewhere, elsewhere
    assert not page.errors, page.errors
