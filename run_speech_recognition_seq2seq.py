#!/usr/bin/env python
"""Fine-tune (or train from scratch) a Flax Whisper model, or a speech encoder-decoder (wav2vec2 +
GPT-2, BART, BERT or RoBERTa), for speech recognition, without torch.

    python run_speech_recognition_seq2seq.py configs/speech_recognition_tiny.json
    python run_speech_recognition_seq2seq.py --model_name_or_path openai/whisper-tiny.en \\
        --train_file clips/train.csv --validation_file clips/validation.csv --do_train --do_eval \\
        --predict_with_generate --output_dir runs/whisper
    python run_speech_recognition_seq2seq.py --encoder_model_name_or_path facebook/wav2vec2-base \\
        --decoder_model_name_or_path gpt2 --train_file clips/train.csv ... --output_dir runs/wav2vec2-gpt2

The speech encoder-decoder (`FlaxSpeechEncoderDecoderModel`) is joined from a wav2vec2 encoder and a
decoder with cross-attention, each pretrained or from its config, with the captioning script's
--encoder_* / --decoder_* flags, or loaded whole from a saved one (--model_name_or_path); it hears
the normalised waveform (padded to --max_duration_in_seconds, with its attention mask), and its
labels carry no Whisper prefix.

Clips come from a data file (csv or json lines, compressed too) whose audio column holds paths
relative to the file, beside a transcript column, or from a hub dataset (an `Audio` or a path
column). They are read by `tasks/audio.py` (WAV with the standard library; FLAC / OGG with the
optional soundfile package; no torch, torchcodec or FFmpeg), resampled to the feature extractor's
rate, and turned into the model's input features by its own feature extractor in background
threads, batch by batch (never cached whole). Clips longer than --max_duration_in_seconds (at most
what the model takes) or shorter than --min_duration_in_seconds are skipped and counted. The task's
knowledge (clips, labels, features, loss, generation, WER / CER, the prediction file) lives in
`tasks/speech_recognition.py`. One train / eval / generate loop, each step defined once for both
layouts (`--sharding dp`, jax.pmap over the local devices, the default; `--sharding fsdp`, the
model split over all devices); everything mechanical lives in `utils/`.
"""

import utils  # noqa: F401  first of all: start-up is timed from here (utils.run.perf.seconds_since_start)

import sys
from dataclasses import dataclass, field
from typing import Optional

from transformers import FlaxAutoModel, FlaxAutoModelForCausalLM, FlaxAutoModelForSpeechSeq2Seq, \
    FlaxSpeechEncoderDecoderModel

from tasks import speech_recognition as speech
from tasks.speech_recognition import TASK
from utils.base.arguments import BaseDataArguments, EncoderDecoderModelArguments, READS, TrainingArguments
from utils.base.errors import UsageError, run_main
from utils.base.parsing import parse_args
from utils.models.loading import arguments_of, load_composed_model, load_model, load_tokenizer, pretrained_part
from utils.run.loop import host_means
from utils.run.preflight import check_before_work
from utils.run.setup import set_up, training_plan
from utils.run.spine import TrainingRun, make_steps


@dataclass
class SpeechModelArguments(EncoderDecoderModelArguments):
    feature_extractor_name: Optional[str] = field(
        default=None, metadata={"help": "Feature extractor (name or path) if not the model's; a model trained from "
                                        "scratch needs one (its preprocessor_config.json sizes the encoder); a "
                                        "speech encoder-decoder's defaults to its encoder's.",
                                READS: "its feature extractor"})


@dataclass
class SpeechDataArguments(BaseDataArguments):
    test_file: Optional[str] = field(
        default=None, metadata={"help": "Local test file (json, jsonl or csv) with the audio and text columns."})
    audio_column_name: str = field(
        default="audio", metadata={"help": "Column with the audio: paths relative to the data file, or a dataset's "
                                           "Audio feature."})
    text_column_name: str = field(default="text", metadata={"help": "Column with the transcripts."})
    max_duration_in_seconds: float = field(
        default=20.0, metadata={"help": "Skip clips longer than this (counted in the log); at most what the model "
                                        "takes (Whisper: its feature extractor's chunk, 30 s)."})
    min_duration_in_seconds: float = field(
        default=0.0, metadata={"help": "Skip clips shorter than this (counted in the log)."})
    max_label_length: int = field(
        default=128, metadata={"help": "Transcript tokens (prefix included) trained on and generated at most; "
                                       "longer transcripts are cut (counted in the log)."})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the test set."})
    do_lower_case: bool = field(default=True, metadata={"help": "Lower-case the transcripts.",
                                                        "negated_help": "Keep the transcripts' case."})
    language: Optional[str] = field(
        default=None, metadata={"help": "Language token of a multilingual Whisper tokenizer (e.g. 'english'); None "
                                        "for English-only models."})
    task: str = field(default="transcribe", metadata={"help": "Whisper's task token: transcribe or translate."})
    predict_with_generate: bool = field(
        default=False, metadata={"help": "Generate transcripts and compute WER / CER."})
    num_beams: Optional[int] = field(default=None, metadata={"help": "Beams for generate (default: model config)."})
    do_normalize_eval: bool = field(
        default=False, metadata={"help": "Lower-case and drop punctuation from transcripts and references before "
                                         "WER / CER."})

    def __post_init__(self):
        super().__post_init__()
        speech.check_durations(self)
        for name in ("max_label_length", "num_beams"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UsageError(f"--{name} must be positive, got {value}")
        if self.task not in ("transcribe", "translate"):
            raise UsageError(f"--task {self.task!r} is unknown: use transcribe or translate")

# ----------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------


def main(argv=None):
    model_args, data_args, training_args = parse_args(
        (SpeechModelArguments, SpeechDataArguments, TrainingArguments), sys.argv[1:] if argv is None else argv
    )
    preflight = check_before_work(TASK, model_args, data_args, training_args)
    logger, is_main, layout = set_up(training_args)

    # ------------------------------------------------------------------------------------------
    # Feature extractor, tokenizer, config, clips, labels
    # ------------------------------------------------------------------------------------------
    # A speech encoder-decoder reads its extractor from the encoder, its tokenizer from the decoder.
    joined = speech.is_joined(model_args)
    extractor = speech.load_feature_extractor(arguments_of(model_args, "encoder") if joined else model_args)
    tokenizer = load_tokenizer(arguments_of(model_args, "decoder") if joined else model_args)
    speech.set_run_prefix(tokenizer, data_args, joined)
    config = speech.load_speech_config(model_args, extractor, tokenizer, joined)
    workers = data_args.preprocessing_num_workers or speech.audio.default_workers()
    clips = speech.load_clips(data_args, training_args, extractor, model_args.cache_dir, workers,
                              shortest_model_clip=speech.shortest_heard(config, extractor.sampling_rate))
    texts = {split: [speech.transcript(text, data_args.do_lower_case) for text in found.texts]
             for split, found in clips.items()}
    label_length = speech.label_length(data_args.max_label_length, config)
    features = speech.Features(extractor, data_args.max_duration_in_seconds)
    # The labels, and a waveform's attention mask beside them.
    labels = {split: {**speech.encode_labels(tokenizer, texts[split], label_length, config.decoder_start_token_id,
                                             split, speech.end_token(config)),
                      **features.mask_columns(clips[split])} for split in clips}
    train_data = None
    if training_args.do_train:
        train_data = speech.SpeechData(clips["train"].sources, labels["train"], features, workers)
    eval_arrays = speech.eval_columns(clips, labels, features, workers)
    plan = training_plan(training_args, train_data.size if train_data else None)

    # ------------------------------------------------------------------------------------------
    # Model
    # ------------------------------------------------------------------------------------------
    if joined:  # a saved speech encoder-decoder, or its encoder and decoder joined here
        parts = {"encoder": (FlaxAutoModel, pretrained_part(model_args, "encoder")),
                 "decoder": (FlaxAutoModelForCausalLM, pretrained_part(model_args, "decoder"))}
        model, params = load_composed_model(FlaxSpeechEncoderDecoderModel, config, model_args, parts,
                                            training_args.seed, layout)
    else:
        model, params = load_model(FlaxAutoModelForSpeechSeq2Seq, model_args, config, training_args.seed, layout)

    # ------------------------------------------------------------------------------------------
    # Loss, then the optimizer, state and steps built from it (placed and compiled by the layout)
    # ------------------------------------------------------------------------------------------
    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        inputs = {name: batch[name] for name in speech.MODEL_INPUTS + features.extra_inputs}
        logits = model(batch[features.input_name], **inputs, params=params, dropout_rng=dropout_rng, train=train)[0]
        return speech.transcript_loss(logits, batch["labels"], batch["decoder_attention_mask"],
                                      batch.get("example_weight"), label_smoothing)

    state, steps = make_steps(loss_fn, model, params, layout, training_args, plan, train_data)
    prompt = speech.prompt_of(tokenizer, config)
    settings = speech.generation_settings(model, label_length, data_args.num_beams or model.generation_config.num_beams)
    p_generate_step = layout.compile_step(
        "generate_step", lambda params, batch: speech.generate_ids(model, params, batch[features.input_name], prompt,
                                                                   settings, batch.get("attention_mask")))

    def evaluate(params, split):
        """Token-weighted loss and the label tokens scored; with `predict_with_generate` WER, CER and the
        generated transcripts."""
        sums, generated = [], []
        for batch, valid in steps.eval_batches(eval_arrays[split], len(clips[split].sources)):
            sums.append(steps.eval(params, batch))
            if data_args.predict_with_generate:
                generated.extend(layout.rows_to_host(p_generate_step(params, batch))[:valid])
        metrics = {**host_means(sums, keep_tokens=True), "samples": len(clips[split].sources)}
        if not data_args.predict_with_generate:
            return metrics, None
        hypotheses = speech.decode_texts(tokenizer, generated)
        return {**metrics, **speech.recognition_metrics(texts[split], hypotheses, data_args.do_normalize_eval)}, \
            hypotheses

    # Each step besides training that this run calls, with the data its first batch comes from (None: not called).
    evaluated = "validation" if "validation" in eval_arrays else "test"
    first = (eval_arrays.get(evaluated), len(clips[evaluated].sources) if evaluated in clips else None)
    other_steps = dict(eval_step=first, generate_step=first if data_args.predict_with_generate else None)

    # ------------------------------------------------------------------------------------------
    # Resume (the last check), run directory, checkpoints
    # ------------------------------------------------------------------------------------------
    run = TrainingRun(training_args, (model_args, data_args, training_args), TASK, plan, layout, train_data, is_main)
    state = run.start(state, preflight.resume, config, model, speech.Processor(extractor, tokenizer), other_steps)

    # ------------------------------------------------------------------------------------------
    # Training
    # ------------------------------------------------------------------------------------------
    if training_args.do_train:
        # Throughput counts encoder positions; flops_per_token charges the decoder's work to them.
        for step, batch in run.train_batches(speech.source_positions(model, features), label_length):
            state, sums = steps.train(state, batch)
            run.after_step(step, sums)
            if run.eval_due(step):
                run.report("eval", evaluate(state.params, "validation")[0])
            run.save_if_due(step, state)
        run.end_training(state)

    # ------------------------------------------------------------------------------------------
    # Final evaluation, prediction, result files
    # ------------------------------------------------------------------------------------------
    if run.final_eval_due():
        run.report("eval", evaluate(state.params, "validation")[0])
    if training_args.do_predict:
        metrics, hypotheses = evaluate(state.params, "test")
        run.report("test", metrics)
        if hypotheses is not None:
            run.write_text(speech.PREDICTIONS_FILE, hypotheses)
    run.finish()


if __name__ == "__main__":
    sys.exit(run_main(main))
