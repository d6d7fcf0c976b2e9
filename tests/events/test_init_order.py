"""A Lambda init begins building the model's session before it imports the queue and HTTP stack or builds
its AWS clients, so those overlap the build (`runtime.events.loading.begin_handler`).

Each init runs in a fresh interpreter, as Lambda's does: the start-up timeline and the imported modules are
per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from runtime.aws_lambda.handler import BUNDLE_ENV, FLAGS_ENV
from tests.encoder.conftest import ClassifierBuild
from tests.encoder.conftest import classifier_build as classifier_build  # (fixture)

# What the handler module must not import itself: the stack that now imports while the session builds.
HEAVY = ("runtime.aws_lambda.function", "runtime.events.handler", "mangum", "starlette", "boto3")

INIT = """
import json, sys
from runtime.aws_lambda import handler as lambda_handler
imported_first = sorted(m for m in {heavy!r} if m in sys.modules)
function = lambda_handler.loaded_function()
from runtime.timeline import TIMELINE
print(json.dumps({{"imported_first": imported_first, "spans": TIMELINE.to_json()["spans"]}}))
function.shutdown()
"""


def lambda_init(bundle: Path, flags: str) -> dict[str, object]:
    env = {**os.environ, BUNDLE_ENV: str(bundle), FLAGS_ENV: flags, "AWS_DEFAULT_REGION": "us-east-1"}
    completed = subprocess.run(
        [sys.executable, "-c", INIT.format(heavy=HEAVY)], env=env, capture_output=True, text=True, timeout=300
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return json.loads(completed.stdout.splitlines()[-1])


def test_a_chat_function_builds_its_session_while_the_rest_of_its_init_runs(demo_bundle: Path) -> None:
    init = lambda_init(demo_bundle, "--no-verify --max-batch 2 --max-context 256")
    assert init["imported_first"] == [], "the handler module imported the stack its init should overlap"
    spans = init["spans"]
    assert isinstance(spans, dict)
    # The session began first; the imports and the AWS clients came after, while it built.
    assert spans["session"][0] < spans["aws_clients"][0]


def test_an_encoder_function_signals_its_session_start_too(classifier_build: ClassifierBuild) -> None:
    """An embedding or classification bundle records its onnxruntime imports, so a frontend waiting for the
    session to begin resumes then, instead of after the whole `SESSION_START_WAIT`."""
    init = lambda_init(classifier_build.bundle, "--no-verify --max-batch 8")
    spans = init["spans"]
    assert isinstance(spans, dict)
    assert "imports_onnxruntime" in spans, sorted(spans)
    assert spans["imports_onnxruntime"][1] <= spans["aws_clients"][0]
