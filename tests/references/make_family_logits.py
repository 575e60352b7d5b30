"""Writes family_logits.json: PyTorch transformers 5's logits, greedy continuations and parameter listings
of the tiny decoders in family_cases.py, which tests/test_decoder_family.py compares the project's own
decoder family (utils/models/decoders.py) with; and, given the project's exports of some of them, whether
PyTorch transformers 5 loads those exports as it loads its own save_pretrained of the same weights.

Needs torch and transformers 5, which the project does not: run it in a side environment, from the
repository root, in three steps (the second in the project's own environment):
    python -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch "transformers>=5,<6" safetensors numpy
    /tmp/torchvenv/bin/python tests/references/make_family_logits.py
    python tests/references/export_family_checkpoints.py /tmp/family_exports
    /tmp/torchvenv/bin/python tests/references/make_family_logits.py --exports /tmp/family_exports
"""

import argparse
import json
import os
import sys
import tempfile

import numpy as np
import torch
import transformers
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decoder_cases import numpy_weights  # noqa: E402
from family_cases import CASES, EXPORTED, config_settings, input_ids  # noqa: E402

NEW_TOKENS = 6
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "family_logits.json")


def reference_model(name, seed):
    """(PyTorch model in float32 with the case's numpy weights, its parameter listing)."""
    model_type, settings = config_settings(name)
    config = AutoConfig.for_model(model_type, **settings)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    parameters = [(key, list(value.shape)) for key, value in model.named_parameters()]  # tied ones once
    state = {key: torch.from_numpy(value) for key, value in numpy_weights(parameters, seed).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(key == "lm_head.weight" and config.tie_word_embeddings for key in missing), missing
    return model, parameters


def greedy(model, ids, mask):
    sequences = model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
    return sequences[:, len(ids[0]):].tolist()


def reference(name, seed):
    model, parameters = reference_model(name, seed)
    inputs, prompt, (padded, padded_mask) = input_ids(seed, CASES[name][2])
    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
            saved_config = json.load(f)
    case = dict(seed=seed, parameters=parameters, config=saved_config, inputs=inputs, logits=[], prompt=prompt,
                padded_prompts=padded, padded_mask=padded_mask)
    with torch.no_grad():
        for ids in inputs:
            logits = model(torch.tensor(ids)).logits.numpy()
            case["logits"].append(np.round(logits.astype(np.float64), 5).tolist())
        case["generated"] = greedy(model, [prompt], [[1] * len(prompt)])[0]
        case["padded_generated"] = greedy(model, padded, padded_mask)
        case["bfloat16_error"] = bfloat16_error(model, inputs[0], case["logits"][0])
    return case


def bfloat16_error(model, ids, logits):
    """How far PyTorch's own bfloat16 model (the float32 one saved and loaded in bfloat16, as a user
    would) lands from its float32 logits: the yardstick of the family's bfloat16 test."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        half = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        got = half(torch.tensor(ids)).logits.float()
    return round(float((got - torch.tensor(logits)).abs().max()), 5)


def listing(path):
    """{name: [shape, dtype]} of every tensor in the safetensors files of a folder."""
    found = {}
    for file in sorted(os.listdir(path)):
        if file.endswith(".safetensors"):
            with safe_open(os.path.join(path, file), framework="pt") as f:
                for key in f.keys():
                    tensor = f.get_tensor(key)
                    found[key] = [list(tensor.shape), str(tensor.dtype)]
    return found


def check_export(name, case, folder, dtype):
    """Does transformers 5 load the project's export of a case (in `dtype`) as it loads its own
    save_pretrained of the same weights: the same tensors (names, shapes, dtypes, values) and logits?"""
    model, _ = reference_model(name, case["seed"])
    ids = torch.tensor(case["inputs"][0])
    with tempfile.TemporaryDirectory() as saved:
        model.to(dtype).save_pretrained(saved)
        theirs = AutoModelForCausalLM.from_pretrained(saved, attn_implementation="eager", dtype=dtype).eval()
        same_files = listing(saved) == listing(folder)
    ours = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", dtype=dtype).eval()
    their_state, our_state = theirs.state_dict(), ours.state_dict()
    same_weights = their_state.keys() == our_state.keys() and all(
        torch.equal(their_state[key], our_state[key]) for key in their_state)
    with torch.no_grad():
        want, got = theirs(ids).logits.float(), ours(ids).logits.float()
    return dict(loaded=True, tensors_as_save_pretrained=same_files, weights_equal=same_weights,
                max_abs_logit_difference=float((want - got).abs().max()),
                max_abs_difference_from_reference_logits=float(
                    (got - torch.tensor(case["logits"][0])).abs().max()))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--exports", help="the folder export_family_checkpoints.py wrote")
    args = parser.parse_args()
    if args.exports:
        with open(OUT, encoding="utf-8") as f:
            stored = json.load(f)
        stored["exports"] = {
            f"{name}/{dtype}": check_export(name, stored["cases"][name], os.path.join(args.exports, f"{name}-{dtype}"),
                                            getattr(torch, dtype))
            for name in EXPORTED for dtype in ("float32", "bfloat16")}
        print(json.dumps(stored["exports"], indent=1))
    else:
        stored = {"made_with": f"torch {torch.__version__}, transformers {transformers.__version__}",
                  "cases": {name: reference(name, seed) for seed, name in enumerate(CASES)}}
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(stored, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT}: {len(stored['cases'])} cases")


if __name__ == "__main__":
    main()
