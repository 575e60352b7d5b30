"""Writes decoder_logits.json: PyTorch transformers' logits (and a greedy continuation) of the tiny
decoders in decoder_cases.py, which tests/test_decoder_positions.py compares the Flax models with.

Needs torch, which the project does not: run it in a side environment, from the repository root,
    python -m venv /tmp/torchvenv && /tmp/torchvenv/bin/pip install torch transformers==4.57.6 safetensors
    /tmp/torchvenv/bin/python tests/references/make_decoder_logits.py
"""

import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decoder_cases import CASES, config_settings, input_ids, numpy_weights  # noqa: E402

NEW_TOKENS = 6


def reference(name, seed):
    model_type, settings = config_settings(name)
    _, _, lengths, generates = CASES[name]
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    parameters = [(key, list(value.shape)) for key, value in model.named_parameters()]  # tied ones once
    state = {key: torch.from_numpy(value) for key, value in numpy_weights(parameters, seed).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(key == "lm_head.weight" and config.tie_word_embeddings for key in missing), missing
    inputs, prompt = input_ids(seed, lengths)
    case = dict(seed=seed, parameters=parameters, inputs=inputs, logits=[])
    with torch.no_grad():
        for ids in inputs:
            logits = model(torch.tensor(ids)).logits.numpy()
            case["logits"].append(np.round(logits.astype(np.float64), 5).tolist())
        if generates:
            ids = torch.tensor([prompt])
            sequence = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, pad_token_id=config.pad_token_id)
            case.update(prompt=prompt, generated=sequence[0, len(prompt):].tolist())
    return case


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decoder_logits.json")
    cases = {name: reference(name, seed) for seed, name in enumerate(CASES)}
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"made_with": f"torch {torch.__version__}, transformers {transformers.__version__}",
                   "cases": cases}, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {out}: {len(cases)} cases")


if __name__ == "__main__":
    main()
