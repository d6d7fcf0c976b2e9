"""Quality verification: how far a quantized export drifts from the fp32 export, and whether it may ship.

The fp32 ONNX export is the reference. It first proves itself against PyTorch (`torch_parity`: same
greedy tokens). Each candidate precision is then compared with it on fixed chat prompts, teacher-forced
on fp32's own greedy continuation (top-1 agreement, KL per position, whether its free-running greedy
decode would stay identical), and on a held-out plain text (perplexity). The reference's side of every
comparison is computed once, when the `QualityEvaluator` is made.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from packager.errors import UserError
from runtime.engine.kv_cache import common_prefix_length

CONTINUATION_TOKENS = 24
QUALITY_FORMAT_VERSION = 1
_DATA = files("packager") / "data"
_NUMPY_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}

Progress = Callable[[int, int], None]
Feeds = dict[str, np.ndarray]  # graph inputs by name


@dataclass(frozen=True)
class QualityBudget:
    min_top1_agreement: float = 0.95
    max_mean_kl: float = 0.02
    max_perplexity_increase_pct: float = 10.0


@dataclass(frozen=True)
class CandidateQuality:
    precision: str
    top1_agreement: float
    mean_kl: float
    max_kl: float
    perplexity: float
    perplexity_increase_pct: float
    greedy_match_prompts: int
    greedy_prompts: int
    failures: tuple[str, ...]  # why it breaks the budget, with the numbers; empty when it passes

    @property
    def passes(self) -> bool:
        return not self.failures


@dataclass(frozen=True)
class ReferenceParity:
    """Greedy tokens of the fp32 ONNX export against the PyTorch model, on the fixed prompt set."""

    prompts: int
    identical_greedy: int
    first_divergence: list[int | None]  # per prompt: index of the first differing new token, None if identical


class _Decoder:
    """A decoder graph exported by onnxruntime-genai's model builder, run with plain ONNX Runtime.

    Every call starts from an empty or a caller-held KV cache; the graph accepts a past of length 0,
    so one forward can score a whole sequence.
    """

    def __init__(self, onnx_dir: Path, threads: int, feeds: Feeds | None = None) -> None:
        """`feeds`: inputs every forward gets besides the tokens and the cache (a LoRA adapter's, for one row)."""
        self._feeds = feeds or {}
        config_path = onnx_dir / "genai_config.json"
        if not config_path.is_file():
            raise UserError(f"{onnx_dir} has no genai_config.json: it is not an export of the genai model builder")
        model = json.loads(config_path.read_text())["model"]
        decoder = model["decoder"]
        self.context_length: int = model["context_length"]
        eos = model.get("eos_token_id", [])
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos])

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        # Spinning threads steal the only other core from the process's own work on a 2-core machine.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        model_path = onnx_dir / decoder["filename"]
        self._session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])

        names, layers = decoder["inputs"], range(decoder["num_hidden_layers"])
        outputs = decoder["outputs"]
        self._input_ids, self._attention_mask = names["input_ids"], names["attention_mask"]
        self._logits = outputs["logits"]
        self._past = [names[kind] % i for i in layers for kind in ("past_key_names", "past_value_names")]
        self._present = [outputs[kind] % i for i in layers for kind in ("present_key_names", "present_value_names")]
        graph_inputs = {i.name: i for i in self._session.get_inputs()}
        missing = [n for n in (self._input_ids, self._attention_mask, *self._past) if n not in graph_inputs]
        if missing:
            raise UserError(f"{model_path} lacks the inputs its genai_config.json names: {', '.join(missing)}")
        dtype = _NUMPY_DTYPES[graph_inputs[self._past[0]].type]
        shape = (1, decoder["num_key_value_heads"], 0, decoder["head_size"])
        self._empty_past = [np.zeros(shape, dtype) for _ in self._past]

    def forward(
        self, token_ids: Sequence[int], past: list[np.ndarray] | None = None, *, keep_cache: bool = False
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Logits `[len(token_ids), vocab]` as float32, and the grown cache when `keep_cache`."""
        past = past if past is not None else self._empty_past
        feeds = {
            self._input_ids: np.asarray([token_ids], dtype=np.int64),
            self._attention_mask: np.ones((1, past[0].shape[2] + len(token_ids)), dtype=np.int64),
            **dict(zip(self._past, past, strict=True)),
            **self._feeds,
        }
        outputs = self._session.run([self._logits, *self._present] if keep_cache else [self._logits], feeds)
        return outputs[0][0].astype(np.float32, copy=False), outputs[1:]

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int, past: list[np.ndarray] | None = None) -> list[int]:
        """Free-running greedy decode with the KV cache (after `past`, if given), stopping after an EOS token."""
        logits, cache = self.forward(prompt_ids, past, keep_cache=True)
        tokens: list[int] = []
        while True:
            token = int(np.argmax(logits[-1]))
            tokens.append(token)
            if token in self.eos_token_ids or len(tokens) == max_new_tokens:
                return tokens
            logits, cache = self.forward([token], cache, keep_cache=True)


class QualityEvaluator:
    """Compares candidate exports with the fp32 reference export on the fixed prompts and held-out text.

    `progress(done, total)` is called as work advances; each phase (the reference pass here, then every
    `evaluate`) starts again from `done = 0`.
    """

    def __init__(
        self,
        reference_onnx_dir: Path,
        tokenizer_path: Path,
        chat_template: str | None,
        *,
        threads: int = 2,
        progress: Progress | None = None,
        feeds: Feeds | None = None,
    ) -> None:
        """`feeds`: extra inputs of the reference and every candidate (one LoRA adapter, packager/adapters/)."""
        self._threads = threads
        self._feeds = feeds
        self._progress = progress
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        self._prompts = prompt_token_ids(tokenizer, chat_template)
        self._heldout = tokenizer.encode(heldout_text(), add_special_tokens=False).ids
        # The prompts share the chat template's system preamble: its KV is computed once per model.
        # (Each prompt keeps at least its last token: its logits predict the continuation's first.)
        shortest = min(map(len, self._prompts))
        self._prefix = self._prompts[0][: min(common_prefix_length(self._prompts), shortest - 1)]

        total = 2 + 2 * len(self._prompts)
        self._report(0, total)
        reference = _Decoder(reference_onnx_dir, threads, feeds)
        self._report(1, total)
        self._continuations = []
        prefix_cache = self._prefix_cache(reference)
        for done, prompt in enumerate(self._prompts, start=2):
            own = prompt[len(self._prefix) :]
            self._continuations.append(reference.greedy(own, CONTINUATION_TOKENS, prefix_cache))
            self._report(done, total)
        self._reference_log_probs = [
            _log_softmax(logits) for logits in self._continuation_logits(reference, 2 + len(self._prompts), total)
        ]
        self._vocab_size = self._reference_log_probs[0].shape[-1]
        self._reference_argmax = [log_probs.argmax(axis=-1) for log_probs in self._reference_log_probs]
        self.reference_perplexity = _perplexity(reference, self._heldout)
        self._report(total, total)

    def evaluate(
        self, candidate_onnx_dir: Path, precision: str, budget: QualityBudget, *, progress: Progress | None = None
    ) -> CandidateQuality:
        """Measure one candidate; `progress`, if given, receives this and later reports."""
        if progress is not None:
            self._progress = progress
        total = 2 + len(self._prompts)
        self._report(0, total)
        candidate = _Decoder(candidate_onnx_dir, self._threads, self._feeds)
        self._report(1, total)
        agreeing = positions = greedy_matches = 0
        kl_per_position: list[np.ndarray] = []
        for logits, reference, reference_argmax, continuation in zip(
            self._continuation_logits(candidate, 1, total),
            self._reference_log_probs,
            self._reference_argmax,
            self._continuations,
            strict=True,
        ):
            if logits.shape[-1] != self._vocab_size:
                raise UserError(
                    f"{candidate_onnx_dir} predicts over {logits.shape[-1]} tokens, the fp32 reference over "
                    f"{self._vocab_size}: they are not exports of the same model"
                )
            log_probs = _log_softmax(logits)
            kl_per_position.append(np.sum(np.exp(reference) * (reference - log_probs), axis=-1))
            argmax = logits.argmax(axis=-1)
            agreeing += int(np.sum(argmax == reference_argmax))
            positions += len(argmax)
            # Attention is causal, so the candidate's greedy decode stays on fp32's path as long as its
            # argmax at each teacher-forced position is fp32's next token: one forward answers for the
            # whole decode (with prefill numerics; quantized kernels round one-token steps slightly apart).
            greedy_matches += int(np.array_equal(argmax, continuation))
        perplexity = _perplexity(candidate, self._heldout)
        self._report(total, total)

        kl = np.concatenate(kl_per_position)
        top1, mean_kl, max_kl = agreeing / positions, float(kl.mean()), float(kl.max())
        increase_pct = (perplexity / self.reference_perplexity - 1.0) * 100.0
        return CandidateQuality(
            precision=precision,
            top1_agreement=top1,
            mean_kl=mean_kl,
            max_kl=max_kl,
            perplexity=perplexity,
            perplexity_increase_pct=increase_pct,
            greedy_match_prompts=greedy_matches,
            greedy_prompts=len(self._prompts),
            failures=_budget_failures(top1, mean_kl, perplexity, increase_pct, self.reference_perplexity, budget),
        )

    def _continuation_logits(self, decoder: _Decoder, done: int, total: int) -> list[np.ndarray]:
        """Per prompt, the logits predicting each token of fp32's continuation, from one forward."""
        prefix_cache = self._prefix_cache(decoder)
        results = []
        for prompt, continuation in zip(self._prompts, self._continuations, strict=True):
            own = prompt[len(self._prefix) :]
            logits, _ = decoder.forward(own + continuation[:-1], prefix_cache)
            results.append(logits[len(own) - 1 :])
            done += 1
            self._report(done, total)
        return results

    def _prefix_cache(self, decoder: _Decoder) -> list[np.ndarray] | None:
        return decoder.forward(self._prefix, keep_cache=True)[1] if self._prefix else None

    def _report(self, done: int, total: int) -> None:
        if self._progress is not None:
            self._progress(done, total)


def torch_parity(
    hf_dir: Path,
    reference_onnx_dir: Path,
    tokenizer_path: Path,
    chat_template: str | None,
    *,
    new_tokens: int = 16,
    threads: int = 2,
    feeds: Feeds | None = None,
    adapt: Callable[[Any], Any] | None = None,
) -> ReferenceParity:
    """Whether the fp32 ONNX export decodes the same greedy tokens as the PyTorch model it came from.

    `threads` is ONNX Runtime's; PyTorch runs on one thread. With a LoRA adapter, `feeds` are its inputs
    to the graph and `adapt` turns the loaded PyTorch model into the adapted one (PEFT's merge).
    """
    import torch
    from transformers import AutoModelForCausalLM

    prompts = prompt_token_ids(Tokenizer.from_file(str(tokenizer_path)), chat_template)
    # ONNX first, then torch: two thread pools taking turns in one process spin against each other.
    onnx_model = _Decoder(reference_onnx_dir, threads, feeds)
    expected = [onnx_model.greedy(prompt, new_tokens) for prompt in prompts]
    del onnx_model

    torch_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    if adapt is not None:
        torch_model = adapt(torch_model).eval()
    divergences: list[int | None] = []
    previous_threads = torch.get_num_threads()
    # One thread: torch's OpenMP pool collapses when the cores are shared (measured on a loaded 2-core
    # machine: 3.4x slower with 2 threads than with 1), and this is a correctness check, not a race.
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for prompt, onnx_tokens in zip(prompts, expected, strict=True):
                # Teacher-forced on ONNX's tokens, one forward: torch's greedy decode follows them up to
                # the first position where its argmax differs, and that position is the divergence.
                logits = torch_model(input_ids=torch.tensor([prompt + onnx_tokens[:-1]])).logits[0]
                torch_tokens = logits[len(prompt) - 1 :].argmax(dim=-1).tolist()
                pairs = enumerate(zip(onnx_tokens, torch_tokens, strict=True))
                divergences.append(next((i for i, (a, b) in pairs if a != b), None))
    finally:
        torch.set_num_threads(previous_threads)
    identical = sum(d is None for d in divergences)
    return ReferenceParity(prompts=len(prompts), identical_greedy=identical, first_divergence=divergences)


def write_quality_json(
    path: Path,
    parity: ReferenceParity | None,
    candidates: list[CandidateQuality],
    chosen: str,
    budget: QualityBudget,
    compared: list[CandidateQuality] | None = None,
    adapters: dict[str, Any] | None = None,
) -> None:
    """`compared`: figures measured beside the candidates for reference (quantize.YARDSTICK), never chosen.
    `adapters`: each LoRA adapter's own parity and quality (packager/adapters/build.py), by name."""
    report: dict[str, Any] = {
        "format_version": QUALITY_FORMAT_VERSION,
        "chosen": chosen,
        "budget": asdict(budget),
        "reference": "fp32",
        "torch_parity": asdict(parity) if parity is not None else None,
        "candidates": [candidate_json(candidate) for candidate in candidates],
        "compared": [candidate_json(candidate) for candidate in compared or []],
        **({"adapters": adapters} if adapters else {}),
        "method": {
            "prompts": len(load_prompts()),
            "continuation_tokens": CONTINUATION_TOKENS,
            "kl": "KL(p_fp32 || p_candidate) per position, teacher-forced on fp32's greedy continuation",
            "perplexity": "held-out plain text, every token after the first",
        },
    }
    path.write_text(json.dumps(report, indent=2, sort_keys=True, allow_nan=False) + "\n")


def candidate_json(candidate: CandidateQuality) -> dict[str, Any]:
    """A candidate as quality.json holds it."""
    # JSON has no NaN or infinity; a broken candidate's non-numbers are written as null.
    fields = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in asdict(candidate).items()}
    return {**fields, "failures": list(candidate.failures), "passes": candidate.passes}


def load_prompts() -> list[list[dict[str, str]]]:
    """The fixed chat prompts, each a list of `{"role", "content"}` messages."""
    data = json.loads((_DATA / "quality_prompts.json").read_text())
    return [prompt["messages"] for prompt in data["prompts"]]


def heldout_text() -> str:
    return (_DATA / "heldout.txt").read_text()


def render_chat(chat_template: str, messages: list[dict[str, str]]) -> str:
    """Render a Hugging Face chat template the way `apply_chat_template` does, in a sandbox."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.globals["raise_exception"] = _raise_template_error
    return environment.from_string(chat_template).render(messages=messages, add_generation_prompt=True)


def prompt_token_ids(tokenizer: Tokenizer, chat_template: str | None) -> list[list[int]]:
    """Token ids of every fixed prompt; without a chat template, the messages' contents as plain text.

    Plain text is encoded the way the completions API encodes it: with the tokenizer's own special tokens
    (Gemma's `<bos>`; a base model without it degenerates). A chat template writes them itself.
    """
    texts = [
        render_chat(chat_template, messages) if chat_template else "\n".join(m["content"] for m in messages)
        for messages in load_prompts()
    ]
    return [tokenizer.encode(text, add_special_tokens=chat_template is None).ids for text in texts]


def _raise_template_error(message: str) -> None:
    raise UserError(f"the chat template refused the quality prompts: {message}")


def _budget_failures(
    top1: float, mean_kl: float, perplexity: float, increase_pct: float, reference: float, budget: QualityBudget
) -> tuple[str, ...]:
    # Written as `not (value within limit)` so that NaN, from a broken graph, fails every check.
    failures = []
    if not top1 >= budget.min_top1_agreement:
        failures.append(f"top-1 agreement with fp32 {top1:.3f} is below the minimum {budget.min_top1_agreement:.3f}")
    if not mean_kl <= budget.max_mean_kl:
        failures.append(f"mean KL divergence from fp32 {mean_kl:.4f} is above the maximum {budget.max_mean_kl:.4f}")
    if not increase_pct <= budget.max_perplexity_increase_pct:
        failures.append(
            f"held-out perplexity {perplexity:.2f} is {increase_pct:+.1f}% vs fp32's {reference:.2f}, "
            f"above the maximum +{budget.max_perplexity_increase_pct:.1f}%"
        )
    return tuple(failures)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def _perplexity(decoder: _Decoder, token_ids: list[int]) -> float:
    token_ids = token_ids[: decoder.context_length]
    logits, _ = decoder.forward(token_ids[:-1])
    log_probs = _log_softmax(logits)[np.arange(len(token_ids) - 1), token_ids[1:]]
    return float(np.exp(-log_probs.mean()))
