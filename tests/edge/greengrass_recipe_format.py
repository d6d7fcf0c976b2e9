"""A checker for Greengrass v2 component recipes, written from the AWS documentation ("AWS IoT Greengrass component
recipe reference") and the nucleus' own recipe model (aws-greengrass-component-common: ComponentRecipe,
PlatformSpecificManifest, ComponentArtifact; the digest check in aws-greengrass-nucleus' ArtifactDownloader).

It returns every problem as "path: what is wrong", so a test shows them all at once.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

TOP_LEVEL = {
    "RecipeFormatVersion", "ComponentName", "ComponentVersion", "ComponentType", "ComponentDescription",
    "ComponentPublisher", "ComponentSource", "ComponentConfiguration", "ComponentDependencies", "Manifests",
    "Lifecycle",
}  # fmt: skip
REQUIRED = ("RecipeFormatVersion", "ComponentName", "ComponentVersion")
COMPONENT_TYPES = ("aws.greengrass.generic", "aws.greengrass.lambda", "aws.greengrass.plugin", "aws.greengrass.nucleus")
NAME = re.compile(r"^[a-zA-Z0-9._-]+$")
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?$")
OSES = ("linux", "windows", "darwin", "*", "all", "any")
ARCHITECTURES = ("amd64", "arm", "aarch64", "x86", "*", "all", "any")
LIFECYCLE_STEPS = {"Setenv", "Bootstrap", "Install", "Startup", "Run", "Shutdown", "Recover"}
STEP_KEYS = {"Script", "RequiresPrivilege", "Skipif", "Timeout", "Setenv", "BootstrapOnRollback"}
ARTIFACT_KEYS = {"Uri", "Digest", "Algorithm", "Unarchive", "Permission"}
DIGEST_BYTES = {"SHA-256": 32, "SHA-384": 48, "SHA-512": 64}
PERMISSIONS = ("NONE", "OWNER", "ALL")
URI_SCHEMES = ("s3", "greengrass", "docker")
# Recipe variables: {artifacts:path}, {artifacts:decompressedPath}, {work:path}, {kernel:rootPath},
# {iot:thingName}, {configuration:/JSON/pointer}, each optionally prefixed by a dependency's name.
VARIABLE = re.compile(r"\{([^{}]*)\}")
KNOWN_VARIABLES = ("artifacts:path", "artifacts:decompressedPath", "work:path", "kernel:rootPath", "iot:thingName")


def recipe_problems(recipe: Any) -> list[str]:
    problems: list[str] = []
    if not isinstance(recipe, dict):
        return ["recipe: must be an object"]
    problems += [f"{key}: unknown top-level key" for key in recipe.keys() - TOP_LEVEL]
    problems += [f"{key}: required" for key in REQUIRED if key not in recipe]
    if recipe.get("RecipeFormatVersion") != "2020-01-25":
        problems.append(f"RecipeFormatVersion: {recipe.get('RecipeFormatVersion')!r} is not 2020-01-25")
    name = recipe.get("ComponentName")
    if not isinstance(name, str) or not NAME.match(name) or len(name) > 128:
        problems.append(f"ComponentName: {name!r} must be 1-128 of letters, digits, '.', '-', '_'")
    problems += _version_problems(recipe.get("ComponentVersion"))
    if recipe.get("ComponentType", "aws.greengrass.generic") not in COMPONENT_TYPES:
        problems.append(f"ComponentType: {recipe['ComponentType']!r} not one of {COMPONENT_TYPES}")
    for key in ("ComponentDescription", "ComponentPublisher", "ComponentSource"):
        if key in recipe and not isinstance(recipe[key], str):
            problems.append(f"{key}: must be a string")
    defaults = _configuration(recipe.get("ComponentConfiguration"), problems)
    for dependency, spec in (recipe.get("ComponentDependencies") or {}).items():
        if not isinstance(spec, dict) or not isinstance(spec.get("VersionRequirement", ""), str):
            problems.append(f"ComponentDependencies.{dependency}: VersionRequirement must be a string")
        elif spec.get("DependencyType", "HARD") not in ("HARD", "SOFT"):
            problems.append(f"ComponentDependencies.{dependency}.DependencyType: HARD or SOFT")
    manifests = recipe.get("Manifests")
    if not isinstance(manifests, list) or not manifests:
        problems.append("Manifests: a non-empty list is needed for a device to match any platform")
        manifests = []
    for index, manifest in enumerate(manifests):
        problems += _manifest_problems(f"Manifests[{index}]", manifest)
    problems += _variable_problems(recipe, defaults)
    return problems


def _version_problems(version: Any) -> list[str]:
    if not isinstance(version, str) or not SEMVER.match(version) or len(version) > 64:
        return [f"ComponentVersion: {version!r} is not a semantic version MAJOR.MINOR.PATCH"]
    if any(int(part) > 999999 for part in version.split("-")[0].split("+")[0].split(".")):
        return [f"ComponentVersion: {version!r}: major, minor and patch are at most 999999"]
    return []


def _configuration(configuration: Any, problems: list[str]) -> dict[str, Any]:
    if configuration is None:
        return {}
    if not isinstance(configuration, dict) or configuration.keys() - {"DefaultConfiguration"}:
        problems.append("ComponentConfiguration: only DefaultConfiguration is allowed")
        return {}
    defaults = configuration.get("DefaultConfiguration", {})
    if not isinstance(defaults, dict):
        problems.append("ComponentConfiguration.DefaultConfiguration: must be an object")
        return {}
    return defaults


def _manifest_problems(where: str, manifest: Any) -> list[str]:
    if not isinstance(manifest, dict):
        return [f"{where}: must be an object"]
    problems = [f"{where}.{k}: unknown key" for k in manifest.keys() - {"Name", "Platform", "Lifecycle",
                                                                        "Selections", "Artifacts"}]  # fmt: skip
    platform = manifest.get("Platform", {})
    if platform.get("os", "*") not in OSES:
        problems.append(f"{where}.Platform.os: {platform.get('os')!r} not one of {OSES}")
    if platform.get("architecture", "*") not in ARCHITECTURES:
        problems.append(f"{where}.Platform.architecture: {platform.get('architecture')!r} not one of {ARCHITECTURES}")
    problems += _lifecycle_problems(f"{where}.Lifecycle", manifest.get("Lifecycle", {}))
    for index, artifact in enumerate(manifest.get("Artifacts", [])):
        problems += _artifact_problems(f"{where}.Artifacts[{index}]", artifact)
    return problems


def _lifecycle_problems(where: str, lifecycle: Any) -> list[str]:
    if not isinstance(lifecycle, dict):
        return [f"{where}: must be an object"]
    problems = [f"{where}.{k}: unknown lifecycle step" for k in lifecycle.keys() - LIFECYCLE_STEPS]
    if "Startup" in lifecycle and "Run" in lifecycle:
        problems.append(f"{where}: Startup and Run exclude each other")
    for step, body in lifecycle.items():
        if step == "Setenv":
            problems += _setenv_problems(f"{where}.Setenv", body)
        elif isinstance(body, dict):
            problems += [f"{where}.{step}.{k}: unknown key" for k in body.keys() - STEP_KEYS]
            if not isinstance(body.get("Script"), str) or not body["Script"].strip():
                problems.append(f"{where}.{step}.Script: a non-empty string is required")
            timeout = body.get("Timeout", 1)
            if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout <= 0:
                problems.append(f"{where}.{step}.Timeout: a positive integer of seconds")
            if not isinstance(body.get("RequiresPrivilege", False), bool):
                problems.append(f"{where}.{step}.RequiresPrivilege: true or false")
            problems += _setenv_problems(f"{where}.{step}.Setenv", body.get("Setenv", {}))
        elif not isinstance(body, str):
            problems.append(f"{where}.{step}: a script string or an object with Script")
    return problems


def _setenv_problems(where: str, setenv: Any) -> list[str]:
    if not isinstance(setenv, dict) or not all(isinstance(v, str) for v in setenv.values()):
        return [f"{where}: must map names to strings"]
    return []


def _artifact_problems(where: str, artifact: Any) -> list[str]:
    if not isinstance(artifact, dict):
        return [f"{where}: must be an object"]
    problems = [f"{where}.{k}: unknown key" for k in artifact.keys() - ARTIFACT_KEYS]
    uri = artifact.get("Uri")
    if not isinstance(uri, str) or uri.partition(":")[0] not in URI_SCHEMES:
        problems.append(f"{where}.Uri: {uri!r} must start with one of {URI_SCHEMES}")
    elif uri.startswith("s3://") and (not uri[5:].partition("/")[0] or not uri[5:].partition("/")[2]):
        problems.append(f"{where}.Uri: {uri!r} needs s3://BUCKET/KEY")
    if "Digest" in artifact or "Algorithm" in artifact:
        algorithm = artifact.get("Algorithm")
        if algorithm not in DIGEST_BYTES:
            problems.append(f"{where}.Algorithm: {algorithm!r} not one of {tuple(DIGEST_BYTES)}")
        else:
            try:
                raw = base64.b64decode(str(artifact.get("Digest")), validate=True)
            except (binascii.Error, ValueError):
                raw = b""
            if len(raw) != DIGEST_BYTES[algorithm]:
                problems.append(f"{where}.Digest: not the base64 of a {algorithm} digest")
    if artifact.get("Unarchive", "NONE") not in ("NONE", "ZIP"):
        problems.append(f"{where}.Unarchive: NONE or ZIP")
    permission = artifact.get("Permission", {})
    for key in ("Read", "Execute"):
        if permission.get(key, "NONE") not in PERMISSIONS:
            problems.append(f"{where}.Permission.{key}: one of {PERMISSIONS}")
    return problems


def _variable_problems(recipe: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    problems = []
    for text in _strings(recipe.get("Manifests", [])):
        for variable in VARIABLE.findall(text):
            if variable.startswith("configuration:"):
                pointer = variable.removeprefix("configuration:")
                if not pointer.startswith("/") or pointer[1:].split("/")[0] not in defaults:
                    problems.append(f"{{{variable}}}: names no key of DefaultConfiguration")
            elif variable.split(":", 1)[-1] not in KNOWN_VARIABLES and variable not in KNOWN_VARIABLES:
                problems.append(f"{{{variable}}}: not a recipe variable")
    return problems


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []
