"""mitmweb in a real headless chromium: a spliced flow is marked, its comment shows in the
flow list, and its response renders through the "Spillover SSE" contentview with the handoff
separator. Skipped only when no chromium binary is installed (Debian: `apt-get install
chromium`); playwright drives it, with no browser download of its own."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
from mitmproxy import http, io
from mitmproxy.utils.emoji import emoji

from scripts.parts.processes import free_port
from tests.docpictures import keep_for_docs

REPO = Path(__file__).resolve().parent.parent
MITMWEB = Path(sys.executable).parent / "mitmweb"
PASSWORD = "spillover-test"
SHOT = Path("/tmp/mitmweb-shot.png")
VIEW = "Spillover SSE"
RECORDINGS = REPO / "recordings"

pytestmark = pytest.mark.timeout(90)


def chromium() -> str | None:
    """The chromium binary to drive: $CHROMIUM, else the first one on PATH."""
    names = [os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"]
    return next((path for name in names if name and (path := shutil.which(name))), None)


def flows_file(path: Path) -> Path:
    """A real recorded session (scripts/testbed/record.py): a requested handoff, its legs and the
    questions the addon asked its servers."""
    shutil.copyfile(RECORDINGS / "requested.mitm", path)
    return path


def spliced_flow(path: Path) -> http.HTTPFlow:
    """The first flow in the file that the addon spliced."""
    with path.open("rb") as file:
        for flow in io.FlowReader(file).stream():
            if isinstance(flow, http.HTTPFlow) and flow.metadata.get("spillover", {}).get(
                "handoffs"
            ):
                return flow
    raise AssertionError(f"no spliced flow in {path}")


def first_token_line(flow: http.HTTPFlow) -> str:
    """What the view should print for the stream's first token, read straight off the body."""
    assert flow.response is not None
    for line in (flow.response.get_text(strict=False) or "").splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices") or []:
                delta = choice.get("delta") or {"content": choice.get("text")}
                for field, label in (("reasoning_content", "reasoning "), ("content", "")):
                    if isinstance(delta.get(field), str) and delta[field]:
                        return f"1  {label}{json.dumps(delta[field], ensure_ascii=False)}"
                if delta.get("tool_calls"):
                    return "1  tool_calls ["
    raise AssertionError("the stream has no token")


@contextmanager
def mitmweb(flows: Path, workdir: Path) -> Iterator[str]:
    """A real mitmweb showing `flows`, with the contentview registered; yields its URL."""
    loader = workdir / "load_sseview.py"
    loader.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from addon.surface.sseview import register\nregister()\n"
    )
    columns = ["tls", "icon", "path", "method", "status", "size", "comment"]
    for _attempt in range(3):  # the free port may be taken before mitmweb binds it
        port = free_port()
        log = workdir / f"mitmweb-{port}.log"
        argv = [str(MITMWEB), "--no-web-open-browser", "-n", "-r", str(flows), "-s", str(loader)]
        argv += ["--web-port", str(port), "--set", f"web_password={PASSWORD}"]
        argv += [arg for column in columns for arg in ("--set", f"web_columns={column}")]
        with log.open("wb") as out:
            process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
        try:
            deadline = time.monotonic() + 20
            while process.poll() is None and time.monotonic() < deadline:
                if b"Web server listening" in log.read_bytes():
                    yield f"http://127.0.0.1:{port}"
                    return
                time.sleep(0.05)
            text = log.read_text(errors="replace")
            if "Address already in use" not in text:
                raise AssertionError(f"mitmweb did not start:\n{text}")
        finally:
            process.terminate()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    raise AssertionError("mitmweb found no free port")


def test_spliced_flow_in_mitmweb(tmp_path: Path) -> None:
    browser_binary = chromium()
    if browser_binary is None:
        if os.environ.get("CI"):  # scripts/test.sh installs it: its absence is a failure
            pytest.fail("no chromium binary on a CI run (apt-get install chromium)")
        pytest.skip("no chromium binary (apt-get install chromium, or set $CHROMIUM)")
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import expect, sync_playwright

    flows = flows_file(tmp_path / "flows.mitm")
    flow = spliced_flow(flows)
    handoff = flow.metadata["spillover"]["handoffs"][0]
    separator = (
        f"handoff {handoff['source']} -> {handoff['target']} after {handoff['at_token']} tokens"
    )
    token_line = first_token_line(flow)
    shots: list[Path] = []

    with mitmweb(flows, tmp_path) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=browser_binary)
        try:
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            page.set_default_timeout(10_000)

            def shot(name: str) -> None:
                shots.append(tmp_path / f"{len(shots) + 1}-{name}.png")
                page.screenshot(path=shots[-1])

            # The token logs the browser in (a cookie); the search shows the marked flows
            # only (the table draws only the rows in view, and the addon's questions come
            # first).
            page.goto(f"{url}/?token={PASSWORD}#/flows?s=~marked")
            rows = page.locator(".flow-table tbody tr", has_text=flow.request.path)
            row = rows.filter(has_text=f"spillover: {separator}").first
            expect(row).to_be_visible()
            expect(row.locator(".marker")).to_have_text(emoji[flow.marked])
            comment = row.locator("td.col-comment")
            expect(comment).to_be_visible()
            expect(comment).to_contain_text(f"spillover: {separator}")
            shot("flow-list")

            row.click()
            details = page.locator(".flow-detail")
            details.locator("nav a", has_text="Comment").click()
            expect(details.get_by_text(flow.comment.splitlines()[0])).to_be_visible()

            details.locator("nav a", has_text="Response").click()
            view = details.locator("section.response .contentview")
            title, text = view.locator(".controls h5"), view.locator("pre")

            def choose(name: str) -> None:  # pick a view by hand from the "View:" dropdown
                view.locator(".controls a", has_text="View:").click()
                page.locator(".dropdown-menu").get_by_text(name, exact=True).click()
                expect(view.locator(".controls a", has_text="View:")).to_contain_text(name)

            def rendered() -> None:  # the stitched answer as the view shows it
                expect(title).to_have_text(VIEW)
                more, deadline = text.locator("button", has_text="Show more"), time.time() + 20
                while separator not in text.inner_text() and time.time() < deadline:
                    if more.count():  # a long answer: reveal more until the separator shows
                        with suppress(PlaywrightError):  # gone already: it is loading
                            more.first.click(timeout=1000)
                    page.wait_for_timeout(50)
                rule = text.locator("div", has_text=separator)
                expect(rule).to_have_count(1)
                rule.scroll_into_view_if_needed()
                expect(rule).to_be_visible()
                expect(rule).to_have_text(f"{'═' * 8} {separator} {'═' * 8}")
                expect(text.locator("div", has_text=token_line).first).to_be_visible()

            rendered()  # chosen automatically: the addon's flows carry metadata["spillover"]
            shot("response-auto")
            keep_for_docs(shots[-1], "mitmweb-spliced-flow.png")

            choose("raw")  # the raw stream carries the handoff as an SSE comment
            expect(title).to_have_text("Raw")
            expect(text).to_contain_text("data: {")
            choose(VIEW.lower())
            rendered()
            shot("response-chosen")
        except Exception:
            shot("failure")
            raise
        finally:
            browser.close()
            if shots:
                shutil.copyfile(shots[-1], SHOT)
