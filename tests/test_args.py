"""utils/base/arguments.py and parsing.py: JSON + CLI parsing, validation, secret-free saving, output-dir and phase
checks."""

import json
from dataclasses import dataclass, field
from typing import Optional

import pytest

from utils.base.arguments import (BaseDataArguments, ModelArguments, TrainingArguments, check_output_dir, check_phases,
                                  public_args, save_args)
from utils.base.errors import UsageError
from utils.base.parsing import parse_args


@dataclass
class DataArgs(BaseDataArguments):
    max_predict_samples: Optional[int] = field(default=None)


TYPES = (ModelArguments, DataArgs, TrainingArguments)


def write_config(tmp_path, config, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config) if not isinstance(config, str) else config)
    return str(path)


def parse(argv):
    return parse_args(TYPES, argv)


def test_json_config_alone(tmp_path):
    path = write_config(tmp_path, {"output_dir": str(tmp_path / "out"), "model_type": "t5", "learning_rate": 1e-3,
                                   "do_train": True, "num_train_epochs": 2, "eval_steps": None})
    model, data, train = parse([path])
    assert model.model_type == "t5"
    assert train.output_dir == str(tmp_path / "out")  # required field satisfied from JSON
    assert train.learning_rate == 1e-3 and train.do_train is True and train.num_train_epochs == 2
    assert train.eval_steps is None and train.per_device_train_batch_size == 8  # defaults kept
    assert data.max_train_samples is None


def test_cli_flags_override_json(tmp_path):
    path = write_config(tmp_path, {"output_dir": "a", "learning_rate": 1e-3, "seed": 1})
    _, _, train = parse([path, "--learning_rate", "2e-4", "--output_dir", "b"])
    assert train.learning_rate == 2e-4 and train.output_dir == "b"
    assert train.seed == 1


def test_unknown_json_key_suggests_closest(tmp_path):
    path = write_config(tmp_path, {"output_dir": "a", "learnig_rate": 1e-3})
    with pytest.raises(UsageError, match=r"unknown key 'learnig_rate'.*did you mean 'learning_rate'"):
        parse([path])


@pytest.mark.parametrize("key, value, expected", [
    ("learning_rate", "high", "float"),
    ("do_train", "yes", "bool"),
    ("per_device_train_batch_size", 2.5, "int"),
    ("seed", True, "int"),
])
def test_wrong_json_value_type(tmp_path, key, value, expected):
    path = write_config(tmp_path, {"output_dir": "a", key: value})
    with pytest.raises(UsageError, match=rf"'{key}' in config file .* must be {expected}, got {json.dumps(value)}"):
        parse([path])


def test_invalid_json_names_line_and_column(tmp_path):
    path = write_config(tmp_path, '{\n  "output_dir": "a",\n  "seed": 1,,\n}')
    with pytest.raises(UsageError, match=r"not valid JSON: .* at line 3 column 13"):
        parse([path])


def test_json_must_be_an_object(tmp_path):
    with pytest.raises(UsageError, match="must hold a JSON object"):
        parse([write_config(tmp_path, "[1, 2]")])


def test_missing_config_file(tmp_path):
    with pytest.raises(UsageError, match=r"config file .*nope\.json not found"):
        parse([str(tmp_path / "nope.json")])


def test_unknown_cli_flag_suggests_closest():
    with pytest.raises(UsageError, match=r"unknown argument --learnin_rate; did you mean '--learning_rate'"):
        parse(["--output_dir", "a", "--learnin_rate", "1e-3"])


def test_no_abbreviation_matching():
    with pytest.raises(UsageError, match=r"unknown argument --learning\b"):
        parse(["--output_dir", "a", "--learning", "1e-3"])


def test_missing_required_output_dir(tmp_path):
    """Neither the flags nor the config file give --output_dir: one line saying both ways to give it."""
    for argv in (["--do_train"], [write_config(tmp_path, {"do_train": True})]):
        with pytest.raises(UsageError, match=r"^--output_dir is required: pass --output_dir DIR, or give "
                                             r"\"output_dir\" in the JSON config file$"):
            parse(argv)


@pytest.mark.parametrize("argv, do_train, fast", [
    ([], False, True),
    (["--do_train"], True, True),
    (["--do_train", "false"], False, True),
    (["--do_train", "true", "--no_use_fast_tokenizer"], True, False),
    (["--use_fast_tokenizer", "false"], False, False),
])
def test_bool_flags(argv, do_train, fast):
    model, _, train = parse(["--output_dir", "a", *argv])
    assert train.do_train is do_train and model.use_fast_tokenizer is fast


def test_bool_false_from_json(tmp_path):
    path = write_config(tmp_path, {"output_dir": "a", "use_fast_tokenizer": False})
    model, _, _ = parse([path])
    assert model.use_fast_tokenizer is False


@pytest.mark.parametrize("flag, value", [
    ("--per_device_train_batch_size", "0"),
    ("--per_device_eval_batch_size", "-1"),
    ("--gradient_accumulation_steps", "0"),
    ("--learning_rate", "0"),
    ("--learning_rate", "-1e-4"),
    ("--num_train_epochs", "0"),
    ("--max_train_samples", "0"),
    ("--max_eval_samples", "-5"),
    ("--max_predict_samples", "0"),
    ("--eval_steps", "0"),
])
def test_non_positive_values_rejected(flag, value):
    with pytest.raises(UsageError, match=flag):
        parse(["--output_dir", "a", flag, value])


def test_compile_only_takes_a_known_tpu_slice():
    with pytest.raises(UsageError, match=r"^--compile_only 'v3-9' is not a TPU slice .*: use one of v2-8, v3-8, v4-8"):
        parse(["--output_dir", "a", "--do_train", "--compile_only", "v3-9"])
    assert parse(["--output_dir", "a", "--do_train", "--compile_only", "v3-8"])[2].compile_only == "v3-8"


def test_zero_epochs_allowed_with_max_steps():
    _, _, train = parse(["--output_dir", "a", "--num_train_epochs", "0", "--max_steps", "10"])
    assert train.max_steps == 10


@pytest.mark.parametrize("flag, value", [("--lr_scheduler_type", "exp"), ("--dtype", "int8"),
                                         ("--param_dtype", "float16"), ("--label_smoothing_factor", "1.0")])
def test_bad_choices_rejected(flag, value):
    with pytest.raises(UsageError, match=flag):
        parse(["--output_dir", "a", flag, value])


@pytest.mark.parametrize("argv, message", [
    (["--coordinator_address", "10.0.0.1"], "must be host:port"),
    (["--coordinator_address", "10.0.0.1:http"], "must be host:port"),
    (["--num_processes", "0"], "--num_processes must be positive"),
    (["--process_id", "-1"], "--process_id must be in"),
    (["--num_processes", "2", "--process_id", "2"], "--process_id must be in"),
])
def test_bad_multi_host_settings_rejected(argv, message):
    with pytest.raises(UsageError, match=message):
        parse(["--output_dir", "a", *argv])


def test_multi_host_settings_parsed():
    _, _, train = parse(["--output_dir", "a", "--coordinator_address", "[::1]:1234", "--num_processes", "2",
                         "--process_id", "1"])
    assert (train.coordinator_address, train.num_processes, train.process_id) == ("[::1]:1234", 2, 1)


def test_output_dir_expands_user(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    _, _, train = parse(["--output_dir", "~/run"])
    assert train.output_dir == str(tmp_path / "run")


def test_secrets_never_public_or_saved(tmp_path):
    model, data, train = parse(["--output_dir", str(tmp_path), "--hub_token", "hf_SECRET1", "--token", "hf_SECRET2",
                                "--seed", "7"])
    assert train.hub_token == "hf_SECRET1" and model.token == "hf_SECRET2"
    public = public_args(model, data, train)
    assert "hub_token" not in public and "token" not in public
    assert "SECRET" not in json.dumps(public)
    assert public["seed"] == 7 and public["output_dir"] == str(tmp_path)
    save_args(str(tmp_path), model, data, train)
    text = (tmp_path / "run_args.json").read_text()
    assert "SECRET" not in text and json.loads(text)["seed"] == 7
    assert train.hub_token == "hf_SECRET1"  # the instances themselves are untouched


# ---------------------------------------------------------------------------------------------
# check_output_dir / check_phases
# ---------------------------------------------------------------------------------------------
def training(out, **kwargs):
    return TrainingArguments(output_dir=str(out), **kwargs)


def test_non_empty_output_dir_refused(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(UsageError, match="--overwrite_output_dir") as info:
        check_output_dir(training(tmp_path, do_train=True), has_checkpoint=False)
    assert "--resume_from_checkpoint" not in str(info.value)


def test_non_empty_output_dir_with_checkpoints_names_resume(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(UsageError, match=r"--resume_from_checkpoint latest.*--overwrite_output_dir"):
        check_output_dir(training(tmp_path, do_train=True), has_checkpoint=True)


def test_output_dir_allowed_cases(tmp_path):
    check_output_dir(training(tmp_path / "new" / "deeper", do_train=True), has_checkpoint=False)
    check_output_dir(training(tmp_path, do_train=True), has_checkpoint=False)  # exists but empty
    (tmp_path / "old.txt").write_text("x")
    check_output_dir(training(tmp_path, do_train=True, overwrite_output_dir=True), has_checkpoint=False)
    check_output_dir(training(tmp_path, do_train=True, resume_from_checkpoint="latest"), has_checkpoint=True)
    check_output_dir(training(tmp_path, do_eval=True), has_checkpoint=False)  # eval-only into a finished run
    check_output_dir(training(tmp_path, do_predict=True), has_checkpoint=True)


def test_output_dir_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        check_output_dir(training(path, do_eval=True), has_checkpoint=False)


def test_check_phases(tmp_path):
    with pytest.raises(UsageError, match="--do_train, --do_eval, --do_predict"):
        check_phases(training(tmp_path))
    for phase in ("do_train", "do_eval", "do_predict"):
        check_phases(training(tmp_path, **{phase: True}))
