#!/usr/bin/env bash
# Install the real browser the gateway page's test drives (tests/deploy_local/test_gateway_page.py): Debian's
# chromium, run by the `playwright` Python package (the test extra) through its executable_path, since
# playwright's own browser download cannot be fetched here. Needs root for apt-get. Re-running it is a no-op.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/apt.sh

apt_install_missing "for the gateway page's browser test" chromium
