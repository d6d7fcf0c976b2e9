"""The decoder's facts of a bundle, for the packager code that only ever handles text-generation bundles.

`Manifest.model` is None in an embedding or classification bundle; the build summary, the prefix snapshot and
the bench read it from chat bundles only. `decoder_facts` says so in one place, with an error that names the
bundle's task, instead of an AttributeError on None.
"""

from __future__ import annotations

from packager.errors import UserError
from runtime.bundle import Manifest, ModelFacts


def decoder_facts(manifest: Manifest) -> ModelFacts:
    if manifest.model is None:
        raise UserError(
            f"the bundle of {manifest.function} serves {manifest.task}, not text generation: give a chat or "
            "completion bundle (pkg bench and prefix snapshots measure and warm a decoder)",
            exit_code=2,
        )
    return manifest.model
