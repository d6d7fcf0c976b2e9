"""onnxfn's benchmark, from a checkout: `.venv/bin/python scripts/bench.py --help`.

The suite, its usage and its method are in `packager/bench/suite.py`; results go to bench/.
"""

import sys

from packager.bench.suite import run

if __name__ == "__main__":
    sys.exit(run())
