#!/usr/bin/env bash
# README command (b): set up if needed, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The image tests run a real registry and real containers: Debian packages, installed once.
bash scripts/setup_image_tools.sh
# Terraform (as a library), python-hcl2 and checkov (its own venv) for the infra/terraform checks.
bash scripts/setup_terraform_tools.sh
# CRIU >= 4.1 for the local target's process snapshots (Debian 12 ships 3.17): built once per machine.
bash scripts/setup_criu.sh
# Chromium for the gateway page's browser test (driven by playwright, from the test extra).
bash scripts/setup_browser.sh
# Types first (~30 s cold): mypy over packager/ and runtime/, strict on the deploy targets and the engine
# ([tool.mypy] in pyproject.toml).
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -q "$@"
