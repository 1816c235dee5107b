"""A real browser for the tests: Debian's chromium, driven headless by Playwright (no browser download works
here: Playwright is pointed at /usr/bin/chromium), and where the screenshots a test takes are kept."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ARTIFACTS_ENV = "HPC_GARAGE_TEST_ARTIFACTS"  # where screenshots go (CI keeps it); default tests/artifacts/
# What the machine's closed network needs: without the background-networking flags chromium keeps trying to
# reach Google's hosts; as root it needs --no-sandbox.
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def chromium() -> str:
    path = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed (scripts/test installs Debian's chromium)")
        pytest.skip("chromium is not installed: apt install chromium")
    return path


def artifacts_dir() -> Path:
    path = Path(os.environ.get(ARTIFACTS_ENV) or Path(__file__).parent / "artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def chromium_page(**context: Any) -> Iterator[Any]:
    """A Playwright page in headless Debian chromium, with a fresh profile; `context` goes to new_context
    (e.g. http_credentials)."""
    try:
        from playwright import sync_api
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("playwright is not installed: the test extra brings it (pip install -e '.[test]')")
        pytest.skip("playwright is not installed: pip install playwright (no browser download: Debian's chromium)")
    executable = chromium()
    with tempfile.TemporaryDirectory(prefix="hpc-garage-chromium-") as profile, sync_api.sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(profile, executable_path=executable, headless=True,
                                                       args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 900},
                                                       **context)
        try:
            yield browser.pages[0] if browser.pages else browser.new_page()
        finally:
            browser.close()
