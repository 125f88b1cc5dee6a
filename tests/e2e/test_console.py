"""The browser console (/console) against a real stack, in a real browser: Debian's chromium driven
by Playwright (never ``playwright install``: its browser downloads are not used).

The page asks for the API key, then: a streamed chat whose text grows while it streams, with a
logprob per token; the KV gauge of the executor moving while the request holds blocks; the request
in the table, done, with its TTFT; the capacity planner's ledger; and the page's byte formatting
agreeing with ``llmserve plan``'s. Screenshots go to ``loadtests/results/console*.png`` (printed).
"""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import httpx
import pytest

from shared.engine.memory import format_bytes

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "loadtests" / "results"
API_KEY = "console-test-key"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

if importlib.util.find_spec("playwright") is None:
    pytest.skip(
        "playwright is not installed: `make install` (pip install -e '.[dev]') installs it",
        allow_module_level=True,
    )
if not Path(CHROMIUM).is_file():
    pytest.skip(
        "Debian's chromium is not installed: `apt-get install -y chromium` (the console test "
        "drives it; `playwright install` is never used)",
        allow_module_level=True,
    )

from playwright.sync_api import Page, sync_playwright  # noqa: E402


def sample_until_done(page: Page, timeout: float) -> tuple[list[int], list[int]]:
    """While the playground's request runs: the output's length and the KV gauge's used blocks,
    every ~50 ms."""
    lengths, used = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lengths.append(len(page.locator("#output").inner_text()))
        gauge = page.locator("[data-testid=kv-gauge]").first
        used.append(int(gauge.get_attribute("data-used") or 0))
        if page.locator("#send").is_enabled():
            return lengths, used
        time.sleep(0.05)
    raise AssertionError(f"the request did not end within {timeout} s: {lengths[-5:]}")


@pytest.mark.timeout(420)
def test_console_in_a_browser(stack, tmp_path):
    s = stack(api_key=API_KEY, num_kv_blocks=None, memory_budget="1GiB", max_num_seqs=4)
    RESULTS.mkdir(parents=True, exist_ok=True)
    shots = [
        RESULTS / "console.png",  # the ledgers
        RESULTS / "console-playground.png",
        RESULTS / "console-planner.png",
        tmp_path / "console.png",
    ]
    # Without the key the data endpoints refuse; the page itself is public.
    assert httpx.get(s.base_url + "/console/api/state").status_code == 401
    assert httpx.get(s.base_url + "/console/").status_code == 200
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"),  # a fresh profile
            executable_path=CHROMIUM,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1400, "height": 1000},
        )
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(s.base_url + "/console/")
            page.wait_for_function(
                "document.getElementById('conn').textContent.includes('API key needed')"
            )
            page.fill("#api-key", API_KEY)
            page.click("#key-form button")
            page.wait_for_function("document.querySelectorAll('#model option').length > 0")
            page.wait_for_selector("[data-testid=kv-gauge]", state="attached", timeout=30_000)
            assert page.locator("[data-testid=kv-gauge]").first.get_attribute("data-used") == "0"

            # A streamed chat with logprobs, long enough to be seen growing.
            page.fill("#prompt", "Count from 1 to 200, separated by commas.")
            page.fill("#temperature", "0")
            page.fill("#max_tokens", "120")
            page.fill("#seed", "7")
            page.click("#send")
            lengths, used = sample_until_done(page, timeout=240)
            assert page.locator("#gen-error").inner_text() == ""
            growth = sorted(set(lengths))
            assert growth[-1] > 0 and len(growth) >= 4, lengths  # it grew, step by step
            assert lengths[0] < lengths[-1]
            assert max(used) > 0, used  # the gauge moved while the request held KV blocks
            stats = page.locator("#gen-stats").inner_text()
            assert "TTFT" in stats and "finish: length" in stats, stats
            chips = page.locator("#tokens .tok")
            assert chips.count() == 120
            chips.nth(3).hover()
            assert page.locator("#alternatives tr").count() >= 2  # the token and its alternatives
            page.screenshot(path=str(shots[1]), full_page=True)

            # The ledgers: the request done with its TTFT; the memory ledger planned vs actual.
            page.click("nav button[data-tab=ledgers]")
            done = page.locator("#requests tbody tr", has_text="done").first
            done.wait_for(timeout=10_000)
            assert "200 length" in done.inner_text()
            card = page.locator("[data-executor=executor-0]")
            assert "weights" in card.inner_text() and "kv cache" in card.inner_text()
            assert "GiB" in card.inner_text()  # the 1 GiB budget, formatted

            # The planner, prefilled from the executor's settings: its plan is the executor's.
            page.click("nav button[data-tab=planner]")
            page.wait_for_selector("#plan-table tr[data-row='kv blocks']")
            assert page.input_value("#plan-memory") == str(1 << 30)
            state = httpx.get(
                s.base_url + "/console/api/state", headers={"Authorization": f"Bearer {API_KEY}"}
            ).json()
            planned = state["executors"][0]["memory"]["planned_num_kv_blocks"]
            assert planned > 0
            page.wait_for_function(
                "(n) => document.querySelector(\"#plan-table tr[data-row='kv blocks'] td\")"
                ".textContent.startsWith(n)",
                arg=f"{planned:,} ",
            )
            samples = [0, 1023, 1024, 524288, 1536, 1 << 30, 22_350_000_000, -2048, 123456789]
            js = page.evaluate(
                "async (xs) => { const m = await import('/console/format.js');"
                " return xs.map(m.formatBytes); }",
                samples,
            )
            assert js == [format_bytes(x) for x in samples]
            page.screenshot(path=str(shots[2]), full_page=True)

            # Back to idle: the request's blocks are free again (at most a heartbeat later).
            page.click("nav button[data-tab=ledgers]")
            page.wait_for_function(
                "document.querySelector('[data-testid=kv-gauge]').dataset.used === '0'"
            )
            page.screenshot(path=str(shots[0]), full_page=True)
            shutil.copyfile(shots[0], shots[3])
            assert errors == []
        finally:
            browser.close()
    for shot in shots:
        print(f"console screenshot: {shot}")
