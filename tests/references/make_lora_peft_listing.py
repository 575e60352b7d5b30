"""Writes lora_peft_listing.json: what PyTorch PEFT saves for a LoRA adapter (the keys and shapes of
adapter_model.safetensors, adapter_config.json) on the tiny models of lora_cases.py, which
tests/test_lora.py holds flaxtune's PEFT export to.

Needs torch and peft, which the project does not: run it in a side environment, from the repository root,
    python -m venv /work/scratch/torchvenv
    /work/scratch/torchvenv/bin/pip install torch==2.13.0 peft 'transformers>=4.57,<5'
    /work/scratch/torchvenv/bin/python tests/references/make_lora_peft_listing.py
"""

import json
import os
import sys
import tempfile

import peft
import safetensors.torch
import torch
import transformers
from peft import LoraConfig, get_peft_model

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_cases import ALPHA, CASES, RANK  # noqa: E402


def listing(model_type, settings, auto_suffix, task_type, targets):
    config = transformers.AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = getattr(transformers, f"AutoModelFor{auto_suffix}").from_config(config)
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, task_type=task_type, lora_dropout=0.0)
    peft_model = get_peft_model(model, lora)
    with tempfile.TemporaryDirectory() as directory:
        peft_model.save_pretrained(directory)
        tensors = safetensors.torch.load_file(os.path.join(directory, "adapter_model.safetensors"))
        with open(os.path.join(directory, "adapter_config.json"), encoding="utf-8") as f:
            saved_config = json.load(f)
    return {"tensors": {key: list(value.shape) for key, value in sorted(tensors.items())}, "config": saved_config}


def main():
    result = {"peft": peft.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
              "cases": {name: listing(*case) for name, case in CASES.items()}}
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lora_peft_listing.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    main()
