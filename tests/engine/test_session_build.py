"""Sessions built on a helper thread: now, or only once asked for."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from runtime.engine import session_build
from runtime.engine.session_build import SessionBuild, SessionOptions


def identity_model(path: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10), str(path))
    return path


def test_a_build_not_started_waits_for_start_and_holds_up_no_exit(tmp_path: Path) -> None:
    build = SessionBuild(identity_model(tmp_path / "m.onnx"), SessionOptions(threads=1), start=False)
    time.sleep(0.2)
    assert not build.done
    # The exit waits for builds that run (ONNX Runtime aborts a process exiting mid-build); never for this one.
    assert build._done not in session_build._building
    build.start()
    build.start()  # once only
    session = build.result()
    assert session.run(None, {"x": np.arange(3, dtype=np.float32)})[0].tolist() == [0.0, 1.0, 2.0]


def test_result_starts_a_build_that_was_not_started(tmp_path: Path) -> None:
    build = SessionBuild(identity_model(tmp_path / "m.onnx"), SessionOptions(threads=1), start=False)
    assert build.result() is not None and build.done
