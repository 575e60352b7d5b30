"""utils/run.py: the fingerprint a resumed run is checked against."""

from transformers import T5Config

from utils.args import TrainingArguments
from utils.run import fingerprint_difference, run_fingerprint


def fingerprint(train_examples=160, config=None, **training):
    args = TrainingArguments(output_dir="out", do_train=True, **{"per_device_train_batch_size": 2, **training})
    return run_fingerprint(config or T5Config(d_model=32, num_layers=1), args, train_examples)


def test_fingerprint_names_what_fixes_the_run():
    saved = fingerprint()
    assert saved["global batch size"] == 16 and saved["training examples"] == 160  # 2 x 8 devices
    assert saved["seed"] == 42 and saved["optimizer"] == "adamw"
    assert saved["model config"]["d_model"] == 32 and "transformers_version" not in saved["model config"]


def test_compatible_changes_are_no_difference():
    saved = fingerprint()
    assert fingerprint_difference(saved, fingerprint(num_train_epochs=9, max_steps=50, logging_steps=3, eval_steps=7,
                                                     save_steps=11, learning_rate=1e-3)) is None
    assert fingerprint_difference(saved, fingerprint(per_device_train_batch_size=1, gradient_accumulation_steps=2)) is None
    config = T5Config(d_model=32, num_layers=1, name_or_path="elsewhere")  # where a config came from is no matter
    assert fingerprint_difference(saved, fingerprint(config=config)) is None


def test_each_incompatible_change_is_named():
    saved = fingerprint()
    cases = [
        (fingerprint(per_device_train_batch_size=4),
         "global batch size is 16 in the checkpoint but 32 in this run (set by per_device_train_batch_size x devices"),
        (fingerprint(train_examples=150), "training examples is 160 in the checkpoint but 150 in this run"),
        (fingerprint(seed=1), "seed is 42 in the checkpoint but 1 in this run (set by --seed)"),
        (fingerprint(adafactor=True), "optimizer is 'adamw' in the checkpoint but 'adafactor' in this run"),
        (fingerprint(config=T5Config(d_model=64, num_layers=1)),
         "model config 'd_model' is 32 in the checkpoint but 64 in this run (set by the model config"),
    ]
    for current, message in cases:
        assert fingerprint_difference(saved, current).startswith(message)


def test_eval_only_runs_compare_the_model_config_only():
    args = TrainingArguments(output_dir="out", do_eval=True)
    current = run_fingerprint(T5Config(d_model=32, num_layers=1), args)
    assert set(current) == {"model config"}
    assert fingerprint_difference(fingerprint(), current) is None
