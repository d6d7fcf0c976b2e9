"""The docs keep up with the code: every error code has a troubleshooting entry, every target a page."""

from __future__ import annotations

from pathlib import Path

from packager.error_catalog import (
    TROUBLESHOOTING,
    cli_errors,
    documented_codes,
    http_error_codes,
    rendered_page,
)
from packager.targets.base import TARGETS

DOCS = Path(__file__).resolve().parents[2] / "docs"
TARGET_PAGES = {"greengrass": "edge.md", "jetson": "edge.md"}


def test_every_http_error_code_has_a_troubleshooting_entry() -> None:
    missing = http_error_codes() - documented_codes(TROUBLESHOOTING.read_text())
    assert not missing, f"add a '### `code`' entry to docs/troubleshooting.md for: {sorted(missing)}"


def test_the_cli_error_list_is_generated_from_the_current_code() -> None:
    assert TROUBLESHOOTING.read_text() == rendered_page(), "run .venv/bin/python -m packager.error_catalog"


def test_the_catalogue_reads_real_messages_with_their_exit_codes() -> None:
    errors = cli_errors()
    assert len(errors) > 50
    assert any(e.exit_code == 2 and "--force" in e.template for e in errors)  # pkg init's refusal
    assert all(e.template.strip() for e in errors)


def test_every_deploy_target_has_a_page() -> None:
    for target in TARGETS:
        page = DOCS / "targets" / TARGET_PAGES.get(target, f"{target}.md")
        assert page.is_file(), f"document --target {target} in {page}"
        assert "verified" in page.read_text().lower(), f"{page} must say what was verified here"


def test_the_api_page_is_generated_from_the_served_openapi_document() -> None:
    from packager.api_reference import API_PAGE, render

    assert API_PAGE.read_text() == render(), "run .venv/bin/python -m packager.api_reference"
    assert "### `POST /v1/chat/completions`" in API_PAGE.read_text()
    assert "### `POST /v1/embeddings`" in API_PAGE.read_text()
