"""Fixtures: a private JupyterLab on a copy of the notebooks, and headless system Chromium.

Nothing is downloaded: the server is this interpreter's JupyterLab, the browser is Debian's
``chromium`` driven by Playwright's Python package (never ``playwright install``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from labdriver import CHROMIUM, CHROMIUM_ARGS, INSTALL_HINT, REPO, Lab


@pytest.fixture(scope="module")
def lab_root(tmp_path_factory, tiny_data) -> Path:
    """A lab root holding a copy of the notebooks and the tiny dataset."""
    root = tmp_path_factory.mktemp("lab") / "workshop"
    shutil.copytree(REPO / "notebooks", root)
    shutil.copytree(tiny_data, root / "data" / "tiny")
    return root


@pytest.fixture(scope="module")
def lab(lab_root, tmp_path_factory):
    """JupyterLab on ``lab_root``; always shut down, leftovers killed by PID."""
    server = Lab(lab_root, tmp_path_factory.mktemp("lab-home"))
    yield server
    server.shutdown()
    server.kill_leftovers()


@pytest.fixture(scope="module")
def page(lab):
    """A headless Chromium tab (1400x1000) logged in to ``lab``."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing. {INSTALL_HINT}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail(f"playwright is not importable. {INSTALL_HINT}")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            tab = browser.new_page(viewport={"width": 1400, "height": 1000})
            tab.set_default_timeout(30_000)
            yield tab
        finally:
            browser.close()
