"""onnxruntime-genai's model builder command line, with the loaded Hugging Face config adapted first.

`python -m packager.export.genai_builder ARGS` takes the builder's own arguments. The builder reads
the config once (`get_hf_details`) and hands that object to every later step; transformers 5 writes
some configs in a shape the builder does not read (Gemma 3's rope parameters nested by layer type),
so the adaptation in `architectures.adapt_builder_config` is applied to that one object. Rewriting
config.json cannot do it: AutoConfig converts the 4.x keys back into the nested shape on load. The
weights still load through transformers with the folder's own config, untouched.
"""

from __future__ import annotations

from typing import Any

from onnxruntime_genai.models import builder

from packager.export.architectures import adapt_builder_config

_read_hf_details = builder.get_hf_details


def _adapted_hf_details(*args: Any, **kwargs: Any) -> dict[str, Any]:
    details = _read_hf_details(*args, **kwargs)
    adapt_builder_config(details["hf_config"])
    return details


def main() -> None:
    builder.get_hf_details = _adapted_hf_details
    # What the builder's own `if __name__ == "__main__"` block does.
    args = builder.get_args()
    model = (args.model_name, args.input, args.output, args.precision, args.execution_provider, args.cache_dir)
    extra_options = builder.parse_extra_options(
        *model,
        args.extra_options,
        builder_config_version=args.builder_config_version,
        target_options=args.target_options,
        drafter_options=args.drafter_options,
        speculative_options=args.speculative_options,
        runtime_config=args.runtime_config,
        search=args.search,
    )
    builder.create_model(*model, **extra_options)


if __name__ == "__main__":
    main()
