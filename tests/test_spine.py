"""What every script gets from the spine rather than remembering it: `--gradient_checkpointing` (applied by
`utils.training.make_steps`) and the files a rerun may replace (declared by each task, `tasks.Task.outputs`).
Each test runs every training script, so a script that bypasses the spine fails here by name."""

import importlib.util
import json
import os
import shutil

import pytest

from layout_runs import PREDICTIONS, SCRIPTS, command
from script_runner import read_json, read_metrics, run_script

SCRIPT_CONFIGS = {
    "summarization": ("run_summarization_flax.py", "configs/summarization_tiny.json"),
    "clm": ("run_clm_flax.py", "configs/clm_tiny.json"),
    "mlm": ("run_mlm_flax.py", "configs/mlm_tiny.json"),
    "t5 mlm": ("run_t5_mlm_flax.py", "configs/t5_mlm_tiny.json"),
    "glue": ("run_flax_glue.py", "configs/glue_tiny.json"),
    "ner": ("run_flax_ner.py", "configs/ner_tiny.json"),
    "image": ("run_image_classification.py", "configs/image_tiny.json"),
    "qa": ("run_qa.py", "configs/qa_tiny.json"),
    "bart dlm": ("run_bart_dlm_flax.py", "configs/bart_dlm_tiny.json"),
    # Global batch 128: their shipped data holds fewer than 512 examples.
    "long qa": ("run_qa.py", "configs/long_qa_tiny.json", 128),
    "speech": ("run_speech_recognition_seq2seq.py", "configs/speech_recognition_tiny.json", 128),
    "clip": ("run_hybrid_clip.py", "configs/hybrid_clip_tiny.json"),
    "captioning": ("run_image_captioning_flax.py", "configs/image_captioning_tiny.json"),
}


def train_step_temporaries(tmp_path, name, checkpointing):
    """The TPU compiler's temporaries of `name`'s train step (--compile_only v3-8): its tiny config at a
    global batch of 512 (or the one it names), where activations outweigh the tiny model's state."""
    script, config, batch = (*SCRIPT_CONFIGS[name], 512)[:3]
    out = tmp_path / f"plan_{checkpointing}"
    result = run_script(script, [config, "--output_dir", out, "--compile_only", "v3-8", "--total_train_batch_size", batch,
                                 "--do_eval", "false", "--do_predict", "false", "--gradient_checkpointing",
                                 str(checkpointing).lower(), "--compilation_cache_dir", "none"])
    assert result.returncode == 0, result.stderr[-3000:]
    return read_json(out / "all_results.json")["train_step_device_bytes_temporaries"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is not installed")
@pytest.mark.parametrize("name", SCRIPT_CONFIGS)
def test_gradient_checkpointing_shrinks_every_scripts_train_step(tmp_path, name):
    """On the TPU compiler's plan (the CPU compiler keeps about as many temporaries either way)."""
    plain, checkpointed = (train_step_temporaries(tmp_path, name, checkpointing) for checkpointing in (False, True))
    assert checkpointed < 0.9 * plain, (plain, checkpointed)


def files(output_dir):
    """The names in `output_dir`, TensorBoard's (named for the time they were made) as one."""
    return {"events.out.tfevents.*" if name.startswith("events.out.tfevents.") else name
            for name in os.listdir(output_dir)}


@pytest.mark.slow
@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_reruns_into_its_own_output_dir(layout_runs, tmp_path, name):
    """A second training run with --overwrite_output_dir replaces every file the first one wrote, its
    prediction files included: none of them counts as a file no run writes."""
    out = tmp_path / "out"
    shutil.copytree(layout_runs[(name, "dp")], out)
    first = files(out)
    script, *args = command(name, str(out), "--overwrite_output_dir", "--max_steps", 2, "--save_steps", 2)
    result = run_script(script, args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert files(out) == first  # the same files, each written anew
    assert [row["step"] for row in read_metrics(out)] == [1, 2]  # no step of the first run's 10 is left
    assert sorted(os.listdir(out / "checkpoints")) == ["2"]
    assert read_json(out / "eval_results.json") == {key: value for key, value in read_json(
        out / "all_results.json").items() if key.startswith("eval_")}
    if name in PREDICTIONS:
        assert os.path.getmtime(out / PREDICTIONS[name]) >= os.path.getmtime(out / "run_args.json")
    assert json.loads((out / "run_args.json").read_text())["max_steps"] == 2
