#!/usr/bin/env python
"""Pretrain a Flax wav2vec2 on unlabelled speech (wav2vec 2.0's contrastive task), without torch.

    python run_wav2vec2_pretrain_flax.py configs/wav2vec2_pretrain_tiny.json
    python run_wav2vec2_pretrain_flax.py --config_name my_wav2vec2 --feature_extractor_name my_wav2vec2 \\
        --train_file clips/train.csv --validation_file clips/validation.csv --do_train --do_eval \\
        --max_duration_in_seconds 15 --output_dir runs/wav2vec2

Clips come as for `run_speech_recognition_seq2seq.py` (a csv / json lines file whose audio column holds
paths relative to it, or a hub dataset's audio column), no transcript needed: read by `tasks/audio.py`,
resampled to the feature extractor's rate, normalised by it and padded to one length in background
threads. Spans of frames are masked and the model learns to pick each masked frame's quantized
features among negatives drawn from the clip's other masked frames; its codebooks are kept in use by
the diversity loss. The task's knowledge (waveforms, masks and negatives, the Gumbel temperature, the
losses, the perplexity watch) lives in `tasks/wav2vec2_pretraining.py`. One train / eval loop, each
step defined once for both layouts (`--sharding dp`, the default, or `fsdp`); everything mechanical
lives in `utils/`. The export (`FlaxWav2Vec2ForPreTraining` and its feature extractor) is a
`--model_name_or_path` for later fine-tuning.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import math
import sys
from dataclasses import dataclass, field
from typing import Optional

from tasks import speech_recognition as speech
from tasks import wav2vec2_pretraining as w2v
from tasks.wav2vec2_pretraining import TASK
from utils.base.arguments import BaseDataArguments, ModelArguments, READS, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.models.loading import load_config, load_model
from utils.run.loop import host_means
from utils.run.preflight import check_before_work
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


@dataclass
class Wav2Vec2ModelArguments(ModelArguments):
    feature_extractor_name: Optional[str] = field(
        default=None, metadata={"help": "Feature extractor (name or path) if not the model's; a model trained from "
                                        "scratch needs one (a Wav2Vec2FeatureExtractor's preprocessor_config.json).",
                                READS: "its feature extractor"})
    mask_time_prob: Optional[float] = field(
        default=None, metadata={"help": "About this share of each clip's frames is masked (default: the config's)."})
    mask_time_length: Optional[int] = field(
        default=None, metadata={"help": "Frames of each masked span (default: the config's)."})
    num_negatives: Optional[int] = field(
        default=None, metadata={"help": "Negatives of each masked frame, drawn from the clip's other masked frames "
                                        "(default: the config's)."})
    diversity_loss_weight: Optional[float] = field(
        default=None, metadata={"help": "Weight of the diversity loss (default: the config's)."})
    max_gumbel_temperature: float = field(default=2.0, metadata={"help": "Gumbel softmax temperature at step 0."})
    min_gumbel_temperature: float = field(default=0.5, metadata={"help": "The temperature never falls below this."})
    gumbel_temperature_decay: float = field(
        default=0.999995, metadata={"help": "The temperature of step s: max(max * decay ** s, min)."})

    def __post_init__(self):
        super().__post_init__()
        if self.mask_time_prob is not None and not 0 < self.mask_time_prob <= 1:
            raise UsageError(f"--mask_time_prob must be in (0, 1], got {self.mask_time_prob}")
        for name in ("mask_time_length", "num_negatives"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UsageError(f"--{name} must be positive, got {value}")
        if self.diversity_loss_weight is not None and not 0 <= self.diversity_loss_weight < math.inf:
            raise UsageError(f"--diversity_loss_weight must be >= 0 and finite, got {self.diversity_loss_weight}")
        if not 0 < self.min_gumbel_temperature <= self.max_gumbel_temperature < math.inf:
            raise UsageError(f"the Gumbel temperatures must satisfy 0 < --min_gumbel_temperature "
                             f"({self.min_gumbel_temperature:g}) <= --max_gumbel_temperature "
                             f"({self.max_gumbel_temperature:g}), both finite")
        if not 0 < self.gumbel_temperature_decay <= 1:
            raise UsageError(f"--gumbel_temperature_decay must be in (0, 1], got {self.gumbel_temperature_decay}")


@dataclass
class Wav2Vec2DataArguments(BaseDataArguments):
    audio_column_name: str = field(
        default="audio", metadata={"help": "Column with the audio: paths relative to the data file, or a dataset's "
                                           "Audio feature (the classic script's --speech_file_column).",
                                   "aliases": ["--speech_file_column"]})
    max_duration_in_seconds: float = field(
        default=20.0, metadata={"help": "Skip clips longer than this (counted in the log); every clip is padded to "
                                        "it."})
    min_duration_in_seconds: float = field(
        default=0.0, metadata={"help": "Skip clips shorter than this (counted in the log)."})
    pad_to_multiple_of: Optional[int] = field(
        default=None, metadata={"help": "Round the padded length (--max_duration_in_seconds of samples) up to a "
                                        "multiple of this."})

    def __post_init__(self):
        super().__post_init__()
        speech.check_durations(self)
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise UsageError(f"--pad_to_multiple_of must be positive, got {self.pad_to_multiple_of}")

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (Wav2Vec2ModelArguments, Wav2Vec2DataArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = check_before_work(TASK, model_args, data_args, training_args)
    logger, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Feature extractor, config, clips
    # ------------------------------------------------------------------------------------------
    extractor = speech.load_feature_extractor(model_args)
    config = w2v.fit_config(load_config(model_args, task="wav2vec2", model_types=("wav2vec2",)), model_args)
    workers = data_args.preprocessing_num_workers or speech.audio.default_workers()
    clips = speech.load_clips(data_args, training_args, extractor, model_args.cache_dir, workers, transcribed=False,
                              shortest_model_clip=speech.shortest_heard(config, extractor.sampling_rate))
    waveforms = w2v.Waveforms(extractor, w2v.padded_samples(data_args.max_duration_in_seconds,
                                                            extractor.sampling_rate, data_args.pad_to_multiple_of))
    frames = int(w2v.frame_lengths(config, waveforms.length))
    temperatures = (model_args.max_gumbel_temperature, model_args.min_gumbel_temperature,
                    model_args.gumbel_temperature_decay)
    train_masking = w2v.Masking(config, training_args.seed, temperatures)
    eval_masking = w2v.Masking(config, training_args.seed)
    train_data = None
    if training_args.do_train:
        train_data = speech.SpeechData(clips["train"].sources, {}, waveforms, workers)
    eval_arrays = None
    if training_args.do_eval:
        eval_arrays = speech.FeatureColumn(clips["validation"].sources, waveforms, workers).parts()
    plan = training_plan(training_args, train_data.size if train_data else None)

    # ------------------------------------------------------------------------------------------
    # Model
    # ------------------------------------------------------------------------------------------
    model, params = load_model(w2v.PretrainingModel, model_args, config, training_args.seed, layout)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------
    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        mask = w2v.scored_mask(batch)
        dropout_key, gumbel_key = w2v.step_keys(dropout_rng) if train else (None, None)
        temperature = batch["gumbel_temperature"][0] if train else None
        outputs = model(batch[w2v.INPUT], attention_mask=batch["attention_mask"], mask_time_indices=mask,
                        gumbel_temperature=1.0 if temperature is None else temperature, params=params,
                        dropout_rng=dropout_key, gumbel_rng=gumbel_key, train=train)
        return w2v.pretraining_loss(outputs.projected_states, outputs.projected_quantized_states,
                                    outputs.codevector_perplexity, mask, batch["negatives"], config,
                                    config.diversity_loss_weight, temperature)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data, train_masking)
    watch = w2v.PerplexityWatch(config)

    def evaluate(params):
        """Contrastive and diversity losses and the (hard) codevector perplexity over the masked frames
        of the validation clips, masked the same way at every evaluation."""
        metrics, _ = steps.evaluate(params, eval_arrays, len(clips["validation"].sources), eval_masking)
        watch.check(metrics["codevector_perplexity"], "eval", run.step)
        return {**metrics, "samples": len(clips["validation"].sources)}

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    other_steps = dict(eval_step=(eval_arrays, len(clips["validation"].sources), eval_masking)
                       if eval_arrays else None)

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, extractor, other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        # Throughput counts the encoder's frames.
        for step, batch in run.train_batches(frames, transform=train_masking):
            state, sums = steps.train(state, batch)
            run.after_step(step, sums)
            if step % training_args.logging_steps == 0:  # the log fetched this step's sums already
                watch.check(host_means([sums])["codevector_perplexity"], "training", step)
            if run.eval_due(step):
                run.report("eval", evaluate(state.params))
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, result files, export
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        run.report("eval", evaluate(state.params))
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
