"""Synthetic GGUFs of published model shapes: random weights, real shapes, llama.cpp's names and type mixes.

The hub is unreachable from where onnxfn is built and benched, so models at the sizes users deploy (1-8 B) are
generated: `synthetic_gguf("llama-3.1-8b", mix="q4_k_m")` returns the path of a cached GGUF file.
"""

from packager.synthetic.configs import PUBLISHED_CONFIGS, PublishedConfig, published_config
from packager.synthetic.mix import TYPE_MIXES
from packager.synthetic.writer import synthetic_gguf, write_synthetic_gguf

__all__ = [
    "PUBLISHED_CONFIGS",
    "TYPE_MIXES",
    "PublishedConfig",
    "published_config",
    "synthetic_gguf",
    "write_synthetic_gguf",
]
