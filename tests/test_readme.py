"""The README documents every argument of every script, with the default the code has."""

import dataclasses
import os
import re

import pytest

import run_clm_flax
import run_mlm_flax
import run_summarization_flax
from utils.args import ModelArguments, TrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = {"summarization": run_summarization_flax, "clm": run_clm_flax, "mlm": run_mlm_flax}


def documented_defaults():
    """{argument: default as written} from every `| `name` | default | meaning |` row of the README."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        rows = re.findall(r"^\| `(\w+)` \| (\(required\)|`[^|]*`) \|", f.read(), re.M)
    return dict(rows)


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_argument_is_documented_with_its_default(name):
    documented = documented_defaults()
    for dataclass in (ModelArguments, TrainingArguments, SCRIPTS[name].DataTrainingArguments):
        for field in dataclasses.fields(dataclass):
            expected = "(required)" if field.default is dataclasses.MISSING else f"`{field.default!r}`"
            assert documented.get(field.name) == expected, f"{name}: --{field.name} (default {expected})"
