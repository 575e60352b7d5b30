"""utils/run/run_directory.py: what a run writes into its output directory, what an overwriting run removes, the
export."""

import json
import os
from functools import partial

import jax
import numpy as np
import pytest

from test_checkpoint import assert_bitwise_equal
from tasks.summarization import TASK
from utils.base.arguments import TrainingArguments
from utils.checkpoints.resume import ResumePoint
from utils.run.run_directory import RunDirectory, export_pretrained, foreign_files, write_results


@pytest.fixture(autouse=True)
def no_exit_callbacks(monkeypatch):
    from utils.run import run_directory

    monkeypatch.setattr(run_directory, "at_exit", lambda callback: None)  # run_main's list, which nothing here drains


def open_run(out, is_main=True, resume=None, **training):
    args = TrainingArguments(output_dir=str(out), **training)
    return RunDirectory(args, (args,), TASK, model=None, tokenizer=None, is_main=is_main, total_steps=10, resume=resume)


def previous_run(out):
    """What an earlier training run leaves behind."""
    os.makedirs(out / "checkpoints" / "8")
    os.makedirs(out / ".export-abc")
    for name in ("metrics.jsonl", "run_args.json", "eval_results.json", "test_results.json", "all_results.json",
                 "generated_predictions.txt", "events.out.tfevents.1.old", "config.json", "generation_config.json",
                 "flax_model.msgpack", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "spiece.model", "vocab.json", "merges.txt"):
        (out / name).write_text('{"step": 1, "split": "train", "time": 0, "loss": 1.0}\n')


def test_foreign_files(tmp_path):
    previous_run(tmp_path)
    assert foreign_files(tmp_path, TASK.outputs) == []
    assert foreign_files(tmp_path) == ["generated_predictions.txt"]  # a summarization file: the task declares it
    for name in ("train.py", "data.jsonl", "notes.txt"):
        (tmp_path / name).write_text("mine")
    (tmp_path / "src").mkdir()
    assert foreign_files(tmp_path, TASK.outputs) == ["data.jsonl", "notes.txt", "src", "train.py"]


def test_a_run_writes_only_the_files_its_task_declares(tmp_path):
    """A file the task does not declare would be foreign to its next run: writing it is refused."""
    run = open_run(tmp_path / "out")
    with pytest.raises(ValueError, match="predictions.txt is not among the files task 'summarization' declares"):
        run.write_text("predictions.txt", ["x"])
    with pytest.raises(ValueError, match="eval_predictions.json"):
        run.write_json("eval_predictions.json", {})
    assert not (tmp_path / "out" / "predictions.txt").exists()


def test_a_fresh_training_run_starts_from_an_empty_directory(tmp_path):
    previous_run(tmp_path)
    run = open_run(tmp_path, do_train=True, overwrite_output_dir=True)
    run.close()
    names = sorted(os.listdir(tmp_path))
    assert [n for n in names if not n.startswith("events.out.tfevents")] == ["metrics.jsonl", "run_args.json"]
    assert "events.out.tfevents.1.old" not in names and (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_resumed_run_keeps_its_files_and_rewinds_the_metrics(tmp_path):
    previous_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "split": "train", "time": 0, "loss": 1.0})
                                                    + "\n" for s in range(1, 13)))
    run = open_run(tmp_path, do_train=True, resume=ResumePoint(str(tmp_path / "checkpoints"), 8),
                   resume_from_checkpoint="latest")
    run.close()
    assert (tmp_path / "checkpoints" / "8").is_dir() and (tmp_path / "eval_results.json").exists()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))


def test_evaluation_removes_nothing(tmp_path):
    previous_run(tmp_path)
    before = sorted(os.listdir(tmp_path))
    open_run(tmp_path, do_eval=True, overwrite_output_dir=True).close()
    assert set(before) <= set(os.listdir(tmp_path))


def test_results_and_texts(tmp_path):
    run = open_run(tmp_path / "out", do_train=True, do_predict=True)
    assert run.report("test", {"loss": 1.23456, "rouge1": np.float32(40.0)}, step=3) == {
        "test_loss": 1.2346, "test_rouge1": 40.0}
    run.add_results(train_runtime=12.5, train_samples=160)
    run.write_text("generated_predictions.txt", ["a  summary\nover lines", "two"])
    run.finish()
    out = tmp_path / "out"
    assert json.loads((out / "all_results.json").read_text()) == {
        "test_loss": 1.2346, "test_rouge1": 40.0, "train_runtime": 12.5, "train_samples": 160}
    assert (out / "generated_predictions.txt").read_text() == "a summary over lines\ntwo\n"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    # metrics.jsonl keeps the value unrounded: approx's default rel=1e-6 only absorbs its float parsing.
    assert [(row["step"], row["split"], row["loss"]) for row in rows] == [(3, "test", pytest.approx(1.23456))]
    assert not (out / "checkpoints").exists()  # checkpoints belong to training (utils/checkpoints/saving.py)


def test_other_processes_write_nothing(tmp_path):
    run = open_run(tmp_path / "out", is_main=False, do_train=True)
    run.report("eval", {"loss": 1.0}, step=1)
    run.write_text("generated_predictions.txt", ["x"])
    run.finish()
    assert os.listdir(tmp_path / "out") == []


def test_write_results(tmp_path):
    results = write_results(str(tmp_path), "eval", {"loss": 1.234567, "rouge1": np.float32(41.23456)}, True)
    assert results == {"eval_loss": 1.2346, "eval_rouge1": 41.2346}
    assert json.loads((tmp_path / "eval_results.json").read_text()) == results
    assert write_results(str(tmp_path), "test", {"loss": 2.0}, False) == {"test_loss": 2.0}
    assert not (tmp_path / "test_results.json").exists()  # only the main process writes


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def test_export_pretrained_round_trip(tmp_path):
    from transformers import FlaxT5ForConditionalGeneration, PreTrainedTokenizerFast, T5Config

    from utils.models import compat

    compat.apply()
    config = T5Config(
        vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2
    )
    model = FlaxT5ForConditionalGeneration(config, seed=0)
    on_host = jax.device_get(model.params)  # as the layouts hand them over (`Layout.params_to_host`)

    export_pretrained(model, on_host, tiny_tokenizer(), str(tmp_path))
    loaded = FlaxT5ForConditionalGeneration.from_pretrained(str(tmp_path))
    assert_bitwise_equal(loaded.params, jax.device_get(model.params))
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tmp_path))
    assert tokenizer("hello world").input_ids == [3, 4]

    skipped = tmp_path / "not_main"
    export_pretrained(model, on_host, None, str(skipped), is_main_process=False)
    assert not skipped.exists()


def export_tokenizer_only(tokenizer, output_dir, monkeypatch):
    """`export_pretrained` of `tokenizer` (or a processor) alone: the model's files are left out."""
    from utils.models import flax_msgpack

    monkeypatch.setattr(flax_msgpack, "save_pretrained", lambda model, directory, params: None)
    output_dir.mkdir()
    export_pretrained(None, {}, tokenizer, str(output_dir))


def assert_tokenizer_json_pads_and_truncates_nothing(output_dir):
    """tokenizer.json in `output_dir`, read as a serving engine reads it, encodes a long text whole."""
    from tokenizers import Tokenizer

    saved = Tokenizer.from_file(str(output_dir / "tokenizer.json"))
    assert saved.padding is None and saved.truncation is None
    assert len(saved.encode(" ".join(["hello world"] * 10)).ids) >= 20


def test_an_exported_tokenizer_json_keeps_no_padding_or_truncation_of_the_last_call(tmp_path, monkeypatch):
    """A map tokenized in the process leaves its padding and truncation on the Rust backend: they stay out
    of tokenizer.json, so the export is the one of a tokenizer never called (a map read from the datasets
    cache), and the run's later calls encode as before."""
    tokenizer = tiny_tokenizer()
    call = partial(tokenizer, padding="max_length", truncation=True, max_length=8)
    padded = call(["hello world " * 5, "hello"]).input_ids
    called, never_called = tmp_path / "called", tmp_path / "never_called"
    export_tokenizer_only(tokenizer, called, monkeypatch)
    export_tokenizer_only(tiny_tokenizer(), never_called, monkeypatch)
    assert_tokenizer_json_pads_and_truncates_nothing(called)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (called / name).read_text() == (never_called / name).read_text(), name
    assert call(["hello world " * 5, "hello"]).input_ids == padded == [[3, 4] * 4, [3] + [0] * 7]
    assert tokenizer("hello world " * 5).input_ids == [3, 4] * 5


def speech_processor(tokenizer):
    from transformers import WhisperFeatureExtractor

    from tasks.speech_recognition import Processor

    return Processor(WhisperFeatureExtractor(), tokenizer)


def captioning_saved_with_model(tokenizer):
    from transformers import ViTImageProcessor

    from tasks.image_captioning import SavedWithModel

    return SavedWithModel(tokenizer, ViTImageProcessor())


def clip_processor(tokenizer):
    from transformers import ViTImageProcessor

    from tasks.image_text import processor_of

    return processor_of(ViTImageProcessor(), tokenizer)


@pytest.mark.parametrize("wrap", [speech_processor, captioning_saved_with_model, clip_processor])
def test_a_processors_tokenizer_json_keeps_no_padding_or_truncation_of_the_last_call(tmp_path, monkeypatch, wrap):
    """What the scripts save with the model in place of a tokenizer: its tokenizer's settings are cleared too."""
    tokenizer = tiny_tokenizer()
    tokenizer("hello world", padding="max_length", truncation=True, max_length=8)
    export_tokenizer_only(wrap(tokenizer), tmp_path / "export", monkeypatch)
    assert_tokenizer_json_pads_and_truncates_nothing(tmp_path / "export")


def test_an_export_leaves_no_weight_file_of_an_earlier_export_beside_it(tmp_path, monkeypatch):
    """Shards over a single file, and a single file over shards: only the new export's weight files stay, so
    from_pretrained loads the new weights (it would take a lone flax_model.msgpack before an index)."""
    from transformers import FlaxT5ForConditionalGeneration, T5Config

    from utils.models import compat, flax_msgpack

    compat.apply()
    config = T5Config(vocab_size=32, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1, num_heads=2)
    earlier, later = (FlaxT5ForConditionalGeneration(config, seed=seed) for seed in (0, 1))
    save = flax_msgpack.save_pretrained

    def export(model, output_dir, max_shard_size):
        monkeypatch.setattr(flax_msgpack, "save_pretrained", partial(save, max_shard_size=max_shard_size))
        export_pretrained(model, jax.device_get(model.params), None, str(output_dir))

    for first, second in (("10GB", "4KB"), ("4KB", "10GB")):
        output_dir = tmp_path / f"{first}-then-{second}"
        output_dir.mkdir()
        export(earlier, output_dir, first)
        export(later, output_dir, second)
        weights = sorted(name for name in os.listdir(output_dir) if name.startswith("flax_model"))
        if second == "4KB":
            shards = [name for name in weights if name != "flax_model.msgpack.index.json"]
            assert "flax_model.msgpack.index.json" in weights and len(shards) > 1
            assert shards == [f"flax_model-{i:05d}-of-{len(shards):05d}.msgpack" for i in range(1, len(shards) + 1)]
        else:
            assert weights == ["flax_model.msgpack"]
        loaded = FlaxT5ForConditionalGeneration.from_pretrained(str(output_dir))
        assert_bitwise_equal(loaded.params, jax.device_get(later.params))
