"""A successful build prints no known-harmless torch export warning and no "0/None" progress (issue 39)."""

from __future__ import annotations

import io
import warnings
from pathlib import Path

from rich.console import Console

from packager.export import encoder as encoder_export
from packager.progress import StepProgress

HARMLESS = ("the exported graph will produce incorrect results", "Converting a tensor to a Python boolean")


def test_a_step_without_a_total_shows_no_count() -> None:
    out = io.StringIO()  # a terminal, as the live display needs, without colours between the words
    progress = StepProgress(console=Console(file=out, force_terminal=True, color_system=None, width=120))
    with progress.step("spin", "a step that never says how far it is"):
        pass
    with progress.step("count", "a step that counts") as step:
        step.update(3, 10)
    text = out.getvalue()
    assert "None" not in text, text
    assert "3/10" in text and "✓ a step that counts" in text


def test_off_a_terminal_each_step_is_one_line() -> None:
    out = io.StringIO()
    progress = StepProgress(console=Console(file=out, force_terminal=False, width=120))
    with progress.step("one", "first step") as step:
        step.update(1, 2)
    with progress.step("two", "second step") as step:
        step.cached()
    lines = out.getvalue().splitlines()
    assert [line.split(" ")[1] for line in lines] == ["first", "second"] and all(lines), lines


def test_exporting_an_encoder_prints_neither_harmless_warning(tmp_path: Path) -> None:
    from tests.encoder.tiny_classifier import make_tiny_classifier

    model = make_tiny_classifier(tmp_path / "tiny")
    out = tmp_path / "export"
    out.mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encoder_export._export(model, out, classifier=True)
    shown = [str(w.message) for w in caught]
    assert not [m for m in shown if any(h in m for h in HARMLESS)], shown
    assert (out / encoder_export.MODEL_FILE).is_file()


def test_only_those_two_warnings_are_filtered() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        encoder_export._ignore_harmless_export_warnings()
        index = "Exporting aten::index operator of advanced indexing in opset 17 ... will produce incorrect results."
        boolean = "Converting a tensor to a Python boolean might cause the trace to be incorrect."
        warnings.warn_explicit(index, UserWarning, "symbolic_opset11.py", 1, module="torch.onnx._internal.x")
        warnings.warn_explicit(boolean, UserWarning, "masking_utils.py", 1, module="transformers.masking_utils")
        # The same texts from elsewhere, and other warnings from the same modules, still show.
        warnings.warn_explicit(boolean, UserWarning, "modeling_bert.py", 1, module="transformers.models.bert.x")
        warnings.warn_explicit("another export problem", UserWarning, "utils.py", 1, module="torch.onnx.utils")
    assert [str(w.message) for w in caught] == [boolean, "another export problem"]
