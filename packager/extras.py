"""Which optional extra of onnxfn installs a module: a command that needs one says what to install.

`pip install onnxfn` is the runtime and every `pkg` command that needs no exporter; `pkg build` needs the
`packager` extra (torch, transformers, gguf, onnx, the model builder...), the Lambda entry point the `lambda`
one. Each command imports these only when it runs, so a missing one surfaces as a `ModuleNotFoundError` there;
the extra that brings it is read from the installed package's own metadata (pyproject.toml's
`[project.optional-dependencies]`), so the two never disagree.
"""

from __future__ import annotations

import re
from importlib import metadata

from packager.errors import UserError

DISTRIBUTION = "onnxfn"
_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)[^;]*;.*\bextra\s*==\s*['\"]([A-Za-z0-9_-]+)['\"]")


def extra_providing(module: str) -> str | None:
    """The extra whose requirements install the top-level `module` (a distribution's name, normalised), if any."""
    try:
        requirements = metadata.requires(DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        return None
    wanted = module.split(".", 1)[0].lower()
    for requirement in requirements:
        match = _REQUIREMENT.match(requirement)
        if match and re.sub(r"[-.]", "_", match[1].lower()) == wanted and match[2] != "test":
            return match[2]
    return None


def missing_extra(exc: ModuleNotFoundError, command: str) -> UserError | None:
    """The error to show when `pkg COMMAND` stopped on a module an extra installs; None for any other module."""
    module = (exc.name or "").split(".", 1)[0]
    extra = extra_providing(module) if module else None
    if extra is None:
        return None
    return UserError(
        f"`pkg {command}` needs the {module!r} module, which the {extra!r} extra installs: "
        f"pip install 'onnxfn[{extra}]'"
    )
