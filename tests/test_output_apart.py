"""A run never writes where it reads (`utils.run.preflight.check_output_apart`): for every script and every argument
that names a model, config, tokenizer, image processor, feature extractor, chat template, LoRA adapter or
checkpoint to read, an --output_dir that is it, lies inside it or holds it is refused with one `error:`
line naming both flags and both paths, exit code 2, and every file and folder as it was: training with and
without --overwrite_output_dir, and evaluation alone.

Each case runs the script's `main` in this process on a tiny input folder (a config.json and a tokenizer
file) and stops it should the preflight let it through: the refusal comes before any model or data is read.
"""

import dataclasses
import os
import re
import typing

import numpy as np
import pytest
from safetensors.numpy import save_file

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
from script_runner import directory_state
from test_errors_cli import check_failure, run_in_process
from utils.base.arguments import ModelArguments, READS, TrainingArguments
from utils.base.errors import UsageError
from utils.run.preflight import check_output_apart

SCRIPTS = {script.__name__: script for script in (
    run_bart_dlm_flax, run_clm_flax, run_flax_glue, run_flax_ner, run_hybrid_clip, run_image_captioning_flax,
    run_image_classification, run_mlm_flax, run_qa, run_speech_recognition_seq2seq, run_summarization_flax,
    run_t5_mlm_flax, run_wav2vec2_pretrain_flax)}


class _Parsed(Exception):
    pass


def argument_fields(script):
    """(field, whether it takes a string) of every argument of the dataclasses `script.main` parses (its own
    parse_args call, caught)."""
    def capture(dataclass_types, argv):
        raise _Parsed(dataclass_types)

    parse_args, script.parse_args = script.parse_args, capture
    try:
        script.main([])
    except _Parsed as parsed:
        return [(f, str in (hints[f.name], *typing.get_args(hints[f.name])))
                for dataclass_type in parsed.args[0] for hints in [typing.get_type_hints(dataclass_type)]
                for f in dataclasses.fields(dataclass_type)]
    finally:
        script.parse_args = parse_args
    raise AssertionError(f"{script.__name__}.main parsed no arguments")


FIELDS = {name: argument_fields(script) for name, script in SCRIPTS.items()}

# ---------------------------------------------------------------------------------------------
# Every argument that names a path is known
# ---------------------------------------------------------------------------------------------
PATH_LIKE = re.compile(r"(name_or_path|_name|_dir|_file|_path|checkpoint|template|model|tokenizer|adapter|"
                       r"processor|extractor)$")
# The arguments a path-like name fits that name nothing a model is read from.
NOT_READ_FROM = {
    "output_dir",  # where the run writes
    "cache_dir",  # the hub's download cache: its models live in their own models--*/snapshots folders
    "compilation_cache_dir",  # JAX's compiled programs
    "dataset_name", "dataset_config_name", "train_file", "validation_file", "test_file", "data_dir", "train_dir",
    "validation_dir", "test_dir",  # data
    "task_name",  # a GLUE or tagging task
}


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_path_argument_says_what_the_run_reads_from_it(name):
    """A new argument that names a path fails here until its field says what the run reads from it
    (`utils.base.arguments.READS`, which the check follows) or it is listed above as no model input."""
    for f, takes_a_string in FIELDS[name]:
        if (takes_a_string and PATH_LIKE.search(f.name) and not f.name.endswith("_column_name")
                and f.name not in NOT_READ_FROM):
            assert f.metadata.get(READS), (f"{name}: --{f.name} names a path: mark what the run reads from it "
                                           "(utils.base.arguments.READS) or list it in NOT_READ_FROM")


# ---------------------------------------------------------------------------------------------
# Every script, every input: refused
# ---------------------------------------------------------------------------------------------
# The parts of each model joined from two: the other part's flags go with a flag of one.
PARTS = {"run_hybrid_clip": {"text": ["--text_model_type", "bert"], "vision": ["--vision_model_type", "vit"]},
         "run_image_captioning_flax": {"encoder": ["--encoder_model_type", "vit"],
                                       "decoder": ["--decoder_model_type", "gpt2"]},
         "run_speech_recognition_seq2seq": {"encoder": ["--encoder_model_type", "wav2vec2"],
                                            "decoder": ["--decoder_model_type", "gpt2"]}}


def fillers(name, flag):
    """The other model flags `name`'s own checks before the preflight need when `flag` is given."""
    parts = PARTS.get(name, {})
    if flag == "model_name_or_path" or (name == "run_speech_recognition_seq2seq"
                                        and not flag.startswith(tuple(part + "_" for part in parts))):
        return []  # a whole saved model; speech recognition's other flags go with its own (Whisper)
    return [arg for part, args in parts.items() if not flag.startswith(part + "_") for arg in args]


def kinds(flag):
    """The kinds of input `flag` takes: a folder, a file, a LoRA adapter (and the base it names), a checkpoint."""
    return {"model_name_or_path": ["folder", "adapter", "adapter's base"], "config_name": ["folder", "file"],
            "chat_template": ["file"], "resume_from_checkpoint": ["checkpoint"]}.get(flag, ["folder"])


# A folder the output dir is, lies inside or holds; a file it holds, in its folder or above.
RELATIONS = {"file": ("is beside", "is above")}
CASES = [(name, f.name, kind, relation) for name in SCRIPTS for f, _ in FIELDS[name] if f.metadata.get(READS)
         for kind in kinds(f.name) for relation in RELATIONS.get(kind, ("is", "lies inside", "holds"))]
# Training as asked (a non-empty output dir is refused anyway), training told to overwrite, evaluation.
PHASES = (["--do_train"], ["--do_train", "--overwrite_output_dir"], ["--do_eval"])


def model_folder(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "gpt2"}')
    (path / "tokenizer.json").write_text('{"version": "1.0"}')
    return path


def make_input(tmp_path, flag, kind):
    """(the flags naming the input, the path the output dir is placed against, the error's words for what
    reads it) of a `kind` input of `flag` made under `tmp_path`."""
    home = tmp_path / "inputs" / "here"
    if kind == "folder":
        value = model_folder(home / "model")
        return [f"--{flag}", value], value, f"--{flag} {value} reads"
    if kind == "file":
        value = model_folder(home / "model") / ("template.jinja" if flag == "chat_template" else "config.json")
        value.write_text("{}")
        return [f"--{flag}", value], value, f"--{flag} {value} reads"
    if kind == "checkpoint":  # a step of another run
        value = home / "checkpoints" / "3"
        value.mkdir(parents=True)
        (value / "_CHECKPOINT_METADATA").write_text("{}")
        return [f"--{flag}", value], value, f"--{flag} {value} reads its checkpoint from"
    adapter, base = (home / "adapter", tmp_path / "elsewhere" / "base") if kind == "adapter" else (
        tmp_path / "elsewhere" / "adapter", home / "base")
    model_folder(base)
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(
        f'{{"peft_type": "LORA", "base_model_name_or_path": "{base}", "r": 4, "lora_alpha": 8}}')
    save_file({"base_model.model.layer.lora_A.weight": np.zeros((4, 8), np.float32)},
              str(adapter / "adapter_model.safetensors"))  # a readable adapter: the arguments check its header
    flags = ["--model_name_or_path", adapter, "--lora_rank", 4]
    if kind == "adapter":
        return flags, adapter, f"--model_name_or_path {adapter} reads its LoRA adapter from"
    return flags, base, f"{base} that the LoRA adapter --model_name_or_path {adapter} names as its base model"


def tree_state(path):
    """Every file (its bytes and mtime) and every folder under `path`."""
    folders = sorted(os.path.relpath(root, path) for root, _, _ in os.walk(path))
    return directory_state(path), folders


@pytest.fixture
def refused(monkeypatch, capsys, tmp_path):
    """refused(script, argv, pattern): `script.main(argv)` ends in the error line `pattern` with exit code 2,
    with nothing under tmp_path changed; it must not get past the preflight."""
    def past_the_preflight(*args, **kwargs):
        raise AssertionError("the preflight let the run through")

    for script in SCRIPTS.values():
        monkeypatch.setattr(script, "set_up", past_the_preflight)

    def run(script, argv, pattern):
        before = tree_state(tmp_path)
        returncode = run_in_process(script, argv, tmp_path)
        check_failure(2, returncode, capsys.readouterr().err, pattern)
        assert tree_state(tmp_path) == before

    return run


@pytest.mark.parametrize("name, flag, kind, relation", CASES)
def test_an_output_dir_on_an_input_is_refused(refused, tmp_path, name, flag, kind, relation):
    flags, target, reader = make_input(tmp_path, flag, kind)
    if kind == "file":  # (a folder beside it is no harm: test_what_is_not_refused)
        out, words = (target.parent if relation == "is beside" else target.parent.parent), "holds the file"
    else:
        out = {"is": target, "lies inside": target / "run", "holds": target.parent}[relation]
        words = f"{relation} the directory"
    data = ["--train_file", tmp_path / "data" / "train.json", "--validation_file", tmp_path / "data" / "valid.json"]
    pattern = "^" + re.escape(f"error: --output_dir {out} {words} {reader}") + "[^:]*: writing there [^;]+; pass " \
        "another --output_dir$"
    for phases in PHASES:
        refused(SCRIPTS[name], [*flags, *fillers(name, flag), *data, *phases, "--output_dir", out], pattern)


@pytest.fixture
def model(tmp_path):
    return model_folder(tmp_path / "runs" / "model")


@pytest.mark.parametrize("where", ["relative with ..", "symlinked output", "symlinked model", "~ output",
                                   "~ model"])
def test_paths_are_compared_resolved(refused, monkeypatch, tmp_path, model, where):
    """However the two paths are spelled, the same folder is refused."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path))
    model_flag, out = str(model), str(model)
    if where == "relative with ..":
        model_flag, out = "../runs/model", "../runs/./model/"
    elif where == "symlinked output":
        os.symlink(model, tmp_path / "link")
        out = str(tmp_path / "link")
    elif where == "symlinked model":
        os.symlink(model, tmp_path / "link")
        model_flag = str(tmp_path / "link")
    elif where == "~ output":
        out = "~/runs/model"
    else:
        model_flag = "~/runs/model"
    shown = os.path.expanduser(out)  # --output_dir's ~ is expanded as it is parsed
    pattern = "^" + re.escape(f"error: --output_dir {shown} is the directory --model_name_or_path {model_flag} reads "
                              "its model from: writing there would replace it; pass another --output_dir") + "$"
    refused(run_clm_flax, ["--model_name_or_path", model_flag, "--train_file", "train.txt", "--do_train",
                           "--overwrite_output_dir", "--output_dir", out], pattern)


# ---------------------------------------------------------------------------------------------
# What is not refused
# ---------------------------------------------------------------------------------------------
def check(out, resume=None, **model):
    check_output_apart(TrainingArguments(output_dir=str(out), do_train=True, resume_from_checkpoint=resume),
                       ModelArguments(**model))


def test_what_is_not_refused(tmp_path, monkeypatch, model):
    monkeypatch.chdir(tmp_path)
    check(tmp_path / "runs" / "model2", model_name_or_path=str(model))  # a name that starts the same
    check(tmp_path / "runs" / "other", model_name_or_path=str(model), tokenizer_name=str(model))
    check(model / "run", config_name=str(model / "config.json"))  # beside a file, not over it
    check("gpt2", model_name_or_path="gpt2", tokenizer_name="gpt2")  # hub ids, no local folders
    os.makedirs("gpt2")  # ... until a local folder of that name is what the run would load
    with pytest.raises(UsageError, match=r"^--output_dir gpt2 is the directory --model_name_or_path gpt2 reads"):
        check("gpt2", model_name_or_path="gpt2")


def test_resuming_into_its_own_output_dir_is_allowed(tmp_path):
    """Resuming continues a run in its own output dir, however --resume_from_checkpoint names its
    checkpoints; another run's are read, so this run may not write over them."""
    out = tmp_path / "run"
    (out / "checkpoints" / "4").mkdir(parents=True)
    os.symlink(out, tmp_path / "link")
    for resume in ("latest", "4", out, out / "checkpoints", out / "checkpoints" / "4", tmp_path / "link"):
        check(out, str(resume))
    with pytest.raises(UsageError, match=r"^--output_dir .*run/checkpoints is the directory --resume_from_checkpoint "
                                         r".*run/checkpoints reads its checkpoint from"):
        check(out / "checkpoints", str(out / "checkpoints"))
