"""The cold-start snapshot: produced by `pkg build`, restored at start, ignored when incompatible, same outputs."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import onnxruntime
import pytest

from runtime.bundle import Bundle, file_digest
from runtime.engine.engine import Engine
from runtime.engine.request import GenerationRequest, SamplingParams
from runtime.snapshot import SnapshotInfo, incompatibility, read_snapshot_info, restore_snapshot
from tests.coldstart.conftest import SMALL, SYSTEM_PROMPT, chat

QUESTIONS = ("What is the capital of France?", "Name three colours.", "Write a haiku about the sea.")


def greedy(engine: Engine, request_id: str, prompt: tuple[int, ...], tokens: int = 16) -> tuple[int, ...]:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return engine.generate(GenerationRequest(request_id, prompt, params))[0].token_ids


def test_build_snapshots_the_system_prompt_kv(bundle: Bundle, engine: Engine) -> None:
    info = read_snapshot_info(bundle.manifest)
    assert info is not None
    assert (info.onnxruntime, info.providers, info.kv_dtype) == (onnxruntime.__version__, ("cpu",), "float32")
    assert info.model_sha256 == bundle.manifest.files["model.onnx"].sha256
    alone, with_turn = info.prefixes
    system_only = [{"role": "system", "content": SYSTEM_PROMPT}]
    expected_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(system_only, False))
    assert alone.token_ids == tuple(expected_ids)
    assert len(alone.token_ids) == 21  # shorter than a 32-token prefix-cache block: pinned whole
    # The second adds the user turn's opening, `<|im_start|>user\n`: what every chat with a user turn shares.
    assert with_turn.name == "system_prompt_user_turn"
    assert with_turn.token_ids[:21] == alone.token_ids and len(with_turn.token_ids) == 24
    assert chat(engine, QUESTIONS[0])[:24] == with_turn.token_ids
    facts = bundle.manifest.model
    for prefix in (alone, with_turn):
        assert bundle.manifest.files[prefix.file] == file_digest(bundle.path / prefix.file)
        kv = np.load(bundle.path / prefix.file)
        assert kv.shape == (2 * facts.num_layers, facts.num_kv_heads, len(prefix.token_ids), facts.head_dim)
        # It is the KV this runtime computes for that prompt on this machine.
        np.testing.assert_allclose(kv, engine.compute_prefix(prefix.token_ids), rtol=0, atol=1e-4)
        assert np.abs(kv).max() > 0.1


def test_restored_snapshot_skips_the_system_prompt_and_keeps_outputs(bundle: Bundle, engine: Engine) -> None:
    restored = Engine(bundle, SMALL)
    restored.start()
    try:
        result = restore_snapshot(restored, bundle)
        assert result.ignored is None and result.restored_tokens == 21 + 24
        assert restored.stats().prefix_cache_bytes == (21 + 24) * bundle.manifest.model.kv_bytes_per_token()
        for i, question in enumerate(QUESTIONS):
            prompt = chat(engine, question)
            before = restored.stats()
            assert greedy(restored, f"snap-{i}", prompt) == greedy(engine, f"plain-{i}", prompt)
            after = restored.stats()
            assert after.prefix_hits == before.prefix_hits + 1
            assert after.tokens_in - before.tokens_in == len(prompt) - 24  # only the user's own words and the
            # assistant turn's opening
        # A chat that goes on with another role still skips the system block.
        assistant_first = tuple(
            restored.tokenizer.encode(
                restored.tokenizer.apply_chat_template(
                    [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "assistant", "content": "Hello."}]
                )
            )
        )
        before = restored.stats()
        assert greedy(restored, "assistant-first", assistant_first) == greedy(engine, "af-plain", assistant_first)
        assert restored.stats().tokens_in - before.tokens_in == len(assistant_first) - 21
        # A chat without the system prompt shares no prefix with it: computed in full, same tokens.
        other = chat(engine, QUESTIONS[0], system="Answer in French.")
        assert greedy(restored, "other", other) == greedy(engine, "other-plain", other)
    finally:
        restored.shutdown()


def _with_snapshot(bundle: Bundle, **changes: object) -> Bundle:
    assert bundle.manifest.snapshot is not None
    snapshot = {**bundle.manifest.snapshot, **changes}
    return dataclasses.replace(bundle, manifest=dataclasses.replace(bundle.manifest, snapshot=snapshot))


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"onnxruntime": "1.0.0"}, "made with onnxruntime 1.0.0"),
        ({"providers": ["cuda"]}, "running on 'cpu'"),
        ({"model_sha256": "0" * 64}, "different model file"),
        ({"format": 99}, "snapshot format 99"),
        ({"prefixes": "not a list"}, "malformed"),
    ],
)
def test_incompatible_snapshot_is_ignored_with_a_warning(
    bundle: Bundle, engine: Engine, caplog: pytest.LogCaptureFixture, changes: dict, reason: str
) -> None:
    with caplog.at_level(logging.WARNING, logger="runtime.snapshot"):
        result = restore_snapshot(engine, _with_snapshot(bundle, **changes))
    assert result.restored == () and result.ignored is not None and reason in result.ignored
    assert any("ignoring the bundle's cold-start snapshot" in r.message for r in caplog.records)
    assert engine.stats().prefix_cache_bytes == 0


def test_a_prefix_of_the_wrong_shape_is_never_pinned(bundle: Bundle, engine: Engine, tmp_path: Path) -> None:
    info = read_snapshot_info(bundle.manifest)
    assert info is not None
    (tmp_path / "snapshot").mkdir()
    np.save(tmp_path / info.prefixes[0].file, np.zeros((4, 3, 21, 64), np.float32))
    result = restore_snapshot(engine, dataclasses.replace(bundle, path=tmp_path))
    assert result.restored == ()
    assert engine.stats().prefix_cache_bytes == 0


def test_incompatibility_checks_every_field(bundle: Bundle) -> None:
    info = read_snapshot_info(bundle.manifest)
    assert info is not None
    version = onnxruntime.__version__
    graph = info.prompt_graph
    assert incompatibility(info, bundle.manifest, version, "cpu", graph) is None
    assert "running 9.9" in (incompatibility(info, bundle.manifest, "9.9", "cpu", graph) or "")
    assert "prefills through model.onnx" in (incompatibility(info, bundle.manifest, version, "cpu", "model.onnx") or "")
    other_dtype = dataclasses.replace(info, kv_dtype="float16")
    assert "KV dtype float16" in (incompatibility(other_dtype, bundle.manifest, version, "cpu", graph) or "")
    assert SnapshotInfo.from_json(info.to_json()) == info


def test_a_bundle_without_snapshot_restores_nothing(bundle: Bundle, engine: Engine) -> None:
    bare = dataclasses.replace(bundle, manifest=dataclasses.replace(bundle.manifest, snapshot=None))
    assert restore_snapshot(engine, bare).ignored == "the bundle has no snapshot"
    assert "snapshot" not in bare.manifest.to_json()


def test_pkg_build_writes_no_snapshot_without_a_system_prompt(bundle: Bundle, tmp_path: Path) -> None:
    from packager.snapshot import add_snapshot
    from packager.spec import load_spec

    spec = load_spec(Path(__file__).resolve().parents[2] / "functions" / "smollm2-chat")
    no_prompt = dataclasses.replace(spec, runtime=dataclasses.replace(spec.runtime, system_prompt=None))
    gpu_first = dataclasses.replace(spec, runtime=dataclasses.replace(spec.runtime, providers=["cuda", "cpu"]))
    for variant in (no_prompt, gpu_first):
        assert add_snapshot(tmp_path, bundle.manifest, variant) is bundle.manifest
    assert not (tmp_path / "snapshot").exists()
