"""The decoder's facts of a bundle, for the packager code that only ever handles text-generation bundles.

`Manifest.model` is None in an embedding or classification bundle; the build summary, the prefix snapshot and
the bench read it from chat bundles only. `decoder_facts` says so in one place, with an error that names the
bundle's task, instead of an AttributeError on None.
"""

from __future__ import annotations

from runtime.bundle import Manifest, ModelFacts


def decoder_facts(manifest: Manifest) -> ModelFacts:
    if manifest.model is None:
        raise ValueError(f"bundle of {manifest.function} serves {manifest.task}: it has no decoder (text generation)")
    return manifest.model
