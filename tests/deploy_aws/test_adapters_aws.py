"""`pkg adapter add|list|remove --target aws-lambda|aws-sagemaker` and the deployed function's start-up, against a
real local AWS endpoint (the moto server): adapters go to the function's bucket, and the Lambda init phase (run here
in-process, as awslambdaric would run it) fetches, verifies and serves them; a tampered one is skipped.

The bundle is a tiny random-weight Llama built by the real `pkg build` with `[export] adapter_modules`; the adapters
are real PEFT folders (random A and B, so they change the greedy tokens). The bucket and role are made by the
deploy's own drivers, as `pkg deploy` makes them (the function itself is not created: nothing here invokes it).
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from packager.cli import main
from packager.targets.aws import common as aws
from packager.targets.aws import lambda_function, sagemaker
from packager.targets.aws.common import Resource
from packager.targets.aws.resources import BucketDriver, RoleDriver, bucket_name, bucket_resource
from runtime.adapters import s3_store
from tests.fixtures.moto_server import MotoServer

NAME = "tiny-lora-aws"
REGION = "us-east-1"


def _peft_adapter(hf_dir: Path, out: Path, seed: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(model, config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path) -> Path:
    """A folder holding functions/NAME (a spec whose graph takes adapters) and its built bundle."""
    from tests.conftest import tiny_model_cache
    from tests.packager.conftest import build_in

    root = tmp_path_factory.mktemp("aws-adapters")
    folder = root / "functions" / NAME
    folder.mkdir(parents=True)
    (folder / "function.toml").write_text(
        f'name = "{NAME}"\n[model]\nsource = "hf:{tiny_hf_dir}"\n'
        '[export]\nprecision = "fp32"\nmax_context = 256\nadapter_modules = ["q_proj", "v_proj"]\n'
        f'[runtime]\nmax_adapters = 2\n[targets.aws-lambda]\nregion = "{REGION}"\n'
        f'[targets.aws-sagemaker]\nregion = "{REGION}"\n'
    )
    build_in(root, folder, tiny_model_cache(tmp_path_factory))
    return root


@pytest.fixture(scope="module")
def peft(tmp_path_factory: pytest.TempPathFactory, tiny_hf_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("peft")
    return {name: _peft_adapter(tiny_hf_dir, root / name, seed) for seed, name in enumerate(("upper", "later", "bad"))}


@pytest.fixture
def aws_env(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch, project: Path, tmp_path: Path) -> Iterator[None]:
    for variable in ("AWS_PROFILE", "AWS_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",
                     s3_store.ADAPTERS_S3_ENV, "ONNXFN_BUNDLE_S3"):  # fmt: skip
        monkeypatch.delenv(variable, raising=False)
    for variable, value in {**moto_server.env, "AWS_EC2_METADATA_DISABLED": "true", "COLUMNS": "250"}.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.setenv(s3_store.ADAPTER_CACHE_ENV, str(tmp_path / "fetched"))
    monkeypatch.chdir(project)
    monkeypatch.setattr(s3_store, "_fetched", None)
    yield
    moto_server.reset()


def _deployed(target: str) -> str:
    """The function's bucket and role, made by the deploy's drivers; returns the bucket."""
    context = aws.connect(target, REGION, None)
    tags = aws.tags(NAME, "sha256:test", target)
    bucket = bucket_name(NAME, target, context)
    BucketDriver().create(context, bucket_resource(bucket, tags))
    if target == "aws-lambda":
        names: Any = lambda_function.Names.of(NAME, context)
        policy, service = lambda_function.role_policy(context, names), "lambda"
    else:
        names = sagemaker.Names.of(NAME, context)
        policy, service = sagemaker.role_policy(context, names), "sagemaker"
    settings = {"trust": aws.trust_policy(f"{service}.amazonaws.com"), "policy": policy, "tags": tags}
    RoleDriver().create(context, Resource("iam-role", names.role, settings))
    return bucket


def _pkg(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def _ok(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code, out = _pkg(capsys, *args)
    assert code == 0, out
    return out


@pytest.fixture
def lambda_start(project: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Runs the Lambda init phase (`handler.loaded_function`) with the image's environment; yields the handler."""
    from packager.runtime_flags import server_flags
    from packager.spec import load_spec
    from runtime.aws_lambda import handler

    spec = load_spec(project / "functions" / NAME)
    bucket = bucket_name(NAME, "aws-lambda", aws.connect("aws-lambda", REGION, None))
    # What `pkg deploy` gives an image-packaged function (the zip package has $ONNXFN_BUNDLE_S3 in the bucket too).
    monkeypatch.setenv("ONNXFN_FLAGS", shlex.join([*server_flags(spec), "--ledger", f"s3://{bucket}/ledger"]))
    monkeypatch.setenv("ONNXFN_BUNDLE", str(project / "build" / NAME / "bundle"))
    monkeypatch.setattr(handler, "_function", None)
    yield handler
    if handler._function is not None:
        handler._function.shutdown()


def _chat(handler: Any, model: str) -> tuple[int, dict[str, Any]]:
    from packager.targets.aws.lambda_function import function_url_event

    body = {"model": model, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    reply = handler.handler(function_url_event("/v1/chat/completions", body), None)
    return reply["statusCode"], json.loads(reply["body"])


def test_lambda_adapters_are_uploaded_then_fetched_verified_and_served_at_start(
    aws_env: None,
    peft: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
    lambda_start: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    function_dir = f"functions/{NAME}"
    code, out = _pkg(capsys, "adapter", "add", function_dir, "upper", str(peft["upper"]), "--target", "aws-lambda")
    assert code != 0 and "not deployed on aws-lambda" in out and "pkg deploy" in out, out

    bucket = _deployed("aws-lambda")
    out = _ok(capsys, "adapter", "add", function_dir, "upper", str(peft["upper"]), "--target", "aws-lambda")
    assert f"s3://{bucket}/adapters/{NAME}/" in out and "cold start" in out and f'"{NAME}:upper"' in out, out
    _ok(capsys, "adapter", "add", function_dir, "bad", str(peft["bad"]), "--target", "aws-lambda")
    rows = json.loads(_ok(capsys, "adapter", "list", function_dir, "--target", "aws-lambda", "--json"))
    assert {row["name"] for row in rows} == {"upper", "bad"}

    # The role may read the store (an inline policy of its own, beside the deploy's).
    iam = aws.connect("aws-lambda", REGION, None).client("iam")
    policy = iam.get_role_policy(RoleName=f"onnxfn-{NAME}-lambda", PolicyName="onnxfn-adapters")["PolicyDocument"]
    assert f"{bucket}/adapters/{NAME}/*" in json.dumps(policy)

    # Tamper with `bad`: the index names a version whose bytes are not the ones it hashed.
    s3 = aws.connect("aws-lambda", REGION, None).client("s3")
    index_key = f"adapters/{NAME}/index.json"
    index = json.loads(s3.get_object(Bucket=bucket, Key=index_key)["Body"].read())
    stored = index["adapters"]["bad"]
    data = bytearray(s3.get_object(Bucket=bucket, Key=stored["key"])["Body"].read())
    data[-1] ^= 0xFF
    stored["version_id"] = s3.put_object(Bucket=bucket, Key=stored["key"], Body=bytes(data))["VersionId"]
    # And an entry whose bytes match the index but hold a NaN (issue 47, row 2): the start's check refuses it.
    _store_poisoned(s3, bucket, index, index["adapters"]["upper"], "poisoned")
    s3.put_object(Bucket=bucket, Key=index_key, Body=json.dumps(index).encode())

    caplog.set_level(logging.INFO, logger="runtime.aws_lambda")
    handler = lambda_start
    handler.loaded_function()
    assert "adapter 'bad'" in caplog.text and "do not match the index" in caplog.text
    assert "adapter 'poisoned'" in caplog.text and "1 NaN and 0 infinite values" in caplog.text, caplog.text
    assert _chat(handler, f"{NAME}:poisoned")[0] == 404

    status, base = _chat(handler, NAME)
    assert status == 200, base
    status, upper = _chat(handler, f"{NAME}:upper")
    assert status == 200, upper
    assert upper["choices"][0]["message"]["content"] != base["choices"][0]["message"]["content"]
    status, refused = _chat(handler, f"{NAME}:bad")
    assert status == 404 and "upper" in refused["error"]["message"], refused

    # A SnapStart restore reads the store again: an adapter added since is served, a removed one is gone.
    _ok(capsys, "adapter", "add", function_dir, "later", str(peft["later"]), "--target", "aws-lambda")
    _ok(capsys, "adapter", "remove", function_dir, "upper", "--target", "aws-lambda")
    handler.loaded_function().after_restore()
    assert _chat(handler, f"{NAME}:later")[0] == 200
    assert _chat(handler, f"{NAME}:upper")[0] == 404
    code, out = _pkg(capsys, "adapter", "remove", function_dir, "upper", "--target", "aws-lambda")
    assert code != 0 and "has no adapter 'upper'" in out, out


def test_sagemaker_start_fetches_the_store_of_the_deploys_bucket(
    aws_env: None, peft: dict[str, Path], project: Path, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bucket = _deployed("aws-sagemaker")
    function_dir = f"functions/{NAME}"
    out = _ok(capsys, "adapter", "add", function_dir, "upper", str(peft["upper"]), "--target", "aws-sagemaker")
    assert f"s3://{bucket}/adapters/{NAME}/" in out and "endpoint" in out, out

    # What `python -m runtime serve BUNDLE --sagemaker` does before loading the engine (no $ONNXFN_ADAPTERS_S3:
    # the bucket is named from STS' account and the region, as the deploy names it).
    args = argparse.Namespace(adapter_dir=None, model_name=NAME, region=None, endpoint_url=None)
    fetched = s3_store.fetch_adapters(args, project / "build" / NAME / "bundle", target="aws-sagemaker")
    assert fetched is not None and args.adapter_dir == fetched
    assert [p.name for p in fetched.glob("*.safetensors")] == ["upper.safetensors"]

    # An unreachable store is logged and skipped: the engine starts with the bundle's adapters only.
    args = argparse.Namespace(adapter_dir=None, model_name="not-deployed", region=None, endpoint_url=None)
    assert s3_store.fetch_adapters(args, project / "build" / NAME / "bundle", target="aws-sagemaker") is None
    assert args.adapter_dir is None


def test_the_start_up_hook_imports_nothing_a_bundle_without_adapters_lacks() -> None:
    """The Lambda init imports the fetcher for every bundle: safetensors (adapter files) only loads when one is read."""
    import subprocess
    import sys

    code = "import sys; sys.modules['safetensors'] = None; import runtime.adapters.s3_store"
    subprocess.run([sys.executable, "-c", code], check=True)


def _store_poisoned(s3: Any, bucket: str, index: dict[str, Any], source: dict[str, Any], name: str) -> None:
    """`source`'s adapter with a NaN in one tensor, stored and indexed as `pkg adapter add` would (its digest right)."""
    import hashlib
    import tempfile

    from runtime.adapters.files import AdapterFile, read_adapter_file, write_adapter_file

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "adapter.safetensors"
        path.write_bytes(s3.get_object(Bucket=bucket, Key=source["key"])["Body"].read())
        adapter = read_adapter_file(path)
        tensors = {key: tensor.copy() for key, tensor in adapter.tensors.items()}
        next(iter(tensors.values()))[0, 0] = float("nan")
        write_adapter_file(path, AdapterFile(adapter.rank, adapter.scale, adapter.base, tensors))
        data = path.read_bytes()
    key = source["key"].rsplit("/", 1)[0] + f"/{name}.safetensors"
    version = s3.put_object(Bucket=bucket, Key=key, Body=data)["VersionId"]
    index["adapters"][name] = {"key": key, "version_id": version, "sha256": hashlib.sha256(data).hexdigest(),
                               "bytes": len(data)}  # fmt: skip
