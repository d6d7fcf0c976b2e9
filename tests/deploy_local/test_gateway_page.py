"""The gateway's page in a real browser: Debian's chromium (scripts/setup_browser.sh) driven by playwright,
against the chat demo deployed by `pkg deploy`. The page asks for a key, lists what it opens with live
figures, and streams a multi-turn chat."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from tests.deploy_local.conftest import FUNCTION, Workspace

pytestmark = pytest.mark.real_model

CHROMIUM = Path("/usr/bin/chromium")
# The page polls every 2 s: playwright's default 5 s for an expectation is two polls, too few for a loaded machine.
expect.set_options(timeout=30_000)


@pytest.fixture
def page() -> Iterator[Page]:
    assert CHROMIUM.exists(), "the browser tests need Debian's chromium: bash scripts/setup_browser.sh"
    with sync_playwright() as playwright:
        # As root (CI, these machines) Chromium's sandbox cannot start.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            yield browser.new_page()
        finally:
            browser.close()


def test_the_page_lists_functions_by_key_and_streams_a_chat(workspace: Workspace, page: Page) -> None:
    folder = workspace.add_function(FUNCTION)
    assert workspace.pkg("deploy", str(folder)).returncode == 0
    key = (workspace.state_dir() / "api-key").read_text()

    page.goto(f"{workspace.gateway_url}/")
    expect(page.locator("#base")).to_have_text(f"{workspace.gateway_url}/v1")
    expect(page.locator("#status")).to_have_text("no function opens with these keys")  # the key is needed

    page.fill("#key", "not-the-key")
    page.click("#key-form button")
    expect(page.locator("#key-note")).to_contain_text("that key was not added: incorrect API key provided")

    page.fill("#key", key)
    page.click("#key-form button")
    row = page.locator(f'tr[data-name="{FUNCTION}"]')
    expect(row.locator(".state")).to_have_text("ready")
    expect(row).to_contain_text("chat")
    requests_before = int(row.locator(".requests").inner_text())

    question = "What is 2 + 2?"
    page.fill("#prompt", question)
    page.click("#send")
    first = page.locator(".turn.assistant").nth(0)
    expect(first).to_have_attribute("data-done", "true", timeout=60_000)
    # The demo is greedy: the page's streamed reply is what the API answers to the same conversation.
    client = openai.OpenAI(base_url=f"{workspace.gateway_url}/v1", api_key=key, max_retries=0, timeout=60)
    messages: list[dict[str, str]] = [{"role": "user", "content": question}]
    expected = client.chat.completions.create(model=FUNCTION, messages=messages).choices[0].message.content
    assert first.inner_text() == expected and expected

    page.fill("#prompt", "And 3 + 3?")
    page.keyboard.press("Enter")  # Enter sends
    second = page.locator(".turn.assistant").nth(1)
    expect(second).to_have_attribute("data-done", "true", timeout=60_000)
    messages += [{"role": "assistant", "content": expected}, {"role": "user", "content": "And 3 + 3?"}]
    follow_up = client.chat.completions.create(model=FUNCTION, messages=messages).choices[0].message.content
    assert second.inner_text() == follow_up  # the page sent the whole conversation

    # Live figures, read from the function's /metrics by the gateway every poll.
    expect(row.locator(".ttft")).to_have_text(re.compile(r"^\d+ ms$"), timeout=10_000)
    expect(row.locator(".rate")).to_have_text(re.compile(r"^\d+\.\d$"), timeout=10_000)
    page.wait_for_function(
        f"Number(document.querySelector('tr[data-name=\"{FUNCTION}\"] .requests').textContent) >= "
        f"{requests_before + 4}",
        timeout=10_000,
    )

    page.click("#reset")
    expect(page.locator(".turn")).to_have_count(0)
