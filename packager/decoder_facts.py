"""The decoder's facts of a bundle, for the packager code that only ever handles text-generation bundles
(the build summary, the prefix snapshot, the bench): `Manifest.decoder`, as a CLI error."""

from __future__ import annotations

from packager.errors import UserError
from runtime.bundle import BundleError, Manifest, ModelFacts


def decoder_facts(manifest: Manifest) -> ModelFacts:
    try:
        return manifest.decoder
    except BundleError as exc:
        raise UserError(
            f"{exc}; give a chat or completion bundle (pkg bench and prefix snapshots measure and warm a decoder)",
            exit_code=2,
        ) from None
