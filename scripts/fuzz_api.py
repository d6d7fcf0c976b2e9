"""API fuzzing: schemathesis cases generated from the server's own `/openapi.json`, against a real server.

    .venv/bin/python scripts/fuzz_api.py [--cases 2300] [--seed 11] [--json OUT]

Starts `python -m runtime serve` on the demo bundle with the limits the reliability tests use (so
`max_tokens` is bounded small by the document itself), runs the cases (schema-valid and schema-breaking,
JSON and msgpack) and checks that no answer is a 5xx or breaks the document, then that the server still
serves a real request and holds no slot. Exit 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.reliability.conftest import SERVER_FLAGS, assert_serves
from tests.reliability.fuzzing import run_fuzz
from tests.reliability.live import DEMO_BUNDLE, live_server


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # ~90 % of the budget becomes cases: a GET without parameters runs out of new cases after one.
    parser.add_argument("--cases", type=int, default=2300)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--bundle", type=Path, default=DEMO_BUNDLE)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--server-log", type=Path, help="keep the server's output here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="onnxfn-fuzz-") as scratch:
        with live_server(args.bundle, Path(scratch) / "server.log", SERVER_FLAGS) as server:
            report = run_fuzz(server, args.cases, seed=args.seed)
            try:
                assert_serves(server)
                serves = True
            except AssertionError:
                serves = False
        if args.server_log:
            args.server_log.write_bytes(server.log.read_bytes())
    rate = report.cases / report.seconds
    print(f"{report.cases} cases in {report.seconds:.0f} s ({rate:.1f}/s), {report.streams} streams")
    print(f"  statuses: {dict(sorted(report.statuses.items()))}")
    print(f"  request bodies: {dict(report.media)}")
    print(f"  5xx: {report.server_errors}; check failures: {len(report.failures)}; serves afterwards: {serves}")
    for failure in report.failures[:10]:
        print(f"  {failure[:400]}")
    if args.json:
        summary = {
            "cases": report.cases,
            "seconds": report.seconds,
            "statuses": {str(k): v for k, v in report.statuses.items()},
            "media": dict(report.media),
            "streams": report.streams,
            "server_errors": report.server_errors,
            "failures": report.failures,
            "serves_afterwards": serves,
        }
        args.json.write_text(json.dumps(summary, indent=2))
    return 0 if serves and not report.failures and report.server_errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
