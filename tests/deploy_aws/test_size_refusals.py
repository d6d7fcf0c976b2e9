"""Lambda refuses, before anything is built or created, a bundle its memory, its image or its /tmp cannot hold.

The bundles are the demo's with a weights file made as large as each limit needs (tests/fixtures/large_bundle.py:
a sparse file, real on disk, re-hashed into the manifest), so every size the checks read is a file's size. A real
1B model's bundle (0.87 GB) would do for the smaller limits; this one costs no build.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from packager.cli import main
from packager.sizes import LAMBDA_MAX_IMAGE, SNAPSTART_TMP, bundle_size
from packager.spec import load_spec
from packager.targets.aws.lambda_function import check_size
from runtime.bundle import MANIFEST_NAME, manifest_bytes, open_bundle, read_manifest
from tests.conftest import DEMO_FUNCTION
from tests.fixtures.large_bundle import padded_bundle
from tests.fixtures.moto_server import MotoServer

GIB = 1 << 30
Deploy = Callable[[Path, str], tuple[int, str]]
BUDGETS = (load_spec(DEMO_FUNCTION).runtime.kv_memory_mb, load_spec(DEMO_FUNCTION).runtime.prefix_cache_mb)


@pytest.fixture(scope="module")
def over_tmp(demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 0.6 GiB bundle: more than SnapStart's /tmp, less than Lambda's default memory setting needs."""
    return padded_bundle(demo_bundle, tmp_path_factory.mktemp("over-tmp") / "bundle", 500 << 20, sparse=True)


@pytest.fixture(scope="module")
def over_10gb(demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 10.1 GiB bundle: an image over Lambda's 10 GiB, and more to serve than its largest memory setting."""
    return padded_bundle(demo_bundle, tmp_path_factory.mktemp("over-10gb") / "bundle", 10 * GIB, sparse=True)


@pytest.fixture
def deploy(
    tmp_path: Path, moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> Iterator[Deploy]:
    """`deploy(bundle, table)`: `pkg deploy --target aws-lambda` of a function with that [targets.aws-lambda] table
    whose build/NAME/bundle is `bundle`, against the local AWS endpoint; (exit code, output)."""
    for name, value in moto_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("COLUMNS", "250")
    monkeypatch.chdir(tmp_path)

    def run(bundle: Path, table: str) -> tuple[int, str]:
        function = tmp_path / "functions" / "sized"
        function.mkdir(parents=True, exist_ok=True)
        text = re.sub(r'^name = ".*"$', 'name = "sized"', (DEMO_FUNCTION / "function.toml").read_text(), flags=re.M)
        (function / "function.toml").write_text(f"{text}\n[targets.aws-lambda]\n{table}\n")
        built = tmp_path / "build" / "sized" / "bundle"
        built.parent.mkdir(parents=True, exist_ok=True)
        built.unlink(missing_ok=True)
        built.symlink_to(bundle)
        capsys.readouterr()
        code = main(["deploy", str(function), "--target", "aws-lambda"])
        captured = capsys.readouterr()
        return code, captured.out + captured.err

    yield run
    moto_server.reset()


def nothing_created(root: Path, moto_server: MotoServer) -> bool:
    """No package was built (no image layout, no zip under build/NAME/aws-lambda) and nothing exists in AWS."""
    s3, lam = moto_server.client("s3"), moto_server.client("lambda")
    built = root / "build" / "sized" / "aws-lambda"
    return not built.exists() and s3.list_buckets()["Buckets"] == [] and lam.list_functions()["Functions"] == []


def test_snapstart_refuses_a_bundle_over_its_512_mb_tmp(
    over_tmp: Path, deploy: Deploy, tmp_path: Path, moto_server: MotoServer
) -> None:
    size = bundle_size(over_tmp, *BUDGETS).file_bytes
    assert SNAPSTART_TMP < size < 2 * SNAPSTART_TMP
    code, out = deploy(over_tmp, "snapstart = true\nephemeral_storage_mb = 512")
    assert code == 2, out
    tables = open_bundle(over_tmp, verify=False).manifest.table_bytes
    assert tables > 0  # the demo bundle's scale tables are expanded into /tmp too (runtime/engine/tables.py)
    expected = f"the bundle is {-(-size // (1 << 20))} MB and its scale tables {-(-tables // (1 << 20))} MB, and /tmp"
    assert expected + " (ephemeral_storage_mb = 512) holds 512 MB" in " ".join(out.split()), out
    flat = " ".join(out.split())
    assert "SnapStart keeps /tmp at 512 MB at most" in flat and 'package = "image"' in flat
    assert nothing_created(tmp_path, moto_server)


def test_a_memory_setting_below_the_bundles_need_is_refused_with_the_setting_that_fits(
    over_tmp: Path, deploy: Deploy, tmp_path: Path, moto_server: MotoServer
) -> None:
    need = bundle_size(over_tmp, *BUDGETS).need  # the demo function's [runtime] budgets
    assert 1024 << 20 < need.total < 3008 << 20
    code, out = deploy(over_tmp, 'package = "image"\nmemory_mb = 1024')
    assert code == 2, out
    assert f"serving the bundle needs about {need.describe()}" in " ".join(out.split()), out
    assert f"memory_mb = 1024 gives: set memory_mb = {-(-need.total // (1 << 20))} or more" in " ".join(out.split())
    assert nothing_created(tmp_path, moto_server)
    # The same bundle with Lambda's default memory passes the size check (the deploy would go on from there).
    (tmp_path / "functions" / "sized" / "function.toml").write_text(
        (tmp_path / "functions" / "sized" / "function.toml").read_text().replace("memory_mb = 1024", "")
    )
    check_size(load_spec(tmp_path / "functions" / "sized"))


def test_a_10_gb_bundle_is_refused_for_both_lambdas_image_and_its_memory(
    over_10gb: Path, deploy: Deploy, tmp_path: Path, moto_server: MotoServer
) -> None:
    size = bundle_size(over_10gb, *BUDGETS)
    assert size.file_bytes > LAMBDA_MAX_IMAGE
    assert (over_10gb / "model.onnx.data").stat().st_blocks * 512 < 1 * GIB  # sparse: the disk holds the real part
    code, out = deploy(over_10gb, 'package = "image"\nmemory_mb = 10240')
    flat = " ".join(out.split())
    assert code == 2, out
    assert "more than Lambda's largest memory setting (10240 MB)" in flat, out
    assert f"the image would be {(size.file_bytes + (300 << 20)) / GIB:.2f} GiB unpacked" in flat
    assert "over Lambda's 10.00 GiB limit for a container image" in flat
    assert nothing_created(tmp_path, moto_server)


@pytest.fixture(scope="module")
def large_tables(demo_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's bundle whose manifest says its graphs expand 600 MB of scale tables (a 3B model's are ~0.7 GB)."""
    target = tmp_path_factory.mktemp("large-tables") / "bundle"
    shutil.copytree(demo_bundle, target, copy_function=os.link)
    manifest = read_manifest(target)
    (target / MANIFEST_NAME).unlink()  # a link to the source's file: write a new one
    replaced = dataclasses.replace(manifest, table_bytes=600 << 20)
    (target / MANIFEST_NAME).write_bytes(manifest_bytes(replaced.to_json()))
    return target


def test_an_image_whose_scale_tables_outgrow_tmp_is_refused_with_the_setting_that_fits(
    large_tables: Path, deploy: Deploy, tmp_path: Path, moto_server: MotoServer
) -> None:
    code, out = deploy(large_tables, 'package = "image"\nmemory_mb = 3008\nephemeral_storage_mb = 512')
    flat = " ".join(out.split())
    assert code == 2, out
    assert "the bundle's scale tables are 600 MB, and /tmp (ephemeral_storage_mb = 512) holds 512 MB" in flat, out
    assert "the init phase expands the tables there: raise ephemeral_storage_mb to 664 or more" in flat, out
    assert nothing_created(tmp_path, moto_server)
    toml = tmp_path / "functions" / "sized" / "function.toml"
    toml.write_text(toml.read_text().replace("ephemeral_storage_mb = 512", "ephemeral_storage_mb = 1024"))
    check_size(load_spec(tmp_path / "functions" / "sized"))
