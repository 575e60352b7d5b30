"""--help of every script: the usage with a config file, the options in their sections in order, each
default said once and equal to the code's, --output_dir not marked required, booleans as [true|false],
and every --no_X listed saying what it does."""

import contextlib
import dataclasses
import io
import re
from dataclasses import dataclass, field
from typing import Optional

import pytest

import run_bart_dlm_flax
import run_clm_flax
import run_flax_glue
import run_flax_ner
import run_hybrid_clip
import run_image_captioning_flax
import run_image_classification
import run_mlm_flax
import run_qa
import run_speech_recognition_seq2seq
import run_summarization_flax
import run_t5_mlm_flax
import run_wav2vec2_pretrain_flax
from utils.base.arguments import BaseDataArguments, ModelArguments, TrainingArguments
from utils.base.parsing import ArgumentParser, parse_args

SCRIPTS = {module.__name__: module for module in (
    run_bart_dlm_flax, run_clm_flax, run_flax_glue, run_flax_ner, run_hybrid_clip, run_image_captioning_flax,
    run_image_classification, run_mlm_flax, run_qa, run_speech_recognition_seq2seq, run_summarization_flax,
    run_t5_mlm_flax, run_wav2vec2_pretrain_flax)}
# The sections, in the order a newcomer reads them: what most runs set first.
SECTIONS = ["Model", "Data", "Training", "Output, logging and checkpoints", "Precision, layout and memory",
            "LoRA (low-rank adapters)", "TPU kernels and compilation", "Multi-host", "Hugging Face hub"]
# Where a few options of every script must be found.
SECTION_OF = {"model_name_or_path": "Model", "train_file": "Data", "learning_rate": "Training",
              "output_dir": "Output, logging and checkpoints", "save_steps": "Output, logging and checkpoints",
              "sharding": "Precision, layout and memory", "dtype": "Precision, layout and memory",
              "lora_rank": "LoRA (low-rank adapters)", "compile_only": "TPU kernels and compilation",
              "num_processes": "Multi-host", "push_to_hub": "Hugging Face hub"}
DEFAULT = re.compile(r"\s*\(default: [^)]*\)$")


def help_of(dataclass_types):
    """What --help prints for these argument classes."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit:
        parse_args(dataclass_types, ["--help"])
    assert exit.value.code == 0
    return out.getvalue()


@pytest.fixture(params=SCRIPTS)
def script(request, monkeypatch):
    """(script module, its help, its argument classes): its own main's --help, the classes it parses recorded."""
    module, parsed = SCRIPTS[request.param], []

    def recording(dataclass_types, argv):
        parsed.extend(dataclass_types)
        return parse_args(dataclass_types, argv)

    monkeypatch.setattr(module, "parse_args", recording)
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit:
        module.main(["--help"])
    assert exit.value.code == 0
    return module, out.getvalue(), parsed


def options(text):
    """{flag: (section, invocation, help)} of every option a help lists."""
    found, section, current = {}, None, None
    for line in text.splitlines():
        if re.match(r"^\S.*:$", line):
            section, current = line[:-1], None
        elif line.startswith("  --"):
            invocation, _, help_start = line.strip().partition("  ")
            current = found[invocation.split()[0]] = [section, invocation, help_start]
        elif line.startswith("   ") and current:
            current[2] += " " + line.strip()
        else:
            current = None
    return {flag: (section, invocation, " ".join(text.split())) for flag, (section, invocation, text) in found.items()}


def fields_of(dataclass_types):
    return [(dtype, f) for dtype in dataclass_types for f in dataclasses.fields(dtype)]


def typed_default(value):
    """A default as the command line spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return " ".join(f"'{item}'" if " " in item else item for item in value)
    return str(value)


def test_usage_names_the_config_file_then_describes_the_script(script):
    module, text, _ = script
    assert text.splitlines()[0] == f"usage: {module.__name__}.py [CONFIG.json] [--flag value ...]"
    flat = " ".join(text.split())
    assert " ".join(module.__doc__.split("\n\n")[0].split()) in flat
    assert "CONFIG.json" in flat and "flags after it override its values" in flat


def test_every_option_is_listed_once_in_its_section_and_sections_in_order(script):
    _, text, dataclass_types = script
    assert re.findall(r"^(\S.*):$", text, re.M) == SECTIONS
    listed = options(text)
    assert len(re.findall(r"^  --", text, re.M)) == len(listed)
    assert {flag[2:] for flag in listed if not flag.startswith("--no_")} == {f.name for _, f in
                                                                             fields_of(dataclass_types)}
    for name, section in SECTION_OF.items():
        assert listed[f"--{name}"][0] == section, name
    data_class = next(dtype for dtype in dataclass_types if issubclass(dtype, BaseDataArguments))
    for f in dataclasses.fields(data_class):
        if "group" not in f.metadata:
            assert listed[f"--{f.name}"][0] == "Data", f.name


def test_each_default_is_said_once_and_is_the_code_s(script):
    _, text, dataclass_types = script
    listed = options(text)
    for _, f in fields_of(dataclass_types):
        _, _, help_text = listed[f"--{f.name}"]
        assert help_text.count("(default:") <= 1, f.name
        own = "(default:" in f.metadata.get("help", "")
        value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if not own and value not in (None, dataclasses.MISSING):
            assert help_text.endswith(f"(default: {typed_default(value)})"), f.name
        elif not own:  # None: the option is unset unless given
            assert "(default:" not in help_text, f.name


def test_a_help_text_says_its_own_default_only_where_the_value_does_not(script):
    """A text saying "(default: ...)" hides the field's value: it must be None (computed at run time)."""
    for _, f in fields_of(script[2]):
        if "(default:" in f.metadata.get("help", ""):
            assert f.default is None, f.name


def test_output_dir_is_not_marked_required(script):
    _, text, _ = script
    assert "--output_dir" not in text.splitlines()[0]
    section, invocation, help_text = options(text)["--output_dir"]
    assert invocation == "--output_dir DIR" and "required" not in help_text and "CONFIG.json" in help_text


def test_booleans_take_true_or_false(script):
    _, text, dataclass_types = script
    listed = options(text)
    for _, f in fields_of(dataclass_types):
        if f.type in (bool, Optional[bool]):
            assert listed[f"--{f.name}"][1] == f"--{f.name} [true|false]"


def test_negated_booleans_say_what_they_do(script):
    _, text, _ = script
    listed = options(text)
    negated = [flag for flag in listed if flag.startswith("--no_")]
    assert "--no_use_fast_tokenizer" in negated
    for flag in negated:
        positive = listed["--" + flag[len("--no_"):]][2]
        assert listed[flag][2] and listed[flag][2] != DEFAULT.sub("", positive), flag
    assert listed["--no_use_fast_tokenizer"][2] == "Use the slow (Python) tokenizer."


@dataclass
class NewDataArguments(BaseDataArguments):
    knob: int = field(default=3, metadata={"help": "A knob added later."})
    smooth: bool = field(default=True, metadata={"help": "Smooth the data."})


def test_a_new_field_lands_in_its_class_section_and_a_bare_negation_is_hidden_but_works():
    types = (ModelArguments, NewDataArguments, TrainingArguments)
    listed = options(help_of(types))
    assert listed["--knob"] == ("Data", "--knob INT", "A knob added later. (default: 3)")
    assert "--smooth" in listed and "--no_smooth" not in listed  # no negated_help: --smooth false says it
    _, data, _ = parse_args(types, ["--output_dir", "out", "--no_smooth"])
    assert data.smooth is False


def test_a_field_without_a_section_is_refused():
    @dataclass
    class Loose:
        knob: int = field(default=3, metadata={"help": "A knob."})

    with pytest.raises(ValueError, match="Loose.knob has no --help section"):
        ArgumentParser((ModelArguments, Loose, TrainingArguments))
