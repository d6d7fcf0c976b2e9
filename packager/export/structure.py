"""onnxruntime-genai's model builder run on a weightless model: the graph's structure and a recipe per weight.

`python -m packager.export.structure -i CONFIG_DIR -o OUT --weights SOURCE_JSON [builder arguments]` runs the
builder's own command line (fp32, CPU), its dispatch extended to the MoE decoders it has the parts for
(builder_moe.py), with three of its steps replaced:
- loading the model: the module tree is built from config.json on the meta device (accelerate's
  `init_empty_weights`) and every parameter becomes a lazy leaf named after it (lazy.py), so the builder
  walks the real architecture with no weight in memory;
- registering an initializer: a lazy one is recorded as a recipe (the builder's own arithmetic on named
  source tensors) instead of being stored; the rest (constants computed from the config) are kept as the
  builder made them;
- saving: the rotary tables become those transformers' rotary embedding computes (rotary.py: the builder's are
  wrong for several kinds of rope scaling); `structure.onnx` is the graph without the recorded weights (its
  nodes name them; `weights.json` gives each one's dtype, shape and recipe), beside the builder's
  genai_config.json and tokenizer files.

The few weight values the builder itself reads (whether a bias is all zeros) are computed from the source
named by `--weights` (sources/weights.py). The builder still reads config.json the way
`architectures.adapt_builder_config` adapts it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir
import torch
from onnxruntime_genai.models import builder

from packager.export.architectures import adapt_builder_config
from packager.export.builder_fixes import fix_model
from packager.export.builder_moe import install
from packager.export.lazy import LazyTensor, Recipe, loading, make_lazy, to_json
from packager.export.materialize import RECIPES_FILE, STRUCTURE_FILE
from packager.export.positions import derive_position_ids
from packager.export.rotary import correct_tables
from packager.sources.weights import load_any, open_weights

_DTYPES = {torch.float32: ir.DataType.FLOAT, torch.float16: ir.DataType.FLOAT16, torch.bfloat16: ir.DataType.BFLOAT16}


class _Recorder:
    """What the patched builder steps share: the recipes recorded and the source scalars are read from."""

    def __init__(self, weights: dict[str, str]) -> None:
        self.source = open_weights(weights)
        self.recipes: dict[str, dict[str, Any]] = {}
        self.lazy: dict[str, Recipe] = {}
        self.model: Any = None  # the transformers model the builder walks

    def load(self, name: str) -> torch.Tensor:
        return load_any(self.source, [name])


def _patch(model_class: Any, recorder: _Recorder) -> None:
    original_initializer = model_class.make_initializer
    original_hf_details = builder.get_hf_details

    def load_weights(self: Any, input_path: str) -> torch.nn.Module:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(input_path)
        with init_empty_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.tie_weights()  # a tied lm_head is then one leaf with the embedding (its source has only that)
        make_lazy(model)
        recorder.model = model
        fix_model(self)  # the builder model is initialised by now; it walks the layers next
        return model

    def make_initializer(self: Any, tensor: Any, /, name: str, *, to: Any = None, raw: bool = False) -> None:
        if not isinstance(tensor, LazyTensor):
            original_initializer(self, tensor, name, to=to, raw=raw)
            return
        if raw:
            raise ValueError(f"{name}: encoded-bytes initializers are not built from lazy weights")
        dtype = to if to is not None else _DTYPES[tensor.dtype]
        self.make_value(name, dtype, tuple(tensor.shape))
        recorder.lazy[name] = tensor.recipe
        recorder.recipes[name] = {"dtype": ir.DataType(dtype).name, "shape": list(tensor.shape)}

    def save_model(self: Any, out_dir: str) -> None:
        text_config = recorder.model.config.get_text_config()  # a multimodal wrapper's decoder, or the config itself
        correct_tables(self.model.graph, recorder.model, getattr(text_config, "layer_types", None))
        derive_position_ids(self.model.graph)  # explicit-rotary graphs: positions from the mask (positions.py)
        self.model.graph.sort()
        proto = ir.serde.serialize_model(self.model)
        onnx.save(
            proto, os.path.join(out_dir, STRUCTURE_FILE),
            save_as_external_data=True, location=STRUCTURE_FILE + ".data", size_threshold=1024,
        )  # fmt: skip
        recipes = to_json(recorder.lazy)
        recipes["initializers"] = recorder.recipes
        Path(out_dir, RECIPES_FILE).write_text(json.dumps(recipes) + "\n")

    def adapted_hf_details(*args: Any, **kwargs: Any) -> dict[str, Any]:
        details = original_hf_details(*args, **kwargs)
        adapt_builder_config(details["hf_config"])
        install(builder, details["hf_config"])  # an exporter of ours where the builder has none (builder_moe.py)
        return details

    model_class.load_weights = load_weights
    # The builder's rescaled frequencies only feed rotary tables that are replaced by transformers' own (rotary.py);
    # its yarn rescaling divides by a missing beta_fast/beta_slow and asserts on small rotary dimensions.
    model_class.make_inv_freq_rescaled = lambda self, inv_freq: inv_freq
    model_class.make_initializer = make_initializer
    model_class.save_model = save_model
    builder.get_hf_details = adapted_hf_details


def main() -> None:
    arguments = sys.argv[1:]
    at = arguments.index("--weights")
    weights = json.loads(arguments[at + 1])
    sys.argv = [sys.argv[0], *arguments[:at], *arguments[at + 2 :]]
    # The builder imports its modules as top-level `builders.*` (it puts its folder on sys.path).
    base = sys.modules["builders.base"]
    recorder = _Recorder(weights)
    _patch(base.Model, recorder)
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
    with loading(recorder.load):
        builder.create_model(*model, **extra_options)


if __name__ == "__main__":
    main()
