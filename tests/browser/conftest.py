"""Browser tests: Playwright's Python API driving Debian's Chromium (/usr/bin/chromium, headless,
--no-sandbox, --disable-background-networking; no browser is downloaded) against pytest-django's
live server, with a real Celery worker for the node queues. Screenshots of each main page go to
test-artifacts/screenshots/."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("TESSERA_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/browser/" in str(item.fspath):
            item.add_marker(pytest.mark.browser)


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"Chromium not found at {CHROMIUM} (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-background-networking", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--disable-component-update", "--disable-sync"])
        yield b
        b.close()


@pytest.fixture
def page(browser):
    ctx = browser.new_context(viewport={"width": 1366, "height": 900})
    pg = ctx.new_page()
    pg.set_default_timeout(15_000)
    yield pg
    ctx.close()


@pytest.fixture
def shot():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    def take(page, name: str) -> Path:
        path = ARTIFACTS / f"{name}.png"
        page.screenshot(path=str(path), full_page=True)
        return path
    return take


@pytest.fixture
def login(live_server):
    def sign_in(page, email: str, password: str = "pw-Secret-123"):
        page.goto(f"{live_server.url}/login/")
        page.fill("#id_username", email)
        page.fill("#id_password", password)
        page.click("button[type=submit]")
        page.wait_for_load_state("networkidle")
        return page
    return sign_in


@pytest.fixture
def node_worker(transactional_db, catalog, sim_dir, tmp_path):
    """A simulated GPU node and a real Celery worker consuming its queue (and control)."""
    from tests.fleet_fixtures import make_node
    from tests.worker_process import Worker

    node = make_node(f"web-{uuid.uuid4().hex[:6]}")
    w = Worker(f"{node.queue},control", sim_dir / "sim", tmp_path / "worker.log").start()
    yield node, w
    w.stop()
