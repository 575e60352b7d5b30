"""Writes the project's exports of the cases in family_cases.EXPORTED, in float32 and bfloat16, for
make_family_logits.py --exports to load with PyTorch transformers 5: each case's numpy weights saved
under their PyTorch names, read by utils.models.hub_checkpoint into the family's parameter tree, cast,
and written back with the config.json transformers 5 saved for the case (family_logits.json).

Runs in the project's own environment, from the repository root:
    python tests/references/export_family_checkpoints.py /tmp/family_exports
"""

import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from safetensors.numpy import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from tests.references.decoder_cases import numpy_weights  # noqa: E402
from tests.references.family_cases import EXPORTED  # noqa: E402
from utils.models import decoders, hub_checkpoint  # noqa: E402


def main(out):
    with open(os.path.join(ROOT, "tests", "references", "family_logits.json"), encoding="utf-8") as f:
        cases = json.load(f)["cases"]
    for name in EXPORTED:
        case = cases[name]
        model = decoders.DecoderLM(decoders.config_from_hub(case["config"]))
        with tempfile.TemporaryDirectory() as pytorch_named:
            save_file(numpy_weights([(key, tuple(shape)) for key, shape in case["parameters"]], case["seed"]),
                      os.path.join(pytorch_named, "model.safetensors"), metadata={"format": "pt"})
            params = hub_checkpoint.read_checkpoint(pytorch_named, decoders.param_shapes(model))
        for dtype in ("float32", "bfloat16"):
            cast = jax.tree_util.tree_map(lambda leaf: jnp.asarray(leaf, dtype), params)
            hub_checkpoint.write_checkpoint(cast, os.path.join(out, f"{name}-{dtype}"), case["config"])
            print(f"wrote {name}-{dtype}")


if __name__ == "__main__":
    main(sys.argv[1])
