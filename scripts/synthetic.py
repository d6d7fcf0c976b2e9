"""Write a synthetic GGUF of a published model shape (random weights, real shapes and type mixes).

    .venv/bin/python scripts/synthetic.py llama-3.1-8b --types q4_k_m            # into the cache; prints its path
    .venv/bin/python scripts/synthetic.py llama-3.2-1b --out /tmp/1b.gguf --seed 1

The bench and the tests call the Python API instead: packager.synthetic.synthetic_gguf(name, mix, seed, layers).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from packager.errors import UserError
from packager.synthetic import PUBLISHED_CONFIGS, TYPE_MIXES, published_config, synthetic_gguf, write_synthetic_gguf


def _high_water_mark_kib() -> int:
    """This process's peak resident memory since exec (VmHWM; ru_maxrss would count the parent's at fork)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help=f"a published config: {', '.join(PUBLISHED_CONFIGS)}")
    parser.add_argument("--types", choices=list(TYPE_MIXES), default="q4_1", help="the type mix (default q4_1)")
    parser.add_argument("--seed", type=int, default=0, help="the weights' seed (default 0)")
    parser.add_argument("--layers", type=int, help="fewer decoder layers than published (a small file of the shape)")
    parser.add_argument("--out", type=Path, help="write here instead of into the cache")
    args = parser.parse_args()
    start = time.perf_counter()
    try:
        if args.out is None:
            path = synthetic_gguf(args.name, args.types, args.seed, args.layers)
        else:
            config = published_config(args.name)
            if args.layers is not None:
                config = config.with_layers(args.layers)
            path = write_synthetic_gguf(config, args.out, args.types, args.seed)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    peak_mib = _high_water_mark_kib() / 1024
    print(
        f"{path}\n{path.stat().st_size / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s, "
        f"peak RSS {peak_mib:.0f} MiB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
