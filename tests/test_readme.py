"""The README documents every argument of every script, with the default the code has."""

import dataclasses
import os
import re

import pytest

import run_clm_flax
import run_mlm_flax
import run_summarization_flax
import run_t5_mlm_flax
from utils.args import ModelArguments, TrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The README sections (`### <title>` under Arguments) that every script takes its arguments from.
COMMON = ("Model", "Training (all scripts)", "Data (every script)")
# Each script and the sections of its own data arguments, the most specific first: an argument two
# scripts share by name (`max_seq_length`: None for mlm, 512 for t5 mlm) is read from the first that has it.
SCRIPTS = {
    "summarization": (run_summarization_flax, ("Data (summarization)",)),
    "clm": (run_clm_flax, ("Data (clm only)", "Data (clm, mlm and t5 mlm)")),
    "mlm": (run_mlm_flax, ("Data (mlm only)", "Data (clm, mlm and t5 mlm)")),
    "t5 mlm": (run_t5_mlm_flax, ("Data (t5 mlm only)", "Data (clm, mlm and t5 mlm)")),
}


def documented_defaults(sections):
    """{argument: default as written} from the `| `name` | default | meaning |` rows of the README's
    `sections`, the first section that documents an argument winning."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        parts = re.split(r"^#{2,3} (.+)$", f.read(), flags=re.M)
    bodies = dict(zip(parts[1::2], parts[2::2]))
    defaults = {}
    for section in sections:
        assert section in bodies, f"README has no section '### {section}'"
        for name, default in re.findall(r"^\| `(\w+)` \| (\(required\)|`[^|]*`) \|", bodies[section], re.M):
            defaults.setdefault(name, default)
    return defaults


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_argument_is_documented_with_its_default(name):
    script, sections = SCRIPTS[name]
    documented = documented_defaults(sections + COMMON)
    for dataclass in (ModelArguments, TrainingArguments, script.DataTrainingArguments):
        for field in dataclasses.fields(dataclass):
            expected = "(required)" if field.default is dataclasses.MISSING else f"`{field.default!r}`"
            assert documented.get(field.name) == expected, f"{name}: --{field.name} (default {expected})"
