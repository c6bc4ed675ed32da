"""Headless Debian chromium through Playwright, for the dashboard tests.

scripts/install_system_deps.sh installs /usr/bin/chromium; `playwright install` is never used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "out" / "test-artifacts"   # covered by .gitignore


@contextmanager
def chromium_page(profile_dir: Path) -> Iterator[tuple]:
    """(page, page errors) of a headless chromium with a fresh profile in `profile_dir`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(profile_dir), executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 1400})
        try:
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            yield page, errors
        finally:
            context.close()


def screenshot(page, name: str) -> Path:
    """Save a full-page screenshot under out/test-artifacts/ and return its path."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path
