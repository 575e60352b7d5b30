"""Bad input never crashes: every mistake ends in one `error: ...` line naming the problem and the fix,
exit code 2 (usage) or 1 (runtime), no traceback, and an output directory exactly as it was.

Most cases call the script's `main` through `run_main` in this process (no start-up cost) with model
loading replaced by a tripwire: they must fail before any model is built. A few run the real script
as a subprocess.
"""

import errno
import http.server
import json
import os
import re
import shutil
import subprocess
import threading
import time

import jax
import numpy as np
import pytest
from huggingface_hub import constants
from transformers import PretrainedConfig

import run_clm_flax as clm
import run_flax_glue as glue
import run_mlm_flax as mlm
import run_qa
import run_summarization_flax as summarization
import run_t5_mlm_flax as t5_mlm
import run_bart_dlm_flax as bart_dlm
from script_runner import ROOT, directory_state, run_script, script_env
from tasks.summarization import TASK
from utils.base import hub_probe
from utils.base.arguments import TrainingArguments
from utils.base.errors import RunError, run_main
from utils.checkpoints.saving import Saver
from utils.checkpoints.store import Checkpointer
from utils.models import flax_msgpack
from utils.run.loop import InMemoryData
from utils.run.run_directory import RunDirectory

DATA = os.path.join(ROOT, "data", "summarization")
TOKENIZER = os.path.join(DATA, "tokenizer")
LM_TOKENIZER = os.path.join(ROOT, "data", "lm", "tokenizer")
LM_TRAIN = os.path.join(ROOT, "data", "lm", "train.txt")
T5_TOKENIZER = os.path.join(ROOT, "data", "lm", "t5_tokenizer")
TINY_T5 = "d_model=32,d_ff=64,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=16,dropout_rate=0.0"
# A port nothing listens on: "connection refused" at once, like a machine without a network.
UNREACHABLE = "http://127.0.0.1:9"


def rows(n, **extra):
    return [{"document": f"Ann met Bob in Rome on day {i}.", "summary": f"Ann met Bob {i}.", **extra}
            for i in range(n)]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Good and bad data files, by name."""
    d = tmp_path_factory.mktemp("data")
    out = {"train": write_jsonl(d / "train.jsonl", rows(40)), "valid": write_jsonl(d / "valid.jsonl", rows(5))}
    (d / "empty.jsonl").write_text("")
    (d / "train.parquet").write_bytes(b"PAR1")
    (d / "latin1.jsonl").write_bytes(b'{"document": "a", "summary": "b"}\n{"document": "caf\xe9", "summary": "b"}\n')
    (d / "broken.jsonl").write_text('{"document": "a", "summary": "b"}\n{"document": "a", "summary" "b"}\n')
    (d / "titles.csv").write_text("text,title\nAnn met Bob.,Meeting\n")
    out["no_summary_valid"] = write_jsonl(d / "no_summary_valid.jsonl", [{"document": "a", "abstract": "b"}])
    out["all_empty"] = write_jsonl(d / "all_empty.jsonl", rows(4, summary=" "))
    out["one_column"] = write_jsonl(d / "one_column.jsonl", [{"document": "a"}])
    for name in ("empty.jsonl", "train.parquet", "latin1.jsonl", "broken.jsonl", "titles.csv"):
        out[name] = str(d / name)
    # A dataset directory (what --dataset_name also accepts) with a train split only.
    (d / "train_only").mkdir()
    write_jsonl(d / "train_only" / "train.jsonl", rows(20))
    out["train_only"] = str(d / "train_only")
    return out


def check_failure(code, returncode, stderr, pattern):
    assert returncode == code, stderr[-2000:]
    assert "Traceback" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and re.search(pattern, last), last


def stop_at_model(monkeypatch, error):
    def load_model(*args, **kwargs):
        raise error

    for script in (summarization, clm, mlm, t5_mlm, bart_dlm, glue, run_qa):
        monkeypatch.setattr(script, "load_model", load_model)


def run_in_process(script, argv, tmp_path):
    """(exit code, stderr is read by the caller) of `script.main(argv)` under `run_main`, as the script runs it."""
    argv = [str(a) for a in argv] + ["--compilation_cache_dir", "none", "--cache_dir", str(tmp_path / "cache")]
    return run_main(lambda: script.main(argv), argv)


@pytest.fixture
def fails(monkeypatch, capsys, tmp_path):
    """fails(argv, pattern, code=2, out=..., script=...): run main in-process; check the error and the output dir."""
    stop_at_model(monkeypatch, AssertionError("the model was built before the error was found"))

    def run(argv, pattern, code=2, out=None, script=summarization):
        out = str(out or tmp_path / "out")
        before = directory_state(out)
        returncode = run_in_process(script, [*argv, "--output_dir", out], tmp_path)
        check_failure(code, returncode, capsys.readouterr().err, pattern)
        assert directory_state(out) == before

    return run


def scratch(files, *args, train=None, phases=("--do_train",)):
    """Flags for a tiny T5 from scratch on `train` (default: the good training file)."""
    return ["--model_type", "t5", "--config_overrides", TINY_T5, "--tokenizer_name", TOKENIZER,
            "--train_file", train or files["train"], "--per_device_train_batch_size", 1, *phases, *args]


# ---------------------------------------------------------------------------------------------
# Arguments and config file
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content, pattern", [
    (None, r"config file .*config\.json not found: check the path"),
    ('{\n  "do_train": true,,\n}', r"not valid JSON: .* at line 2 column 20"),
    ('{"learnig_rate": 0.1}', r"unknown key 'learnig_rate' .*did you mean 'learning_rate'"),
    ('{"learning_rate": "fast"}', r"'learning_rate' in config file .* must be float, got \"fast\""),
])
def test_config_file_errors(fails, tmp_path, content, pattern):
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    fails([path], pattern)


def test_unknown_flag_suggests_closest(fails, files):
    fails(scratch(files, "--learnin_rate", "1e-3"), r"unknown argument --learnin_rate; did you mean '--learning_rate'")


@pytest.mark.parametrize("flag, value", [
    ("--per_device_train_batch_size", 0), ("--per_device_eval_batch_size", -2), ("--learning_rate", 0),
    ("--learning_rate", -0.1), ("--num_train_epochs", 0), ("--max_train_samples", 0), ("--max_eval_samples", -1),
    ("--max_predict_samples", 0), ("--max_source_length", 0),
])
def test_non_positive_values(fails, files, flag, value):
    fails(scratch(files, flag, value), rf"{flag} must be (positive|a positive number)")


@pytest.mark.parametrize("args, pattern", [
    (["--gradient_checkpointing", "--gradient_checkpointing_policy", "dot"],
     r"--gradient_checkpointing_policy 'dot' is unknown: use one of nothing, kernels$"),
    (["--gradient_checkpointing_policy", "kernels"],
     r"--gradient_checkpointing_policy kernels says what --gradient_checkpointing keeps, and it is off: add "
     r"--gradient_checkpointing$"),
])
def test_a_checkpointing_policy_needs_a_known_name_and_checkpointing(fails, files, args, pattern):
    fails(scratch(files, *args), pattern)


def test_no_phase(fails, files):
    fails(scratch(files, phases=()), r"nothing to do: pass at least one of --do_train, --do_eval, --do_predict")


# ---------------------------------------------------------------------------------------------
# Data files and columns: found by the pre-read, before the hub, the tokenizer or the model
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, pattern", [
    ("missing.jsonl", r"data file .*missing\.jsonl not found: check the path"),
    ("train.parquet", r"data file .*train\.parquet has an unsupported extension: use one of \.csv, \.json, \.jsonl"),
    ("empty.jsonl", r"data file .*empty\.jsonl is empty"),
    ("latin1.jsonl", r"latin1\.jsonl is not UTF-8 text: byte 0xe9 at offset 51 \(line 2\); convert it to UTF-8"),
    ("broken.jsonl", r"broken\.jsonl:2 is not valid JSON: Expecting ':' delimiter \(column 29\)"),
])
def test_bad_data_file(fails, files, name, pattern):
    fails(scratch(files, train=files.get(name, os.path.join(os.path.dirname(files["train"]), name))), pattern)


def test_csv_without_the_columns_lists_them(fails, files):
    fails(scratch(files, "--text_column", "document", train=files["titles.csv"]),
          r"--text_column 'document' is not a column of the train data; its columns: text, title")


def test_summary_column_missing_from_one_split(fails, files):
    fails(scratch(files, "--do_eval", "--validation_file", files["no_summary_valid"]),
          r"--summary_column 'summary' is not a column of the validation data; its columns: document, abstract")


def test_data_with_one_column(fails, files):
    fails(scratch(files, train=files["one_column"]), r"only the column 'document': summarization needs a document "
                                                      r"column and a summary column")


def test_do_eval_without_validation_data(fails, files):
    fails(scratch(files, "--do_eval"), r"--do_eval needs validation data: pass --validation_file or --dataset_name")


def test_dataset_without_the_split(fails, files):
    args = ["--model_type", "t5", "--config_overrides", TINY_T5, "--tokenizer_name", TOKENIZER,
            "--dataset_name", files["train_only"], "--do_predict"]
    fails(args, r"--do_predict needs a 'test' split, but dataset .*train_only' has only train: drop --do_predict")


def test_all_examples_empty(fails, files):
    fails(scratch(files, train=files["all_empty"]), r"the train data has no usable examples \(all documents or "
                                                     r"summaries are empty\)")


def test_fewer_examples_than_one_global_batch(fails, files):
    fails(scratch(files, "--max_train_samples", 5),
          r"5 training examples are fewer than one global batch of 8 .*lower the batch size or add data")


# ---------------------------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag", ["--model_name_or_path", "--tokenizer_name", "--dataset_name"])
def test_local_path_not_found(fails, files, flag):
    fails([*scratch(files), flag, "./models/no-such"], rf"{flag} ./models/no-such not found: check the path")


def test_unknown_model_type_lists_valid_ones(fails, files):
    fails(["--model_type", "t6", *scratch(files)[2:]], r"unknown --model_type 't6': use one of .*\bbart\b.*\bt5\b")


def test_model_type_the_script_cannot_train(fails, files):
    fails(["--model_type", "bert", *scratch(files)[4:]],
          r"model type 'bert' cannot be trained by this script \(seq2seq\): use one of")


# ---------------------------------------------------------------------------------------------
# Output directory and hub settings
# ---------------------------------------------------------------------------------------------
def test_output_dir_is_a_file(fails, files, tmp_path):
    path = tmp_path / "taken"
    path.write_text("keep me")
    fails(scratch(files), r"--output_dir .*taken is a file, not a directory", out=path)
    assert path.read_text() == "keep me"


def test_output_dir_not_writable(fails, files, tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access  # root may write anywhere: report this one directory as read-only instead of chmod
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(locked) else access(p, mode))
    fails(scratch(files), r"--output_dir .*locked/run is not writable", out=locked / "run")
    assert os.listdir(locked) == []


def test_non_empty_output_dir(fails, files, tmp_path):
    out = tmp_path / "finished"
    (out / "checkpoints" / "4").mkdir(parents=True)
    (out / "eval_results.json").write_text("{}")
    fails(scratch(files), r"already exists and is not empty: use --resume_from_checkpoint latest to continue it, "
                          r"or --overwrite_output_dir", out=out)


def test_overwrite_refuses_to_empty_a_directory_with_other_files(fails, files, tmp_path):
    out = tmp_path / "project"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")
    (out / "train.py").write_text("print('my code')")
    fails(scratch(files, "--overwrite_output_dir"), r"a new run in .*project first removes the previous run's outputs, "
                                                    r"but the directory also holds files no run of this script "
                                                    r"writes \(train.py\)",
          out=out)


def test_resume_from_an_output_dir_killed_before_its_first_checkpoint(fails, files, tmp_path):
    out = tmp_path / "killed"
    (out / "checkpoints" / "4.orbax-checkpoint-tmp-1").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "split": "train", "time": 0, "loss": 5.0}\n')
    fails(scratch(files, "--resume_from_checkpoint", out),
          r"--resume_from_checkpoint .*killed: no complete checkpoint there; if it is the output directory of a run, "
          r"that run stopped before its first checkpoint: start it again without --resume_from_checkpoint \(add "
          r"--overwrite_output_dir\), or with --resume_from_checkpoint latest", out=out)


def test_push_to_hub_without_token(fails, files, monkeypatch):
    monkeypatch.setattr("utils.run.preflight.get_token", lambda: None)  # no saved login either
    fails(scratch(files, "--push_to_hub"), r"--push_to_hub needs --hub_token")


def test_busy_tpu_stops_the_run_before_anything_is_written(fails, files, monkeypatch, jax_platforms):
    """A Cloud TPU VM whose TPU another process holds: JAX opened the CPU (as it does here)."""
    monkeypatch.setattr("utils.layout.devices._on_cloud_tpu_vm", lambda: True)
    # no staging buffer size set in os.environ
    monkeypatch.setattr("utils.layout.devices._huge_pages_always", lambda: True)
    monkeypatch.setattr("jax.distributed.initialize", lambda **settings: None)  # one VM: nothing to join
    jax_platforms(None)
    fails(scratch(files), r"this is a Cloud TPU VM, but JAX opened the CPU instead of the TPU.*: another process "
                          r"probably holds the TPU; .* or set JAX_PLATFORMS=cpu to run on the CPU on purpose$")


# ---------------------------------------------------------------------------------------------
# No network: one short probe, then offline mode; seconds instead of ~24 s of retries
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("what, args, pattern", [
    ("model", ["--model_name_or_path", "t5-small", "--train_file", "{train}"],
     r"could not load tokenizer 't5-small': it is neither a local path nor in the local cache, and the hub at "
     r"http://127\.0\.0\.1:9 is unreachable \(.*\); pass a local path"),
    ("dataset", ["--model_type", "t5", "--tokenizer_name", TOKENIZER, "--dataset_name", "no-such/dataset"],
     r"could not load dataset 'no-such/dataset': it is not in the local cache and the hub at http://127\.0\.0\.1:9 "
     r"is unreachable"),
])
def test_hub_name_without_network_fails_fast(fails, files, hub_online, what, args, pattern):
    hub_online(UNREACHABLE)
    start = time.time()
    fails([a.format(train=files["train"]) for a in args] + ["--do_train"], pattern)
    assert time.time() - start < 10  # the libraries' own retries take ~24 s


def test_push_to_hub_without_network(fails, files, hub_online):
    hub_online(UNREACHABLE)
    fails(scratch(files, "--push_to_hub", "--hub_token", "hf_x"),
          r"--push_to_hub needs the hub, but the hub at http://127\.0\.0\.1:9 is unreachable")


class _FakeHub(http.server.BaseHTTPRequestHandler):
    """Answers the reachability probe, and rejects every token."""

    def do_HEAD(self):
        self.send_response(200)
        self.end_headers()

    def do_GET(self):
        body = json.dumps({"error": "Invalid credentials in Authorization header"}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_hub():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_push_to_hub_with_a_rejected_token(fails, files, hub_online, fake_hub):
    hub_online(fake_hub)
    fails(scratch(files, "--push_to_hub", "--hub_token", "hf_bad"),
          r"the hub at http://127\.0\.0\.1:\d+ does not accept the token for --push_to_hub: Invalid user token")
    assert hub_probe.offline_reason() is None and not constants.HF_HUB_OFFLINE  # a reachable hub stays online


# ---------------------------------------------------------------------------------------------
# The real script: exit codes, stderr, --debug
# ---------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_script_usage_error(files, tmp_path):
    out = tmp_path / "out"
    result = run_script("run_summarization_flax.py", scratch(files, "--validation_file", files["broken.jsonl"],
                                                             "--output_dir", out))
    check_failure(2, result.returncode, result.stderr, r"broken\.jsonl:2 is not valid JSON")
    assert result.stderr.strip().count("\n") == 0 and not out.exists()  # the one line is all there is


def test_long_inputs_clamped_and_empty_examples_dropped(tmp_path, capsys, monkeypatch):
    """Lengths beyond BART's 64 positions are clamped with a warning, and empty examples dropped with a
    count, all before the model is built; the 5 usable examples, fewer than one global batch of 8, are
    fine for evaluation (padded, see test_run_summarization)."""
    stop_at_model(monkeypatch, RunError("stopped where the model would be built"))
    bart = ("d_model=16,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,"
            "encoder_ffn_dim=32,decoder_ffn_dim=32,max_position_embeddings=64")
    valid = write_jsonl(tmp_path / "valid.jsonl", rows(5) + rows(2, document=""))
    assert run_in_process(summarization, [
        "--model_type", "bart", "--config_overrides", bart, "--tokenizer_name", LM_TOKENIZER, "--validation_file",
        valid, "--do_eval", "--max_source_length", 512, "--max_target_length", 100, "--output_dir", tmp_path / "out"],
        tmp_path) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "error: stopped where the model would be built"
    for name, value in (("max_source_length", 512), ("max_target_length", 100), ("val_max_target_length", 100)):
        assert f"--{name} {value} is more than the model's 64 positions: using 64" in err
    assert "validation: dropped 2 examples with an empty document or summary" in err


# ---------------------------------------------------------------------------------------------
# Language modeling scripts: the same checks
# ---------------------------------------------------------------------------------------------
LM_SCRIPTS = {
    "clm": (clm, ["--model_type", "gpt2", "--config_overrides", "n_embd=32,n_layer=1,n_head=2,n_positions=64",
                  "--block_size", 32], "block_size", 64),
    "mlm": (mlm, ["--model_type", "roberta", "--config_overrides", "hidden_size=32,num_hidden_layers=1,"
                  "num_attention_heads=2,intermediate_size=64,max_position_embeddings=34", "--max_seq_length", 32],
            "max_seq_length", 32),
}


@pytest.fixture(scope="module")
def lm_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    (d / "latin1.txt").write_bytes(b"one line\nna\xefve\n")
    (d / "broken.jsonl").write_text('{"text": "a b"}\n{"text": "a b"\n')
    (d / "titles.csv").write_text("text,title\nAnn met Bob.,Meeting\n")
    return {name: str(d / name) for name in ("latin1.txt", "broken.jsonl", "titles.csv")}


def lm_args(name, *args, train=LM_TRAIN):
    script, model, _, _ = LM_SCRIPTS[name]
    return script, [*model, "--tokenizer_name", LM_TOKENIZER, "--train_file", train, "--do_train",
                    "--per_device_train_batch_size", 1, *args]


@pytest.mark.parametrize("name", LM_SCRIPTS)
@pytest.mark.parametrize("file, args, pattern", [
    ("latin1.txt", [], r"latin1\.txt is not UTF-8 text: byte 0xef at offset 11 \(line 2\)"),
    ("broken.jsonl", [], r"broken\.jsonl:2 is not valid JSON"),
    ("titles.csv", ["--text_column", "body"], r"--text_column 'body' is not a column of the train data; its "
                                               r"columns: text, title"),
    (None, ["--learnin_rate", 1], r"unknown argument --learnin_rate; did you mean '--learning_rate'"),
    (None, ["--max_train_samples", 0], r"--max_train_samples must be a positive number"),
    (None, ["--do_predict"], r"--do_predict does not apply to language modeling"),
    (None, ["--max_train_samples", 3], r"3 training examples are fewer than one global batch of 8"),
    (None, ["--tokenizer_name", "./no/such/tokenizer"], r"--tokenizer_name ./no/such/tokenizer not found"),
    (None, ["--streaming"], r"--streaming needs --max_steps: a stream has no epochs to count"),
    (None, ["--streaming", "--max_steps", 5, "--max_train_samples", 10],
     r"--max_train_samples does not apply with --streaming: bound the run with --max_steps"),
    (None, ["--streaming", "--max_steps", 5, "--shuffle_buffer_size", -1], r"--shuffle_buffer_size must be 0 or more"),
    (None, ["--max_stream_passes", 1], r"--max_stream_passes applies with --streaming only"),
    (None, ["--streaming", "--max_steps", 5, "--max_stream_passes", 0],
     r"--max_stream_passes must be 1 or more, got 0"),
    ("titles.csv", ["--streaming", "--max_steps", 5],
     r"the training data gives 0 examples, fewer than one global batch of 8 \(per_device_train_batch_size x devices"),
])
def test_lm_scripts(fails, lm_files, name, file, args, pattern):
    script, argv = lm_args(name, *args, train=lm_files[file] if file else LM_TRAIN)
    fails(argv, pattern, script=script)


@pytest.mark.parametrize("name, model_type, task", [("clm", "t5", "causal-lm"), ("mlm", "gpt2", "masked-lm")])
def test_lm_model_type_the_script_cannot_train(fails, name, model_type, task):
    script, argv = lm_args(name)
    fails(["--model_type", model_type, *argv[4:]], rf"model type '{model_type}' cannot be trained by this script "
                                                  rf"\({task}\)", script=script)


def test_mlm_masking_nothing_most_steps_is_refused(fails):
    """0.0001 of a batch of 8 x 32 tokens masks 0.026 on average: a logging window without a masked
    token had no loss to average (a ValueError after the output dir was replaced)."""
    script, argv = lm_args("mlm", "--mlm_probability", 0.0001)
    fails(argv, r"--mlm_probability 0.0001 masks 0.026 tokens of a training batch of 8 x 32 tokens on average, less "
                r"than one", script=script)


@pytest.mark.parametrize("name", LM_SCRIPTS)
def test_lm_hub_model_without_network(fails, hub_online, name):
    hub_online(UNREACHABLE)
    script, argv = lm_args(name)
    fails(["--model_name_or_path", "gpt2", *argv[4:]], r"could not load model config 'gpt2': .* the hub at "
                                                       r"http://127\.0\.0\.1:9 is unreachable", script=script)


@pytest.mark.parametrize("name", LM_SCRIPTS)
def test_lm_length_clamped_before_the_model(tmp_path, capsys, monkeypatch, name):
    stop_at_model(monkeypatch, RunError("stopped where the model would be built"))
    script, argv = lm_args(name, "--max_train_samples", 64)
    _, _, flag, limit = LM_SCRIPTS[name]
    argv[argv.index(f"--{flag}") + 1] = 512
    assert run_in_process(script, [*argv, "--output_dir", tmp_path / "out"], tmp_path) == 1
    err = capsys.readouterr().err
    assert f"--{flag} 512 is more than the model's {limit} positions: using {limit}" in err
    assert err.strip().splitlines()[-1] == "error: stopped where the model would be built"


# ---------------------------------------------------------------------------------------------
# T5 span corruption: impossible lengths, densities, span lengths and tokenizers, before any work
# ---------------------------------------------------------------------------------------------
def t5_args(*args, train=LM_TRAIN):
    return ["--model_type", "t5", "--config_overrides", TINY_T5, "--tokenizer_name", T5_TOKENIZER, "--train_file",
            train, "--do_train", "--per_device_train_batch_size", 1, "--max_seq_length", 32, *args]


@pytest.mark.parametrize("args, pattern", [
    (["--mlm_probability", 0], r"--mlm_probability \(the noise density\) must be between 0 and 1 \(exclusive\), got 0"),
    (["--mlm_probability", 1], r"--mlm_probability \(the noise density\) must be between 0 and 1 \(exclusive\), got 1"),
    (["--mlm_probability", 1.5], r"--mlm_probability \(the noise density\) must be between 0 and 1"),
    (["--mean_noise_span_length", 0],
     r"--mean_noise_span_length must be at least 1 and finite \(a span holds one token or more\)"),
    (["--mean_noise_span_length", -3], r"--mean_noise_span_length must be at least 1"),
    (["--max_seq_length", 0], r"--max_seq_length must be positive, got 0"),
    # 80% noise in spans of 1: every kept token is its own span, so the inputs are always odd.
    (["--max_seq_length", 512, "--mlm_probability", 0.8, "--mean_noise_span_length", 1],
     r"no raw length gives exactly 512 input tokens with --mlm_probability 0.8 and --mean_noise_span_length 1.0: "
     r"use --max_seq_length 511 or 513"),
    (["--tokenizer_name", LM_TOKENIZER], r"the tokenizer has no sentinel tokens \(<extra_id_0>, <extra_id_1>, "
                                         r"\.\.\.\), which span corruption needs: .*train_tokenizer.py --extra_ids 100"),
    (["--max_seq_length", 511, "--mlm_probability", 0.5, "--mean_noise_span_length", 1],
     r"span corruption needs 255 sentinel tokens per example but the tokenizer has only 100"),
    (["--model_type", "bart", "--config_overrides", "d_model=32"], r"model type 'bart' cannot be trained by this script: use one of t5, mt5, longt5$"),
    # UMT5 has no Flax class in transformers 4.x.
    (["--model_type", "umt5"], r"model type 'umt5' cannot be trained by this script: use one of t5, mt5, longt5$"),
    (["--max_train_samples", 3], r"3 training examples are fewer than one global batch of 8"),
    (["--do_predict"], r"--do_predict does not apply to language modeling"),
    (["--streaming"], r"--streaming needs --max_steps"),
])
def test_t5_mlm_bad_inputs(fails, args, pattern):
    fails(t5_args(*args), pattern, script=t5_mlm)


def test_t5_mlm_text_shorter_than_one_raw_block(fails, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("The cat sleeps.\n" * 4, encoding="utf-8")  # 3 lines to train on: 15 tokens
    fails(t5_args(train=short), r"the train data has fewer than 34 tokens, the raw block that --max_seq_length 32 "
                                r"needs: lower --max_seq_length or add text", script=t5_mlm)


def bart_args(*args, train=LM_TRAIN):
    return ["--model_type", "bart", "--config_overrides", "d_model=32,encoder_layers=1,decoder_layers=1",
            "--tokenizer_name", LM_TOKENIZER, "--train_file", train, "--do_train", "--per_device_train_batch_size", 1,
            "--max_seq_length", 32, *args]


@pytest.mark.parametrize("args, pattern", [
    (["--mlm_probability", 1], r"--mlm_probability must be at least 0 and below 1, got 1"),
    (["--permute_sentence_ratio", 1.5], r"--permute_sentence_ratio must be between 0 and 1, got 1.5"),
    (["--poisson_lambda", 0], r"--poisson_lambda \(the mean span length\) must be positive and finite, got 0"),
    (["--random_token_ratio", -0.1], r"--random_token_ratio must be between 0 and 1, got -0.1"),
    (["--sentence_separator", "<sep-not-there>"], r"--sentence_separator '<sep-not-there>' is not a token of the "
                                                  r"tokenizer"),
    (["--tokenizer_name", T5_TOKENIZER], r"the tokenizer has no mask token, which BART denoising needs"),
    (["--model_type", "t5", "--config_overrides", TINY_T5], r"model type 't5' cannot be trained by this script: "
                                                            r"use one of bart, mbart$"),
    (["--do_predict"], r"--do_predict does not apply to language modeling"),
])
def test_bart_dlm_bad_inputs(fails, args, pattern):
    fails(bart_args(*args), pattern, script=bart_dlm)


def test_bart_dlm_text_shorter_than_one_example(fails, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("The cat sleeps.\n" * 4, encoding="utf-8")
    fails(bart_args(train=short), r"the train data has fewer than 30 tokens, the text of one example of "
                                  r"--max_seq_length 32: lower --max_seq_length or add text", script=bart_dlm)


# ---------------------------------------------------------------------------------------------
# Disk full while saving (a real full disk: a small tmpfs, where this machine lets us mount one)
# ---------------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1100k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root); the tests below simulate a full disk")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


@pytest.mark.slow
def test_disk_full_while_saving_keeps_the_previous_checkpoint(small_disk):
    """A checkpoint of the tiny T5 takes ~600 kB: the one of step 4 fits, the one of step 8 does not.

    Which write meets the full disk first, the checkpoint of step 8 (written in the background) or the
    export beside it, is a race: either way the error must name a checkpoint that is intact.
    """
    out = small_disk / "run"
    result = run_script("run_summarization_flax.py", scratch(
        {"train": os.path.join(DATA, "train.jsonl")}, "--max_train_samples", 64, "--max_source_length", 32,
        "--max_target_length", 8, "--max_steps", 8, "--save_steps", 4, "--logging_steps", 4,
        "--output_dir", out, "--compilation_cache_dir", "none"), env=script_env())
    check_failure(1, result.returncode, result.stderr,
                  r"no space left on device while saving to .*run: free some space or choose another --output_dir; "
                  r"the checkpoint of step (4|8) is intact \(resume with --resume_from_checkpoint latest\)")
    intact = re.search(r"the checkpoint of step (\d+) is intact", result.stderr).group(1)
    assert intact in os.listdir(out / "checkpoints")
    assert (out / "flax_model.msgpack").stat().st_size > 100_000  # the export of step 4, whole


DISK_FULL = ValueError("RESOURCE_EXHAUSTED: Error writing \"params\": No space left on device [os_error_code='28']")


class FakeModel:
    """What the export asks of a Flax model (`utils.models.flax_msgpack.save_pretrained`)."""

    config = PretrainedConfig()
    _auto_class = None

    def can_generate(self):
        return False


@pytest.fixture
def saver(tmp_path, monkeypatch):
    from test_checkpoint import DP, fresh_state
    from utils.checkpoints import saving
    from utils.run import run_directory

    for module in (run_directory, saving):  # run_main's list, which nothing here drains
        monkeypatch.setattr(module, "at_exit", lambda callback: None)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), do_train=True)
    run_dir = RunDirectory(args, (args,), TASK, FakeModel(), None, is_main=True, total_steps=10)
    saver = Saver(args.output_dir, args.save_total_limit, run_dir, DP, InMemoryData({}, 640), {}, steps_per_epoch=10,
                  total_steps=10, start_step=0, is_main=True)
    state = fresh_state()
    saver.save(1, state, "save_steps")
    saver.checkpointer.wait()
    yield saver, state, DP.checkpoint_target(fresh_state())
    saver.close()


def test_a_failed_run_names_the_checkpoints_it_keeps(saver, tmp_path):
    saver, state, _ = saver
    directory = saver.checkpointer.directory
    assert saver.kept() == (f"the checkpoint of step 1 is kept in {directory}: resume from step 1 with "
                            "--resume_from_checkpoint latest")
    saver.save(2, state, "save_steps")  # still being written: `kept` waits for it
    assert saver.kept().startswith(f"the checkpoint of steps 1, 2 are kept in {directory}: resume from step 2")
    with pytest.raises(RunError, match=r"the parameters became non-finite in step 3 .*; the checkpoint of steps 1, 2 "
                                       r"are kept"):
        saver.save(3, state.replace(params=jax.tree.map(lambda x: x * np.nan, state.params)), "save_steps")


def test_a_run_failing_before_its_first_checkpoint_says_there_is_none(tmp_path, monkeypatch):
    from test_checkpoint import DP
    from utils.checkpoints import saving

    monkeypatch.setattr(saving, "at_exit", lambda callback: None)
    saver = Saver(str(tmp_path / "out"), 2, None, DP, InMemoryData({}, 640), {}, steps_per_epoch=10, total_steps=10,
                  start_step=0, is_main=True)
    try:
        assert saver.kept().startswith("no checkpoint was saved before that step: start again")
    finally:
        saver.close()


def test_disk_full_simulated_checkpoint(saver, monkeypatch):
    saver, state, template = saver

    def full(*args, **kwargs):
        raise DISK_FULL

    monkeypatch.setattr(saver.checkpointer._manager, "save", full)
    with pytest.raises(RunError, match=r"no space left on device while saving to .*out: free some space or choose "
                                       r"another --output_dir; the checkpoint of step 1 is intact"):
        saver.save(2, state, "save_steps")
    assert Checkpointer(saver.checkpointer.directory, read_only=True).restore(None, template)[1]["step"] == 1


def test_disk_full_simulated_export_keeps_the_previous_one(saver, monkeypatch):
    saver, state, _ = saver
    out = saver.output_dir
    before = open(os.path.join(out, "flax_model.msgpack"), "rb").read()

    def full_half_way(f, tree):
        f.write(b"new" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(flax_msgpack, "write", full_half_way)
    with pytest.raises(RunError, match=r"no space left on device while saving .* is intact"):
        saver.save(2, state, "save_steps")
    assert open(os.path.join(out, "flax_model.msgpack"), "rb").read() == before
    assert not [name for name in os.listdir(out) if name.startswith(".export-")]


# ---------------------------------------------------------------------------------------------
# run_flax_glue.py
# ---------------------------------------------------------------------------------------------
GLUE_TOKENIZER = os.path.join(ROOT, "data", "glue", "tokenizer")
SST2 = os.path.join(ROOT, "data", "glue", "sst2")
TINY_BERT = "hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32"


def glue_scratch(*args, train=os.path.join(SST2, "train.csv")):
    return ["--model_type", "bert", "--config_overrides", TINY_BERT, "--tokenizer_name", GLUE_TOKENIZER,
            "--train_file", train, "--do_train", "--max_seq_length", 16, *args]


@pytest.mark.parametrize("args, pattern", [
    (["--task_name", "mnli_matched"], r"unknown --task_name 'mnli_matched'; expected one of cola, sst2, mrpc"),
    (["--label_column_name", "score"], r"--label_column_name 'score' is not a column of the train data; its columns: "
                                       r"sentence, label"),
    (["--text_column_name", "text"], r"--text_column_name 'text' is not a column of the train data"),
    (["--task_name", "mrpc"], r"--text_column_name 'sentence1' is not a column of the train data"),
    (["--do_eval", "--validation_file", os.path.join(SST2, "test.csv")],
     r"--label_column_name 'label' is not a column of the validation data; its columns: sentence"),
])
def test_glue_bad_inputs(fails, args, pattern):
    fails(glue_scratch(*args), pattern, script=glue)


def test_glue_labels_not_in_the_checkpoints_label_map(fails, tmp_path):
    """A checkpoint fine-tuned on other labels: its head's classes cannot be the data's."""
    from transformers import AutoTokenizer, BertConfig

    checkpoint = tmp_path / "sentiment"
    BertConfig(vocab_size=800, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
               id2label={0: "negative", 1: "positive"}).save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(GLUE_TOKENIZER).save_pretrained(checkpoint)
    fails(["--model_name_or_path", checkpoint, "--train_file", os.path.join(SST2, "train.csv"), "--do_train"],
          r"labels not in the checkpoint's label map: '0', '1' \(the checkpoint knows 'negative', 'positive'\)",
          script=glue)


def test_glue_task_without_local_files_needs_the_hub(fails):
    fails(["--model_type", "bert", "--config_overrides", TINY_BERT, "--tokenizer_name", GLUE_TOKENIZER,
           "--task_name", "sst2", "--do_train"], r"could not load dataset .nyu-mll/glue.: it is not in the local cache",
          script=glue)


# ---------------------------------------------------------------------------------------------
# run_image_classification.py
# ---------------------------------------------------------------------------------------------
TINY_VIT = "image_size=16,patch_size=4,hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32"


@pytest.fixture(scope="module")
def image_folders(tmp_path_factory):
    """ImageFolders by name: good, and each of the layouts a user gets wrong."""
    import numpy as np
    from PIL import Image

    root = tmp_path_factory.mktemp("images")

    def folder(name, classes, bad=None):
        for cls, count in classes.items():
            (root / name / cls).mkdir(parents=True)
            for i in range(count):
                Image.fromarray(np.full((8, 8), 12 * i, np.uint8)).save(root / name / cls / f"{i}.png")
        if bad:
            (root / name / bad).write_bytes(b"\x89PNG\r\n\x1a\n not really")
        return str(root / name)

    paths = {"good": folder("good", {"cat": 10, "dog": 10}), "empty class": folder("empty", {"cat": 3, "dog": 0}),
             "one class": folder("one", {"cat": 20}), "corrupt": folder("corrupt", {"cat": 10, "dog": 9}, "dog/9.png"),
             "other classes": folder("other", {"cat": 2, "bird": 2})}
    (root / "loose").mkdir()
    for i in range(3):
        Image.fromarray(np.zeros((8, 8), np.uint8)).save(root / "loose" / f"{i}.png")
    paths["loose"] = str(root / "loose")
    return paths


@pytest.fixture
def image_fails(fails, monkeypatch):
    import run_image_classification as image

    monkeypatch.setattr(image, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model built")))
    return lambda argv, pattern, code=2: fails(argv, pattern, code, script=image)


def image_scratch(train, *args):
    return ["--model_type", "vit", "--config_overrides", TINY_VIT, "--train_dir", train, "--do_train",
            "--per_device_train_batch_size", 1, *args]


@pytest.mark.parametrize("case, args, pattern", [
    ("empty class", [], r"class folder .*/empty/dog holds no images \(looked for .png, .jpg.*\): add its images or "
                        r"remove the folder"),
    ("one class", [], r"the train data has one class only \('cat'\): classification needs two or more"),
    ("corrupt", [], r"image .*/corrupt/dog/9.png cannot be read \(UnidentifiedImageError: .*\): replace or remove it"),
    ("loose", [], r"--train_dir .*/loose holds 3 images but no class folders: put each class's images in a folder "
                  r"named for the class \(root/<class>/<image>\)"),
    ("good", ["--image_size", 15], r"--image_size 15 is not a multiple of the model's patch_size 4: use 12 or 16"),
    ("good", ["--do_eval"], r"--do_eval needs validation images: pass --validation_dir \(root/<class>/<image>\), "
                            r"--validation_file or --dataset_name"),
    ("good", ["--train_file", "x.csv"], r"--train_dir and --train_file both give train images: pass one"),
    ("good", ["--min_crop_scale", 0], r"--min_crop_scale must be in \(0, 1\], got 0"),
])
def test_image_bad_inputs(image_fails, image_folders, case, args, pattern):
    image_fails(image_scratch(image_folders[case], *args), pattern)


def test_image_validation_classes_unknown_to_training(image_fails, image_folders):
    image_fails(image_scratch(image_folders["good"], "--do_eval", "--validation_dir", image_folders["other classes"]),
                r"the validation images have classes the model does not know: 'bird' \(its classes: 'cat', 'dog'\)")


def test_image_eval_only_needs_named_labels(image_fails, image_folders, tmp_path):
    from transformers import ViTConfig

    ViTConfig(image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
              intermediate_size=32).save_pretrained(tmp_path / "vit")
    image_fails(["--model_name_or_path", tmp_path / "vit", "--validation_dir", image_folders["good"], "--do_eval"],
                r"evaluation or prediction alone needs the label names")


# run_qa.py
# ---------------------------------------------------------------------------------------------
QA_TOKENIZER = os.path.join(ROOT, "data", "qa", "tokenizer")
QA_CONTEXT = "Ann Lopez moved to Lyon in 1998 . On Monday , Bob Smith bought a piano ."


def qa_row(i, text="Lyon", start=19, question="Where did Ann Lopez move to?"):
    return {"id": f"q{i}", "question": question, "context": QA_CONTEXT,
            "answers": {"text": [text] if text else [], "answer_start": [start] if text else []}}


def qa_scratch(train, *args):
    return ["--model_type", "bert", "--config_overrides", TINY_BERT + ",max_position_embeddings=64",
            "--tokenizer_name", QA_TOKENIZER, "--train_file", train, "--do_train", "--max_seq_length", 32,
            "--doc_stride", 8, *args]


@pytest.mark.parametrize("rows, args, pattern", [
    ([qa_row(0), qa_row(1, start=400)], [],
     r"row 1 of the train data: answer_start 400 is outside its context of 72 characters"),
    ([qa_row(0), qa_row(1, text="Paris")], [],
     r"row 1 of the train data: the answer 'Paris' is not at answer_start 19 of the context \(which reads 'Lyon ' "
     r"there\): fix the offset or the text"),
    ([qa_row(0)], ["--doc_stride", 32], r"--doc_stride 32 must be at least 0 and less than --max_seq_length 32"),
    ([qa_row(0), qa_row(1, question="Where did Ann Lopez , who was born on a Monday in 1950 , move to in 1998 ?")],
     [], r"row 1 of the train data: its question takes \d+ tokens, leaving \d+ of --max_seq_length 32 for the "
         r"context, not more than --doc_stride 8: raise --max_seq_length to \d+ or more, or lower --doc_stride"),
    ([qa_row(0)], ["--question_column_name", "query"], r"--question_column_name 'query' is not a column of the train "
                                                        r"data; its columns: id, question, context, answers"),
])
def test_qa_bad_inputs(fails, tmp_path, rows, args, pattern):
    fails(qa_scratch(write_jsonl(tmp_path / "train.jsonl", rows), *args), pattern, script=run_qa)


LONG_QUESTION = ("Where did Ann Lopez , who was born on a Monday in 1950 and bought a piano on a Monday in 1990 , "
                 "move to in 1998 ?")


def test_qa_long_questions_cut_counted_and_reported(tmp_path, capsys, monkeypatch):
    """One long question in a run (as in the SQuAD questions that quote a table) does not stop it: cut to
    --max_question_length tokens, the windows keep room for the context; a warning counts them and
    names the first. The run goes on to build its model."""
    stop_at_model(monkeypatch, RunError("stopped where the model would be built"))
    rows = [qa_row(0), qa_row(1, question=LONG_QUESTION), qa_row(2), qa_row(3, question=LONG_QUESTION + " Why ?")]
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    argv = qa_scratch(train, "--max_question_length", 12, "--per_device_train_batch_size", 1, "--output_dir",
                      tmp_path / "out")
    assert run_in_process(run_qa, argv, tmp_path) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "error: stopped where the model would be built"
    assert "train: 2 questions longer than --max_question_length 12 tokens cut to it (the first: row 1)" in err


def test_qa_cut_questions_keep_their_first_tokens():
    """A cut question is the original's first `max_tokens` tokens: its text a prefix of the question,
    tokenized to exactly those tokens (the tokenizer's own tokens are the reference)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(QA_TOKENIZER)
    questions = [LONG_QUESTION, "Where did Ann go?", "Who?"]
    cut, lengths, was_cut = run_qa.qa.cut_questions(questions, tokenizer, 5)
    tokens = [tokenizer.tokenize(question) for question in questions]
    assert was_cut == [len(t) > 5 for t in tokens] == [True, True, False]
    for question, short, length, original in zip(questions, cut, lengths, tokens):
        assert question.startswith(short) and tokenizer.tokenize(short) == original[:5] and length == min(len(original), 5)


def test_qa_question_too_long_even_when_cut(fails, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [qa_row(0, question=LONG_QUESTION)])
    fails(qa_scratch(train, "--max_question_length", 30), r"row 0 of the train data: its question takes 30 tokens, "
                                                           r"leaving \d+ of --max_seq_length 32 for the context, not "
                                                           r"more than --doc_stride 8: .* or lower --doc_stride or "
                                                           r"--max_question_length", script=run_qa)


def test_qa_v1_evaluation_needs_answers(fails, tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [qa_row(0)])
    valid = write_jsonl(tmp_path / "valid.jsonl", [qa_row(0), qa_row(1, text=None)])
    fails(qa_scratch(train, "--do_eval", "--validation_file", valid),
          r"row 1 of the validation data has no answer \(1 rows in all\): pass --version_2_with_negative",
          script=run_qa)


def test_qa_needs_a_fast_tokenizer(fails, tmp_path):
    from transformers import AutoTokenizer, BertTokenizer

    vocab = tmp_path / "vocab.txt"
    fast = AutoTokenizer.from_pretrained(QA_TOKENIZER)
    vocab.write_text("".join(token + "\n" for token, _ in sorted(fast.get_vocab().items(), key=lambda kv: kv[1])))
    BertTokenizer(str(vocab)).save_pretrained(tmp_path / "slow")
    train = write_jsonl(tmp_path / "train.jsonl", [qa_row(0)])
    args = qa_scratch(train, "--use_fast_tokenizer", "false")
    args[args.index(QA_TOKENIZER)] = str(tmp_path / "slow")
    fails(args, r"BertTokenizer is not a fast tokenizer: question answering maps tokens back to the context by "
                r"character offsets", script=run_qa)
