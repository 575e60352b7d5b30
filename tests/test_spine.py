"""What every script gets from the spine rather than remembering it: `--gradient_checkpointing` (applied by
`utils.run.spine.make_steps`) and the files a rerun may replace (declared by each task, `tasks.Task.outputs`).
Each test runs every training script, so a script that bypasses the spine fails here by name."""

import importlib.util
import json
import os
import shutil

import jax
import pytest

from layout_runs import PREDICTIONS, SCRIPTS, command
from script_runner import ROOT, read_json, read_metrics, run_script

# Each training script on its shipped tiny config, and the layers that config's model recomputes with
# --gradient_checkpointing: each of its transformer layers (wav2vec2 also its 4 feature-encoder convolutions).
SCRIPT_CONFIGS = {
    "summarization": ("run_summarization_flax.py", "configs/summarization_tiny.json", 2 + 2),
    "clm": ("run_clm_flax.py", "configs/clm_tiny.json", 2),
    "chat": ("run_clm_flax.py", "configs/chat_tiny.json", 2),
    "mlm": ("run_mlm_flax.py", "configs/mlm_tiny.json", 2),
    "t5 mlm": ("run_t5_mlm_flax.py", "configs/t5_mlm_tiny.json", 2 + 2),
    "glue": ("run_flax_glue.py", "configs/glue_tiny.json", 2),
    "ner": ("run_flax_ner.py", "configs/ner_tiny.json", 2),
    "image": ("run_image_classification.py", "configs/image_tiny.json", 2),
    "qa": ("run_qa.py", "configs/qa_tiny.json", 2),
    "bart dlm": ("run_bart_dlm_flax.py", "configs/bart_dlm_tiny.json", 2 + 2),
    "long qa": ("run_qa.py", "configs/long_qa_tiny.json", 2),
    "speech": ("run_speech_recognition_seq2seq.py", "configs/speech_recognition_tiny.json", 2 + 2),
    "wav2vec2": ("run_wav2vec2_pretrain_flax.py", "configs/wav2vec2_pretrain_tiny.json", 2 + 4),
    "clip": ("run_hybrid_clip.py", "configs/hybrid_clip_tiny.json", 2 + 2),
    "captioning": ("run_image_captioning_flax.py", "configs/image_captioning_tiny.json", 2 + 2),
}


class _Lowered(Exception):
    """The first step a run hands the compiler, as JAX lowered it (its StableHLO text)."""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) is not installed")
@pytest.mark.parametrize("name", SCRIPT_CONFIGS)
def test_gradient_checkpointing_recomputes_every_layer_of_every_scripts_train_step(monkeypatch, tmp_path, name):
    """The train step's program, as JAX lowers it, holds one optimization barrier per recomputed layer: the
    barrier keeps XLA from merging the backward pass's recomputation back into the forward's activations.
    Nothing else in a step makes one, so a script whose model never sees the flag (run_flax_glue.py once)
    holds none. The script's `main` runs here with --compile_only, which builds the model, layout and batch
    from shapes alone and hands the compiler the train step first, the only step a train-only plan has; a
    tripwire on `Lowered.compile` takes that program and stops the run, so the TPU compiler's own minutes
    are left out (its plans: tests/test_tpu_plan.py, whose clm and summarization runs plan through the same
    spine, `utils.run.spine.make_steps`). That the recomputation saves memory on the TPU's plan:
    tests/test_run_glue.py."""
    script, config, layers = SCRIPT_CONFIGS[name]

    def stop(lowered):
        raise _Lowered(lowered.as_text())

    monkeypatch.setattr(jax.stages.Lowered, "compile", stop)
    monkeypatch.chdir(ROOT)  # the configs name their data relative to the repository
    argv = [config, "--output_dir", str(tmp_path / "plan"), "--compile_only", "v3-8", "--total_train_batch_size",
            "16", "--do_eval", "false", "--do_predict", "false", "--gradient_checkpointing", "--compilation_cache_dir",
            "none"]
    with pytest.raises(_Lowered) as lowered:
        importlib.import_module(script.removesuffix(".py")).main(argv)
    assert lowered.value.args[0].count("stablehlo.optimization_barrier") == layers
    assert not os.path.exists(tmp_path / "plan" / "all_results.json")  # stopped before the plan


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
