"""SnapStart hooks: warm the engine before the snapshot, reseed and refresh after a restore."""

from __future__ import annotations

import random

import numpy as np
import pytest
import snapshot_restore_py

from runtime.aws_lambda import snapstart
from runtime.bundle import Bundle
from runtime.engine.engine import Engine
from tests.coldstart.conftest import SMALL


@pytest.fixture()
def clean_registries() -> None:
    snapshot_restore_py.get_before_snapshot().clear()
    snapshot_restore_py.get_after_restore().clear()


def test_snap_start_init_registers_hooks_instead_of_loading(
    monkeypatch: pytest.MonkeyPatch, clean_registries: None
) -> None:
    loads: list[int] = []
    monkeypatch.setenv(snapstart.INIT_TYPE_ENV, "snap-start")
    snapstart.initialize(lambda: loads.append(1), refresh=lambda: None)
    assert loads == []
    [(before, _, _)] = snapshot_restore_py.get_before_snapshot()
    [(after, _, _)] = snapshot_restore_py.get_after_restore()
    assert before is snapstart.before_snapshot and after is snapstart.after_restore
    monkeypatch.setenv(snapstart.INIT_TYPE_ENV, "on-demand")
    snapstart.initialize(lambda: loads.append(1), refresh=lambda: None)  # on-demand: loads in the init phase
    assert loads == [1]


def test_before_snapshot_loads_and_warms_the_engine(bundle: Bundle) -> None:
    engine = Engine(bundle, SMALL)
    engine.start()
    try:
        loads: list[int] = []
        snapstart.before_snapshot(lambda: loads.append(1) or engine)
        assert loads == [1]
        assert engine.stats().tokens_out == 1 and engine.stats().steps >= 1
    finally:
        engine.shutdown()


def test_after_restore_reseeds_and_refreshes() -> None:
    copies = []
    refreshed: list[str] = []
    for _ in range(2):  # two restores of one snapshot start from the same generator state
        random.seed(1)
        np.random.seed(1)
        snapstart.after_restore(lambda: refreshed.append("aws clients"))
        copies.append((random.random(), float(np.random.random())))
    assert copies[0] != copies[1]
    assert refreshed == ["aws clients", "aws clients"]
