"""Daemonless OCI images of a function: runtime base + bundle layer + code layer, pushed to a registry."""

from packager.image.build import ImageResult, LayerReport, build_image
from packager.image.registry import PushReport, RegistryAuth, RegistryTarget, pull_image, push_layout

__all__ = [
    "ImageResult",
    "LayerReport",
    "PushReport",
    "RegistryAuth",
    "RegistryTarget",
    "build_image",
    "pull_image",
    "push_layout",
]
