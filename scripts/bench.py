"""onnxfn's benchmark: onnxfn against onnxruntime-genai, llama.cpp and transformers, side by side.
The suite is `packager/bench/suite.py`; this is its command line.

    .venv/bin/python scripts/bench.py                  # the demo (smollm2): every section, every system
    .venv/bin/python scripts/bench.py --model gemma3   # Gemma-3-270M, written to bench/gemma3/
    .venv/bin/python scripts/bench.py --quick          # a smoke run: fewer rounds, fewer tokens
    # every figure the targets table reads, quickly (~1 min for smollm2, ~5 min for gemma3 on 2 busy cores):
    .venv/bin/python scripts/bench.py --quick --sections decode,concurrency,quality,memory \
        --systems onnxfn,onnxfn-http,genai-int8,genai-int4,llamacpp,llamacpp-server [--model gemma3]
    .venv/bin/python scripts/bench.py --sections decode --systems onnxfn,genai,ort-loop --rounds 30 --out bench/batch1
    .venv/bin/python scripts/bench.py --sections concurrency --systems onnxfn,onnxfn-http,genai,ort-loop \
        --rounds 20 --out bench/concurrency

--model picks the function (smollm2: functions/smollm2-chat, gemma3: functions/gemma3-completion); its
bundle is built by `pkg build` if missing, and its GGUF (llama.cpp), fp32 HF folder (transformers) and the
builder's int8 / int4 exports (genai-int8, genai-int4) come from the packager's resolution of its source.
Writes results.md and results.json to --out (default bench/ for smollm2, bench/MODEL/ otherwise). The method
is /work/shared/BENCHMARKS.md: same prompt tokens, same new-token count (EOS ignored), same threads,
warm-up excluded, interleaved rounds, medians. Install the peers first: scripts/setup_bench.sh.
"""

import sys

from packager.bench.suite import run

if __name__ == "__main__":
    sys.exit(run())
