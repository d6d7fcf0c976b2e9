"""Quality verification: how far a quantized export drifts from the fp32 reference, and whether it may ship.

The fp32 reference is the structure's fp32 graph with its weights computed from the source a few layers at a
time (segments.py), never whole. It first proves itself against PyTorch (`parity`, the model run under
accelerate's offload, torch_reference.py); each candidate is then compared with it on fixed chat prompts and
answers and a held-out text (texts.py, quality.py). A candidate that ships is measured from its written files;
one only measured for comparison (quantize.YARDSTICK) is made in memory a segment at a time, so no build writes
more to disk than the bundle and holds more in memory than a few layers.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
from tokenizers import Tokenizer

from packager.export.builder import ExportOptions as _ExportOptions
from packager.export.builder import ExportResult, StructureResult, precision_rewrite
from packager.sources import SourceModel
from packager.verify.quality import (
    TIE_MARGIN,
    CandidateQuality,
    QualityBudget,
    ReferenceParity,
    Scores,
    candidate_json,
    compare,
    parity,
    write_quality_json,
)
from packager.verify.segments import ExportSystem, RunReport, StructureSystem, System, run_sequences
from packager.verify.texts import (
    Sequences,
    heldout_text,
    load_answers,
    load_prompts,
    prompt_token_ids,
    quality_sequences,
    render_chat,
)
from packager.verify.torch_reference import Adapt, torch_scores
from runtime.engine.heap import release_free_memory

__all__ = [
    "TIE_MARGIN", "CandidateQuality", "ExportSystem", "QualityBudget", "ReferenceParity", "RunReport", "Scores",
    "Sequences", "StructureSystem", "System", "Verifier", "candidate_json", "heldout_text", "load_answers",
    "load_prompts", "prompt_token_ids", "render_chat", "write_quality_json",
]  # fmt: skip

Progress = Callable[[int, int], None]


class Verifier:
    """The fp32 reference of one structure and source, and every comparison with it (each figure computed once)."""

    def __init__(
        self,
        structure: StructureResult,
        source: SourceModel,
        max_positions: int,
        *,
        threads: int = 2,
        extra: dict[str, np.ndarray] | None = None,
        graph: System | None = None,
    ) -> None:
        """`extra`: inputs every sequence gets (a LoRA adapter's); `graph`: the fp32 reference when it is not the
        structure's fp32 graph computed from the source (a GGUF's own blocks at fp32 compute, an adapted graph)."""
        self.structure = structure
        self.source = source
        self.max_positions = max_positions
        self.threads = threads
        self.extra = extra
        self._reference_system = graph
        self.reports: dict[str, RunReport] = {}
        self._reference: Scores | None = None
        directory = structure.directory
        config = json.loads((directory / "genai_config.json").read_text())["model"]
        self._decoder = config["decoder"]
        self.context_length = min(int(config["context_length"]), max_positions)
        template_path = directory / "chat_template.jinja"
        template = template_path.read_text() if template_path.is_file() else None
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.sequences = quality_sequences(tokenizer, template, self.context_length)

    def system(self, options: _ExportOptions) -> StructureSystem:
        """A precision computed in memory a segment at a time (never written)."""
        rewrite = precision_rewrite(self.structure.structure, self.source, options, self.max_positions)
        return StructureSystem(self.structure.structure, rewrite, options.precision)

    def export_system(self, export: ExportResult) -> ExportSystem:
        return ExportSystem(export.directory, export.options.precision)

    def scores(self, system: System, progress: Progress | None = None, *, heldout: bool = True) -> Scores:
        sequences = self.sequences.all if heldout else list(self.sequences.prompts)
        scores = Scores(self.sequences)
        _, report = run_sequences(
            system, sequences, self._feeds, scores.keep, threads=self.threads, progress=progress, extra=self.extra
        )
        self.reports[system.name] = report
        return scores

    @property
    def reference_name(self) -> str:
        """What the reference is, for cache keys: the structure's fp32 graph or a graph given to the verifier."""
        return "structure-fp32" if self._reference_system is None else type(self._reference_system).__name__

    def reference(self, progress: Progress | None = None) -> Scores:
        """The fp32 reference's scores, computed on first use."""
        if self._reference is None:
            system = self._reference_system or self.system(_ExportOptions("fp32"))
            self._reference = self.scores(system, progress)
        return self._reference

    def parity(self, adapt: Adapt | None = None, progress: Progress | None = None) -> ReferenceParity:
        reference = self.reference(progress)
        weights = self.source.weights()
        torch = torch_scores(self.source.hf_dir, weights, self.sequences, self.max_positions, adapt=adapt)
        release_free_memory()  # what PyTorch's forward freed, before the next step allocates (segments.py)
        return parity(reference, torch)

    def evaluate(
        self, system: System, precision: str, budget: QualityBudget, progress: Progress | None = None
    ) -> CandidateQuality:
        reference = self.reference(progress)
        return compare(self.scores(system, progress), reference, precision, budget)

    def _feeds(self, sequence: tuple[int, ...]) -> dict[str, np.ndarray]:
        decoder = self._decoder
        names = decoder["inputs"]
        feeds = {
            names["input_ids"]: np.asarray([sequence], np.int64),
            names["attention_mask"]: np.ones((1, len(sequence)), np.int64),
        }
        empty = np.zeros((1, decoder["num_key_value_heads"], 0, decoder["head_size"]), np.float32)
        for layer in range(decoder["num_hidden_layers"]):
            feeds[names["past_key_names"] % layer] = empty
            feeds[names["past_value_names"] % layer] = empty
        return feeds
