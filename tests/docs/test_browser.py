"""The site in a real browser: headless Chromium (Debian's ``chromium``, which .ci/run
installs) loads the home page and a reference page from a real HTTP server on 127.0.0.1, runs
the theme's JavaScript, and the DOM it ends with has the grouped navigation and a copy button
on a code block. The copy buttons exist only once the JavaScript has run: the built HTML has
none, so finding them proves the page ran in a browser."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

GROUPS = ("Getting started", "Guides", "Reference", "Development")
COPY_BUTTON = 'data-md-type="copy"'


def chromium() -> str:
    found = (
        os.environ.get("QWEN35_RESHARD_CHROMIUM")
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
    )
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("no chromium: .ci/run installs Debian's chromium")
        pytest.skip("no chromium (apt-get install chromium)")
    return found


@pytest.fixture(scope="module")
def served(site):
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()


def rendered_dom(browser: str, url: str, profile: str) -> str:
    """The DOM after the page's scripts ran (``--virtual-time-budget``: until the page is idle),
    in a profile of its own (not the user's, not another run's)."""
    args = [
        browser,
        f"--user-data-dir={profile}",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--virtual-time-budget=5000",
        "--dump-dom",
        url,
    ]
    p = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "</html>" in p.stdout, p.stderr[-2000:]
    return p.stdout


@pytest.mark.parametrize("page", ["", "api-reference/"], ids=["home", "reference"])
def test_page_in_a_browser_has_navigation_and_copy_buttons(served, site, page, tmp_path):
    browser = chromium()
    dom = rendered_dom(browser, f"{served}/{page}", str(tmp_path / "profile"))
    nav = dom[dom.index('class="md-nav md-nav--primary"') :]
    for group in GROUPS:
        assert f"{group}\n" in nav or f">{group}<" in nav or f" {group} " in nav, group
    for href in {"install/", "deploy/", "cli/", "api-reference/", "development/"} - {page}:
        assert f'href="{href}' in nav or f'href="../{href}' in nav, href
    assert COPY_BUTTON in dom
    static = (site / page / "index.html").read_text()
    assert "<pre" in static and COPY_BUTTON not in static  # the button is the browser's doing
    if page == "api-reference/":  # signatures and types rendered from the docstrings
        assert "doc-signature" in dom and "ReshardResult" in dom
