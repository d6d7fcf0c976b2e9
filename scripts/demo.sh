#!/usr/bin/env bash
# README command (a): on a fresh machine, set up, build the demo function, serve it on the `local`
# target, and send it one chat request. The endpoint stays up afterwards; the last lines say how to
# use and stop it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
pkg=.venv/bin/pkg
function=functions/smollm2-chat
"$pkg" build "$function"
"$pkg" deploy "$function" --target local
"$pkg" invoke "$function" "${1:-Why is the sky blue? Answer in two sentences.}"
echo
echo "The endpoint is still running: '$pkg status $function' shows it; '$pkg destroy $function --target local' stops it."
