"""`pkg deploy --target aws-lambda` with the zip package and SnapStart, against the local AWS endpoint.

The zip is really built (pip for the Lambda platform), uploaded with the bundle to the function's bucket, and the
function is created from it in moto. moto 5.2.5 ignores `SnapStart`; the test server's patch
(`moto_site/sitecustomize.py`) keeps it, and the request the driver sends is checked against botocore's Lambda
service model (shapes and enums), which is what AWS accepts.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import botocore.session
import pytest
from botocore.validate import ParamValidator

from packager.errors import UserError
from packager.targets.aws.lambda_drivers import FunctionDriver
from packager.targets.aws.lambda_zip import ZIP_LIMIT_BYTES, ZipPackage, check_fits
from runtime.aws_lambda.bundle_fetch import fetch_bundle
from runtime.bundle import BundleError, read_manifest
from tests.deploy_aws.conftest import Workspace
from tests.deploy_aws.test_lambda import deploy
from tests.fixtures.moto_server import MotoServer

ZIP_TABLE = """
[targets.aws-lambda]
region = "us-east-1"
snapstart = true
memory_mb = 2048
ephemeral_storage_mb = 512
"""


def wrapped_plan_rows(out: str) -> dict[tuple[str, str], str]:
    """(kind, name) → action from the plan table, whose long bucket/key names wrap onto continuation lines."""
    rows: list[list[str]] = []
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) != 4:
            continue
        if cells[0] in ("create", "update", "delete", "none"):
            rows.append(cells)
        elif rows and not cells[0]:
            rows[-1][2] += cells[2]
    return {(kind, name): action for action, kind, name, _ in rows}


def _new_bundle_digest(bundle: Path) -> str:
    """A rebuilt bundle: same files, another manifest (so another digest). The manifest is replaced, never
    written through: the workspace's bundle is hard-linked to the session's copy."""
    manifest = bundle / "manifest.json"
    data = json.loads(manifest.read_text())
    data["created_by"] = {**data.get("created_by", {}), "rebuilt": "test_lambda_zip"}
    manifest.unlink()
    manifest.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return read_manifest(bundle).digest


def test_zip_snapstart_deploy_update_destroy(
    workspace: Workspace, moto_server: MotoServer, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    name = workspace.name
    workspace.write_spec(ZIP_TABLE)
    lam, s3, iam = moto_server.client("lambda"), moto_server.client("s3"), moto_server.client("iam")
    bundle = workspace.root / "build" / name / "bundle"
    digest = read_manifest(bundle).digest

    out = deploy(workspace, capsys)
    assert "package: zip (package auto: snapstart = true, and AWS offers SnapStart for zip packages only)" in out
    assert "MB unpacked of Lambda's 250 MB" in out and "before the SnapStart snapshot" in out, out
    config = lam.get_function_configuration(FunctionName=name)
    assert (config["PackageType"], config["Runtime"], config["Handler"]) == (
        "Zip", "python3.12", "runtime.aws_lambda.handler.handler"
    )  # fmt: skip
    assert config["SnapStart"]["ApplyOn"] == "PublishedVersions"
    assert config["EphemeralStorage"]["Size"] == 512
    environment = config["Environment"]["Variables"]
    bucket = environment["ONNXFN_BUNDLE_S3"].removeprefix("s3://").split("/")[0]
    assert environment["ONNXFN_BUNDLE_S3"] == f"s3://{bucket}/bundles/{digest.removeprefix('sha256:')}/"
    assert environment["ONNXFN_BUNDLE_DIGEST"] == digest and "--ledger" in environment["ONNXFN_FLAGS"]

    # The code Lambda took is the zip in the bucket, content-addressed by its sha256.
    (code,) = s3.list_objects_v2(Bucket=bucket, Prefix="code/")["Contents"]
    body = s3.get_object(Bucket=bucket, Key=code["Key"])["Body"].read()
    assert code["Key"] == f"code/{hashlib.sha256(body).hexdigest()}.zip"
    assert config["CodeSha256"] == base64.b64encode(hashlib.sha256(body).digest()).decode()
    assert moto_server.client("ecr").describe_repositories()["repositories"] == []

    # The alias points at a published version with SnapStart on.
    version = lam.get_alias(FunctionName=name, Name="live")["FunctionVersion"]
    published = lam.get_function_configuration(FunctionName=name, Qualifier=version)
    assert published["SnapStart"] == {"ApplyOn": "PublishedVersions", "OptimizationStatus": "On"}

    # The handler's own fetch takes the bundle from the deployed location and verifies it.
    fetched = fetch_bundle(environment["ONNXFN_BUNDLE_S3"], digest, s3=s3, cache=tmp_path / "cache")
    assert read_manifest(fetched).digest == digest
    assert sorted(p.name for p in fetched.iterdir()) == sorted(p.name for p in bundle.iterdir())
    with pytest.raises(BundleError, match="has digest"):
        fetch_bundle(environment["ONNXFN_BUNDLE_S3"], "sha256:" + "0" * 64, s3=s3, cache=tmp_path / "other")
    # An object swapped for a longer one is refused after one chunk past its listed size, and nothing stays.
    uri = environment["ONNXFN_BUNDLE_S3"]
    key = uri.removeprefix(f"s3://{bucket}/") + read_manifest(bundle).tokenizer_file
    original = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
    s3.put_object(Bucket=bucket, Key=key, Body=original + b"x" * (64 << 20))
    with pytest.raises(BundleError, match="does not match the manifest: [0-9]+ bytes") as refused:
        fetch_bundle(uri, digest, s3=s3, cache=tmp_path / "tampered")
    assert int(str(refused.value).split(": ")[1].split()[0]) < len(original) + (16 << 20)
    assert list((tmp_path / "tampered").iterdir()) == []
    s3.put_object(Bucket=bucket, Key=key, Body=original)

    # The role may read its bundle and nothing else new.
    document = iam.get_role_policy(RoleName=f"onnxfn-{name}-lambda", PolicyName="onnxfn")["PolicyDocument"]
    (fetch,) = [s for s in document["Statement"] if s.get("Sid") == "Bundle"]
    assert fetch["Action"] == ["s3:GetObject"] and fetch["Resource"] == f"arn:aws:s3:::{bucket}/bundles/*"

    assert "no changes" in deploy(workspace, capsys)

    # A new bundle digest: the bundle uploads under its own prefix, a new version is published, the alias moves.
    new_digest = _new_bundle_digest(bundle)
    rows = wrapped_plan_rows(deploy(workspace, capsys, "--plan"))
    assert rows[("s3-bundle", f"{bucket}/bundles/{new_digest.removeprefix('sha256:')}/")] == "create"
    assert rows[("lambda-function", name)] == "update" and rows[("lambda-alias", f"{name}:live")] == "update"
    assert rows[("s3-code", f"{bucket}/{code['Key']}")] == "none"  # the same zip: the runtime did not change
    deploy(workspace, capsys)
    new_version = lam.get_alias(FunctionName=name, Name="live")["FunctionVersion"]
    assert new_version != version
    updated = lam.get_function_configuration(FunctionName=name, Qualifier=new_version)
    assert updated["Environment"]["Variables"]["ONNXFN_BUNDLE_DIGEST"] == new_digest
    assert updated["SnapStart"] == {"ApplyOn": "PublishedVersions", "OptimizationStatus": "On"}
    listed = s3.list_objects_v2(Bucket=bucket, Prefix="bundles/")["Contents"]
    assert {item["Key"].split("/")[1] for item in listed} == {d.removeprefix("sha256:") for d in (digest, new_digest)}

    code_, out = workspace.pkg("destroy", str(workspace.function_dir), "--target", "aws-lambda", capsys=capsys)
    assert code_ == 0 and "deleted 9 resources" in out, out
    assert lam.list_functions()["Functions"] == [] and s3.list_buckets()["Buckets"] == []


def test_snapstart_refusals_name_the_reason(workspace: Workspace, capsys: pytest.CaptureFixture[str]) -> None:
    workspace.write_spec(ZIP_TABLE.replace("snapstart = true", 'snapstart = true\npackage = "image"'))
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-lambda", capsys=capsys)
    assert code == 2 and 'package = "image"' in out and "zip packages on the managed runtimes only" in out, out
    workspace.write_spec(ZIP_TABLE.replace("ephemeral_storage_mb = 512", "ephemeral_storage_mb = 1024"))
    code, out = workspace.pkg("deploy", str(workspace.function_dir), "--target", "aws-lambda", capsys=capsys)
    assert code == 2 and "SnapStart allows at most 512 MB" in out, out


def test_a_zip_over_lambdas_limit_is_refused_with_the_sizes(tmp_path: Path) -> None:
    big = ZipPackage(tmp_path / "function.zip", "00" * 32, ZIP_LIMIT_BYTES + 30_000_000, reused=False)
    with pytest.raises(UserError) as refused:
        check_fits(big)
    assert "unpacks to 292 MB, over Lambda's 262 MB limit" in str(refused.value)
    assert 'package = "image"' in str(refused.value)
    check_fits(ZipPackage(tmp_path / "function.zip", "00" * 32, 126_000_000, reused=False))


def test_the_zip_function_request_matches_the_lambda_service_model() -> None:
    """moto does not check SnapStart: the arguments the driver sends are validated against botocore's model."""
    model = botocore.session.get_session().get_service_model("lambda")
    settings = {
        "package": "Zip", "code_sha256": base64.b64encode(b"\1" * 32).decode(), "runtime": "python3.12",
        "handler": "runtime.aws_lambda.handler.handler", "role": "arn:aws:iam::123456789012:role/r",
        "memory_mb": 2048, "timeout_seconds": 60, "architecture": "x86_64", "ephemeral_storage_mb": 512,
        "environment": {"ONNXFN_FLAGS": "--max-batch 8"}, "snapstart": "PublishedVersions",
    }  # fmt: skip
    driver = FunctionDriver("bucket")
    create = {"FunctionName": "f", "PackageType": "Zip", **driver._code(settings), "Architectures": ["x86_64"],
              "Publish": False, **driver._configuration(settings)}  # fmt: skip
    update = {"FunctionName": "f", **driver._configuration(settings)}
    for operation, params in (("CreateFunction", create), ("UpdateFunctionConfiguration", update)):
        shape = model.operation_model(operation).input_shape
        report = ParamValidator().validate(params, shape)
        assert not report.has_errors(), report.generate_report()
        assert params["Runtime"] in shape.members["Runtime"].enum
        assert params["SnapStart"]["ApplyOn"] in shape.members["SnapStart"].members["ApplyOn"].enum
    assert create["Code"] == {"S3Bucket": "bucket", "S3Key": f"code/{'01' * 32}.zip"}
