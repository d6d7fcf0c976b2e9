"""`pkg deploy --target greengrass` against a real moto server (S3, IoT, Secrets Manager, STS) and a Greengrass v2
stand-in that checks every request and answer against botocore's service model (moto has no Greengrass v2).

What this proves: the recipe fits the documented format, every artifact in S3 has exactly the digest the
nucleus will compute, the requests are well-formed, and plan/apply/status/destroy behave (idempotent, a
group's other components kept). What it cannot prove: that a real nucleus installs and runs the component.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.validate import validate_parameters

from packager.cli import main
from packager.errors import UserError
from packager.spec import load_spec
from packager.targets.greengrass import target as greengrass
from packager.targets.greengrass.recipe import ComponentSettings, recipe
from runtime.bundle import MANIFEST_NAME, file_digest, manifest_bytes, read_manifest
from tests.conftest import DEMO_FUNCTION
from tests.edge.greengrass_recipe_format import recipe_problems
from tests.edge.greengrass_standin import MODEL, GreengrassStandIn, running_standin
from tests.fixtures.moto_server import REGION, MotoServer, running_moto_server

GROUP = "onnxfn-fleet"
SECRET = "onnxfn/agent-token"
FOREIGN = "com.example.Telemetry"  # another team's component on the same thing group


def small_bundle(source: Path, target: Path) -> Path:
    """The demo bundle with its weight files replaced by small ones and re-hashed: a valid bundle to ship
    (deploying never loads the model), without moving 700 MB through moto in every test."""
    manifest = read_manifest(source)
    files = {}
    for name in manifest.files:
        destination = target / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        if (source / name).stat().st_size > 4 << 20:
            destination.write_bytes(hashlib.sha256(name.encode()).digest() * 4096)
        else:
            shutil.copyfile(source / name, destination)
        files[name] = file_digest(destination)
    small = dataclasses.replace(manifest, files=files)
    (target / MANIFEST_NAME).write_bytes(manifest_bytes(small.to_json()))
    return target


@pytest.fixture(scope="module")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    with running_moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def fleet(
    tmp_path: Path,
    demo_bundle: Path,
    moto_server: MotoServer,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[GreengrassStandIn, Path]]:
    moto_server.reset()
    account = moto_server.client("sts").get_caller_identity()["Account"]
    moto_server.client("iot").create_thing_group(thingGroupName=GROUP)
    moto_server.client("secretsmanager").create_secret(Name=SECRET, SecretString="device-token")
    function_dir = tmp_path / "functions" / "gg-chat"
    function_dir.mkdir(parents=True)
    small_bundle(demo_bundle, tmp_path / "build" / "gg-chat" / "bundle")
    with running_standin(account, REGION) as standin:
        group_arn = f"arn:aws:iot:{REGION}:{account}:thinggroup/{GROUP}"
        standin.core_devices = {"jetson-01": group_arn, "jetson-02": group_arn}
        standin.CreateComponentVersion(
            {
                "inlineRecipe": json.dumps(
                    {"RecipeFormatVersion": "2020-01-25", "ComponentName": FOREIGN, "ComponentVersion": "2.1.0"}
                )
            }
        )
        standin.CreateDeployment({"targetArn": group_arn, "components": {FOREIGN: {"componentVersion": "2.1.0"}}})
        standin.complete_deployments()
        for name in ("AWS_PROFILE", "AWS_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
            monkeypatch.delenv(name, raising=False)
        env = {**moto_server.env, "AWS_ENDPOINT_URL_GREENGRASSV2": standin.url, "AWS_EC2_METADATA_DISABLED": "true",
               "COLUMNS": "250"}  # fmt: skip
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.chdir(tmp_path)
        yield standin, function_dir


def write_spec(function_dir: Path, table: str) -> None:
    text = (DEMO_FUNCTION / "function.toml").read_text().replace('name = "smollm2-chat"', 'name = "gg-chat"')
    (function_dir / "function.toml").write_text(text + "\n[targets.greengrass]\n" + table)


def pkg(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out + captured.err


AGENT_SPEC = f'thing_group = "{GROUP}"\ntoken_secret = "{SECRET}"\n'


def created_recipes(standin: GreengrassStandIn) -> list[dict[str, Any]]:
    return [json.loads(c.params["inlineRecipe"]) for c in standin.calls if c.operation == "CreateComponentVersion"
            and json.loads(c.params["inlineRecipe"])["ComponentName"] != FOREIGN]  # fmt: skip


def test_deploy_ships_checked_artifacts_and_deploys_to_the_group(
    fleet: tuple[GreengrassStandIn, Path],
    moto_server: MotoServer,
    capsys: pytest.CaptureFixture[str],
) -> None:
    standin, function_dir = fleet
    write_spec(function_dir, AGENT_SPEC)
    code, out = pkg(capsys, "deploy", str(function_dir), "--target", "greengrass")
    assert code == 0, out
    assert standin.problems == []
    for call in standin.calls:  # every request, re-checked against botocore's model of the operation
        validate_parameters(call.params, MODEL.operation_model(call.operation).input_shape)

    [document] = created_recipes(standin)
    assert recipe_problems(document) == []
    assert (document["ComponentName"], document["ComponentVersion"]) == ("onnxfn.gg-chat", "1.0.0")
    assert [m["Platform"] for m in document["Manifests"]] == [
        {"os": "linux", "architecture": "amd64"}, {"os": "linux", "architecture": "aarch64"}]  # fmt: skip
    defaults = document["ComponentConfiguration"]["DefaultConfiguration"]
    assert defaults == {"Mode": "agent", "Port": 8470, "TokenFile": "", "TokenSecret": SECRET, "QueueUrl": ""}
    assert "aws.greengrass.TokenExchangeService" in document["ComponentDependencies"]
    run = document["Manifests"][0]["Lifecycle"]["Run"]["Script"]
    assert "--mode {configuration:/Mode}" in run and "--model-name gg-chat" in run

    # Each artifact in S3 has the digest the nucleus computes after downloading: base64(SHA-256(bytes)).
    s3 = moto_server.client("s3")
    archive = next((Path("build/gg-chat/edge")).glob("*.tar"))  # the push client's archive, reused
    for artifact in document["Manifests"][0]["Artifacts"]:
        bucket, _, key = artifact["Uri"].removeprefix("s3://").partition("/")
        body = s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        assert artifact["Digest"] == base64.b64encode(hashlib.sha256(body).digest()).decode(), key
        if key.rpartition("/")[2].startswith("bundle-"):
            assert body == archive.read_bytes()
    tags = {t["Key"]: t["Value"] for t in s3.get_bucket_tagging(Bucket=bucket)["TagSet"]}
    bundle_digest = read_manifest(Path("build/gg-chat/bundle")).digest
    assert tags["onnxfn:bundle-digest"] == bundle_digest

    [deployment] = [d for d in standin.deployments.values() if d["isLatestForTarget"]]
    assert deployment["components"] == {
        FOREIGN: {"componentVersion": "2.1.0"}, "onnxfn.gg-chat": {"componentVersion": "1.0.0"}}  # fmt: skip
    assert deployment["deploymentPolicies"]["failureHandlingPolicy"] == "ROLLBACK"
    assert deployment["tags"]["onnxfn:bundle-digest"] == bundle_digest
    assert deployment["targetArn"].endswith(f":thinggroup/{GROUP}")

    # The devices finish: status reads the deployment and each core device's effective deployment.
    standin.complete_deployments()
    standin.device_outcomes = {"jetson-01": "SUCCEEDED", "jetson-02": "FAILED"}
    row = greengrass.status(load_spec(function_dir))
    assert row is not None and row.state == "failed" and "1 FAILED, 1 SUCCEEDED" in row.detail
    standin.device_outcomes["jetson-02"] = "SUCCEEDED"
    assert greengrass.status(load_spec(function_dir)).state == "ready"  # type: ignore[union-attr]

    # Unchanged spec and bundle: nothing is created again.
    before = len(standin.calls)
    code, out = pkg(capsys, "deploy", str(function_dir), "--target", "greengrass")
    assert code == 0 and "no changes" in out, out
    assert not {"CreateComponentVersion", "CreateDeployment"} & set(standin.operations()[before:])

    # A new port: the next version and a new revision; the artifacts, unchanged, stay as they are.
    write_spec(function_dir, AGENT_SPEC + "port = 9000\n")
    rows = greengrass.plan(load_spec(function_dir)).rows()
    assert {(action, kind) for action, kind, _, _ in rows} == {
        ("none", "s3-bucket"), ("none", "s3-object"), ("update", "greengrass-component"),
        ("update", "greengrass-deployment")}  # fmt: skip
    code, out = pkg(capsys, "deploy", str(function_dir), "--target", "greengrass")
    assert code == 0, out
    assert [r["ComponentVersion"] for r in created_recipes(standin)] == ["1.0.0", "1.0.1"]
    assert created_recipes(standin)[1]["ComponentConfiguration"]["DefaultConfiguration"]["Port"] == 9000
    assert standin.problems == []

    # Destroy: the group keeps the other component, our versions, deployments and bucket are gone.
    code, out = pkg(capsys, "destroy", str(function_dir), "--target", "greengrass")
    assert code == 0, out
    [latest] = [d for d in standin.deployments.values() if d["isLatestForTarget"]]
    assert latest["components"] == {FOREIGN: {"componentVersion": "2.1.0"}}
    assert standin.components["onnxfn.gg-chat"] == {}
    assert not [d for d in standin.deployments.values() if d["tags"].get("onnxfn:function") == "gg-chat"]
    assert bucket not in [b["Name"] for b in s3.list_buckets()["Buckets"]]
    assert standin.problems == []
    assert greengrass.status(load_spec(function_dir)) is None


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (f'token_secret = "{SECRET}"\n', "thing_group is not set"),
        (f'thing_group = "{GROUP}"\n', "needs exactly one of token_secret"),
        (f'thing_group = "{GROUP}"\nmode = "worker"\n', 'mode = "worker" needs queue_url'),
        (f'thing_group = "{GROUP}"\ncomponent_name = "bad name!"\ntoken_file = "/t"\n', "component_name = 'bad name!'"),
        ('thing_group = "absent"\ntoken_file = "/etc/onnxfn/token"\n', "thing_group = 'absent': no such thing group"),
        (f'thing_group = "{GROUP}"\ntoken_secret = "nope"\n', "token_secret = 'nope': no such secret"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_created(
    fleet: tuple[GreengrassStandIn, Path], capsys: pytest.CaptureFixture[str], table: str, message: str
) -> None:
    standin, function_dir = fleet
    write_spec(function_dir, table)
    calls = len(standin.calls)
    code, out = pkg(capsys, "deploy", str(function_dir), "--target", "greengrass")
    assert code == 2 and message in out and "Traceback" not in out, out
    assert len(standin.calls) == calls


def test_worker_recipe_and_the_checker_catches_broken_recipes(tmp_path: Path) -> None:
    from packager.targets.greengrass.recipe import Artifact, Artifacts

    def artifact(name: str, unarchive: str = "NONE") -> Artifact:
        return Artifact(tmp_path / name, name, hashlib.sha256(name.encode()).hexdigest(), 1, unarchive)

    artifacts = Artifacts(artifact("bundle-1.tar"), artifact("runtime-1.zip", "ZIP"), artifact("requirements-1.txt"),
                          artifact("onnxfn_greengrass-1.py"), "sha256:" + "0" * 64)  # fmt: skip
    settings = ComponentSettings("onnxfn.q", "q", "worker", 8470, "", "", "https://sqs/q", REGION, 900, ("--x", "a b"))
    uris = {a.name: f"s3://bucket/onnxfn/q/{a.name}" for a in artifacts.all()}
    document = recipe(settings, artifacts, uris, "1.0.0")
    assert recipe_problems(document) == []
    assert "{artifacts:decompressedPath}/runtime-1:" in document["Manifests"][1]["Lifecycle"]["Setenv"]["PYTHONPATH"]
    assert "-- --x 'a b'" in document["Manifests"][1]["Lifecycle"]["Run"]["Script"]
    assert document["ComponentDependencies"]["aws.greengrass.TokenExchangeService"]["DependencyType"] == "HARD"

    broken = json.loads(json.dumps(document))
    broken["ComponentVersion"] = "1.0"
    manifest = broken["Manifests"][0]
    manifest["Artifacts"][0]["Digest"] = artifacts.bundle.sha256  # hex, not base64: the nucleus would refuse it
    manifest["Lifecycle"]["Startup"] = "true"
    manifest["Lifecycle"]["Run"]["Script"] += " {configuration:/Missing}"
    manifest["Platform"]["architecture"] = "arm64"  # Greengrass says aarch64
    problems = recipe_problems(broken)
    for expected in ("ComponentVersion", "Digest: not the base64", "Startup and Run", "{configuration:/Missing}",
                     "architecture: 'arm64'"):  # fmt: skip
        assert any(expected in p for p in problems), (expected, problems)


def test_settings_must_fit_greengrass_before_connecting(tmp_path: Path) -> None:
    (tmp_path / "function.toml").write_text(
        (DEMO_FUNCTION / "function.toml").read_text()
        + '\n[targets.greengrass]\nthing_group = "g"\nmode = "worker"\nqueue_url = "q"\ntoken_file = "/t"\n'
    )
    with pytest.raises(UserError, match="token_file / token_secret are for mode"):
        greengrass.check_settings(load_spec(tmp_path))
    assert os.environ.get("AWS_ENDPOINT_URL_GREENGRASSV2") is None  # the fixture's redirection does not leak
