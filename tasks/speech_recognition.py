"""Speech recognition (`run_speech_recognition_seq2seq.py`): the model (Whisper, or a speech
encoder-decoder), the audio and transcript columns, the clips kept, the transcripts as decoder
labels, features computed on the fly, the loss, generation with a per-call prompt and settings, WER
and CER offline, the generated lines.

- model: Whisper (pretrained, a saved run, or from its config), or a `FlaxSpeechEncoderDecoderModel`:
  a wav2vec2 encoder and a decoder with cross-attention (`DECODER_TYPES`) joined here
  (`utils.models.loading.join_configs`, the captioning script's flags and code), or a saved one. Whisper
  hears log-mel features of a fixed chunk; wav2vec2 the normalised waveform itself, padded to
  --max_duration_in_seconds, with an attention mask (`Features`, `AudioMask`).

- clips: `load_clips` reads each phase's split (a data file whose audio column holds paths relative
  to it, or a hub dataset with an `Audio` or path column, decoded by `tasks.audio`, never by
  `datasets`), checks every clip once (a missing file or one that is not audio is an error naming
  it), and keeps those between --min_duration_in_seconds and --max_duration_in_seconds with a
  transcript, counting the rest in the log. The longest clip a model takes is its feature
  extractor's chunk (Whisper pads or cuts every clip to it): --max_duration_in_seconds is lowered to
  it with a warning, so a longer clip is skipped, never silently cut.
- labels: `encode_labels` tokenizes the transcripts (lower-cased with --do_lower_case) with the
  tokenizer's prefix (Whisper: <|startoftranscript|><|lang|><|task|><|notimestamps|>; a speech
  encoder-decoder: none, the tokenizer's end token appended), cuts them to
  --max_label_length tokens (how many were cut is logged) and shifts them right behind the decoder
  start token, as the model's own `shift_tokens_right`.
- features: `SpeechData` (training batches) and `FeatureColumn` (eval batches) load, resample and
  run the model's feature extractor on each clip in a pool of threads, ahead of the step; nothing
  is cached whole. The features have no randomness: a batch is a pure function of (seed, step).
- generation: `generate_ids` starts every row from the tokenizer's prompt (`prompt_of`) and takes
  its settings (`generation_settings`: max length, beams) as an argument built per call, so nothing
  is written into the model's shared generation config (Whisper's own `generate` writes its task
  and language there, and they leak into the next call). A speech encoder-decoder's encoder runs
  first: transformers' `generate` would hand its decoder the clip's sample mask as the mask of the
  encoder's frames (`frame_mask`).
- metrics: `word_error_rate` / `character_error_rate` over the corpus (edits summed over every
  transcript, divided by the reference words / characters, as jiwer computes them), with
  `--do_normalize_eval` lower-casing and dropping punctuation on both sides first.
"""

import copy
import logging
import os
import re
import unicodedata
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task, audio
from tasks.demo import Answer, BadInput, Predictor, show_answer
from tasks.lm import token_sums
from utils.base.errors import UsageError
from utils.data import loaders
from utils.models.loading import (check_joined_arguments, fit_config_to_tokenizer, fit_length, join_configs,
                                  joins_parts, load_config, max_positions)
from utils.run.preflight import needed_splits, phase_datasets, phase_files
from utils.run.threaded_feed import ThreadedData

PREDICTIONS_FILE = "generated_predictions.txt"
MODEL_TYPES = ("whisper",)
# A speech encoder-decoder: a wav2vec2 encoder (transformers' only Flax speech encoder) and a decoder with
# cross-attention. Unlike the vision encoder-decoder, it hands the decoder the encoder's states by
# keyword, so BERT and RoBERTa decoders generate too.
JOINED = "speech-encoder-decoder"
ENCODER_TYPES = ("wav2vec2",)
DECODER_TYPES = ("gpt2", "bart", "bert", "roberta")
logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# Model, feature extractor, tokenizer
# ----------------------------------------------------------------------------------------------
def load_feature_extractor(model_args):
    """The feature extractor of --feature_extractor_name, or the model's, or the folder of its config
    (a speech encoder-decoder's encoder); a model trained from scratch of a hub family's config needs
    --feature_extractor_name: its input features are the extractor's."""
    from transformers import AutoFeatureExtractor

    name = model_args.feature_extractor_name or model_args.model_name_or_path or model_args.config_name
    if not name:
        raise UsageError("no feature extractor: pass --feature_extractor_name (a folder or hub id with a "
                         "preprocessor_config.json) for a model trained from scratch")
    try:
        return AutoFeatureExtractor.from_pretrained(name, cache_dir=model_args.cache_dir, token=model_args.token)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"could not load feature extractor {name!r}: {first}") from e


def chunk_seconds(extractor):
    """The longest clip the extractor gives the model whole (Whisper pads or cuts to `n_samples`);
    None for an extractor without a chunk (wav2vec2's: the run pads to --max_duration_in_seconds)."""
    samples = getattr(extractor, "n_samples", None)
    return samples / extractor.sampling_rate if samples else None


def check_model_arguments(model_args, data_args, training_args):
    """A speech encoder-decoder joined from --encoder_* / --decoder_* flags must name both parts, and
    no saved model beside them (before any work)."""
    if joins_parts(model_args):
        check_joined_arguments(model_args, "speech encoder-decoder")


# Whisper tokenizers also save their English spelling normaliser beside the vocabulary.
TASK = Task("speech-recognition", "automatic-speech-recognition", outputs=(PREDICTIONS_FILE, "normalizer.json"),
            file_formats=audio.FILE_FORMATS, check_arguments=check_model_arguments, check_data=audio.check_columns)


def is_joined(model_args):
    """Whether the model is a speech encoder-decoder: joined from its parts, or a saved one."""
    if joins_parts(model_args):
        return True
    return bool(model_args.model_name_or_path) and load_config(
        model_args, None, model_types=MODEL_TYPES + (JOINED,)).model_type == JOINED


def load_speech_config(model_args, extractor, tokenizer, joined):
    """The model config: a speech encoder-decoder's (saved, or joined from its parts' configs, its
    start, end and pad ids the tokenizer's), which hears the raw waveform; or Whisper's, fitted to the
    extractor (`fit_config`) and the tokenizer."""
    from transformers import SpeechEncoderDecoderConfig

    if joined:
        if extractor.model_input_names[0] != "input_values":
            raise UsageError(f"a speech encoder-decoder hears the waveform, but the feature extractor "
                             f"{type(extractor).__name__} gives {extractor.model_input_names[0]}: use the encoder's "
                             "own (a Wav2Vec2FeatureExtractor, --feature_extractor_name)")
        return join_configs(SpeechEncoderDecoderConfig, model_args, tokenizer, ENCODER_TYPES, DECODER_TYPES)
    config = load_config(model_args, None, model_types=MODEL_TYPES)
    config = fit_config(config, extractor, tokenizer, bool(model_args.model_name_or_path))
    return fit_config_to_tokenizer(config, tokenizer, model_args)


def fit_config(config, extractor, tokenizer, pretrained):
    """Whisper's encoder takes exactly the extractor's frames (two per position) of its mel bins. A
    model from scratch is sized to them, and decodes from <|startoftranscript|> with no token
    suppression (the default ids are a real Whisper vocabulary's); a pretrained one must match."""
    frames = extractor.nb_max_frames
    if pretrained:
        if config.num_mel_bins != extractor.feature_size or 2 * config.max_source_positions != frames:
            raise UsageError(f"the feature extractor gives {extractor.feature_size} mel bins x {frames} frames but the "
                             f"model takes {config.num_mel_bins} x {2 * config.max_source_positions}: use the "
                             "model's own feature extractor (--feature_extractor_name)")
        return config
    config.num_mel_bins, config.max_source_positions = extractor.feature_size, frames // 2
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    if start is not None and start != tokenizer.unk_token_id:
        config.decoder_start_token_id = start
    config.suppress_tokens, config.begin_suppress_tokens = None, None
    return config


def label_length(max_label_length, config):
    """--max_label_length, lowered (with a warning) so the start token and the labels fit the decoder's positions."""
    positions = max_positions(config.decoder) if config.model_type == JOINED else config.max_target_positions
    return fit_length(max_label_length, positions - 1, "max_label_length", logger)


def end_token(config):
    """The token a speech encoder-decoder's labels end with (its tokenizer adds none: `encode_labels`);
    None for Whisper, whose tokenizer writes its prefix and end itself."""
    return config.eos_token_id if config.model_type == JOINED else None


class Processor:
    """The feature extractor and the tokenizer, saved beside the model (what the export and the demo read)."""

    def __init__(self, extractor, tokenizer):
        self.extractor, self.tokenizer = extractor, tokenizer

    def save_pretrained(self, output_dir):
        self.extractor.save_pretrained(output_dir)
        self.tokenizer.save_pretrained(output_dir)


def set_prefix(tokenizer, language, task):
    """A Whisper tokenizer's prefix: <|startoftranscript|>, the language (when given), the task, no timestamps."""
    if hasattr(tokenizer, "set_prefix_tokens"):
        try:
            tokenizer.set_prefix_tokens(language=language, task=task, predict_timestamps=False)
        except ValueError as e:
            raise UsageError(f"--language {language!r} / --task {task!r}: {e}") from e


def set_run_prefix(tokenizer, data_args, joined):
    """Whisper's prefix from --language and --task; a speech encoder-decoder's transcripts have none, so
    --language is refused there rather than silently ignored."""
    if not joined:
        set_prefix(tokenizer, data_args.language, data_args.task)
    elif data_args.language:
        raise UsageError(f"--language {data_args.language!r} picks a Whisper language token; a speech "
                         "encoder-decoder's transcripts carry no prefix: drop --language")


# ----------------------------------------------------------------------------------------------
# Clips
# ----------------------------------------------------------------------------------------------
class Clips(NamedTuple):
    """The usable clips of a split: `sources` (`tasks.audio.AudioSources`), their transcripts, the
    name each is shown by (errors) and its duration in seconds."""
    sources: object
    texts: list
    shown: list
    seconds: np.ndarray


def check_durations(data_args):
    """--max_duration_in_seconds / --min_duration_in_seconds: a UsageError unless 0 <= min < max."""
    if data_args.max_duration_in_seconds <= 0 or data_args.min_duration_in_seconds < 0:
        raise UsageError("--max_duration_in_seconds must be positive and --min_duration_in_seconds >= 0")
    if data_args.min_duration_in_seconds >= data_args.max_duration_in_seconds:
        raise UsageError(f"--min_duration_in_seconds {data_args.min_duration_in_seconds:g} must be below "
                         f"--max_duration_in_seconds {data_args.max_duration_in_seconds:g}")


def max_duration(data_args, extractor):
    """--max_duration_in_seconds, at most the extractor's chunk (with a warning where it is lowered)."""
    limit = chunk_seconds(extractor)
    if limit is not None and data_args.max_duration_in_seconds > limit:
        logger.warning("--max_duration_in_seconds %g is more than the %g seconds the model takes: clips longer than "
                       "%g s are skipped", data_args.max_duration_in_seconds, limit, limit)
        return limit
    return data_args.max_duration_in_seconds


def transcripts(values, split, column):
    """The stripped transcripts of a column ("" where a row has none); a number is its digits (a csv of
    spoken digits reads as integers), a row holding anything else but text (a list, a record) is a
    UsageError."""
    texts = []
    for row, text in enumerate(values):
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            text = str(text)
        elif text is not None and not isinstance(text, str):
            raise UsageError(f"row {row} of the {split} data holds {str(text)[:60]} in column {column!r}, not a "
                             "transcript: give it its text")
        texts.append((text or "").strip())
    return texts


def shortest_heard(config, rate):
    """The seconds of the shortest clip a waveform encoder (wav2vec2's convolutions, alone or as a
    speech encoder-decoder's encoder) makes one frame of; 0 for a model of mel frames (Whisper). A
    clip without a frame would have nothing to attend to: its loss would be nan."""
    config = getattr(config, "encoder", config)
    if not hasattr(config, "conv_kernel"):
        return 0.0
    samples = 1
    for kernel, stride in reversed(list(zip(config.conv_kernel, config.conv_stride))):
        samples = (samples - 1) * stride + kernel
    return samples / rate


def load_clips(data_args, training_args, extractor, cache_dir, workers, transcribed=True, shortest_model_clip=0.0):
    """{split: Clips} of the phases asked for, read from data files or a hub dataset, every clip
    checked, the unusable ones (too long, too short, no transcript) skipped and counted; too short
    is under --min_duration_in_seconds or `shortest_model_clip` (`shortest_heard`). Not
    `transcribed` (wav2vec2 pretraining): no text column is read, and `Clips.texts` is None."""
    splits = needed_splits(training_args)
    files = {split: phase_files(data_args)[split] for split in splits}
    raw = loaders.load_splits(data_args, files, cache_dir, allowed=audio.FILE_FORMATS)
    raw = phase_datasets(raw, {split: split for split in splits}, data_args)
    audio_column, text_column = audio.resolve_columns(data_args, {split: raw[split].column_names for split in splits},
                                                      transcribed)
    longest, shortest = max_duration(data_args, extractor), max(data_args.min_duration_in_seconds, shortest_model_clip)
    clips = {}
    for split in splits:
        file = files[split]
        sources = audio.AudioSources(raw[split], audio_column, os.path.dirname(os.path.abspath(file)) if file else None,
                                     split)
        seconds = audio.check_clips(sources, split, workers)
        texts = transcripts(raw[split][text_column], split, text_column) if transcribed else None
        too_long, too_short = seconds > longest, seconds < shortest
        untranscribed = np.array([not text for text in texts] if transcribed else [False] * len(seconds), bool)
        untranscribed &= ~too_long & ~too_short
        keep = np.flatnonzero(~(too_long | too_short | untranscribed))
        if len(keep) < len(seconds):
            logger.warning("%s: skipped %d of %d clips: %d longer than %g s, %d shorter than %g s%s", split,
                           len(seconds) - len(keep), len(seconds), too_long.sum(), longest, too_short.sum(), shortest,
                           f", {untranscribed.sum()} without a transcript" if transcribed else "")
        if len(keep) == 0:
            raise UsageError(f"the {split} data has no usable clip ({len(seconds)} read): every clip is longer than "
                             f"{longest:g} s{', ' if transcribed else ' or'} shorter than {shortest:g} s"
                             f"{' or has no transcript' if transcribed else ''}")
        kept = sources.select(keep)
        clips[split] = Clips(kept, [texts[i] for i in keep] if transcribed else None,
                             [kept.name(i) for i in range(len(keep))], seconds[keep])
        logger.info("%s: %d clips, %.1f s of audio", split, len(keep), seconds[keep].sum())
    return clips


# ----------------------------------------------------------------------------------------------
# Labels
# ----------------------------------------------------------------------------------------------
def transcript(text, do_lower_case):
    return text.lower() if do_lower_case else text


def encode_labels(tokenizer, texts, max_length, decoder_start_token_id, split="", end_token_id=None):
    """{"labels", "decoder_input_ids", "decoder_attention_mask"} int32 [rows, max_length]: each
    transcript's token ids after the decoder start token (which the tokenizer's prefix may begin
    with), cut to `max_length` (how many were cut is logged), padded; the decoder inputs are the
    labels shifted right behind the start token, the mask 1 on every label token. With
    `end_token_id` (a speech encoder-decoder), the transcript's tokens without the tokenizer's own
    special tokens (no Whisper prefix), then that end token."""
    labels = np.zeros((len(texts), max_length), np.int32)
    mask = np.zeros((len(texts), max_length), np.int32)
    cut = 0
    if end_token_id is None:
        encoded = tokenizer(list(texts))["input_ids"]
    else:
        encoded = [ids + [end_token_id] for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]]
    for row, ids in enumerate(encoded):
        if ids and ids[0] == decoder_start_token_id:
            ids = ids[1:]
        cut += len(ids) > max_length
        ids = ids[:max_length]
        labels[row, :len(ids)], mask[row, :len(ids)] = ids, 1
    if cut:
        logger.warning("%s: %d of %d transcripts are longer than --max_label_length %d tokens: cut to it", split,
                       cut, len(texts), max_length)
    decoder_input_ids = np.empty_like(labels)
    decoder_input_ids[:, 0] = decoder_start_token_id
    decoder_input_ids[:, 1:] = labels[:, :-1]
    return {"labels": labels, "decoder_input_ids": decoder_input_ids, "decoder_attention_mask": mask}


def prompt_ids(tokenizer, decoder_start_token_id):
    """The tokens every generated transcript starts from: the start token, then the tokenizer's prefix
    (Whisper: language, task, no timestamps): what an empty transcript encodes to, less its end."""
    ids = tokenizer("")["input_ids"]
    if ids and ids[0] == decoder_start_token_id:
        ids = ids[1:]
    ending = set(tokenizer.all_special_ids) & {tokenizer.eos_token_id, tokenizer.sep_token_id}
    while ids and ids[-1] in ending:
        ids = ids[:-1]
    return np.array([decoder_start_token_id, *ids], np.int32)


def prompt_of(tokenizer, config):
    """The prompt of the run's model: Whisper's start token and prefix (`prompt_ids`); a speech
    encoder-decoder's start token alone (its labels carry no prefix)."""
    if config.model_type == JOINED:
        return np.array([config.decoder_start_token_id], np.int32)
    return prompt_ids(tokenizer, config.decoder_start_token_id)


# ----------------------------------------------------------------------------------------------
# Features
# ----------------------------------------------------------------------------------------------
class Features:
    """A clip -> the model's input features: loaded, resampled to the extractor's rate, extracted.

    Whisper's extractor pads or cuts every clip to its chunk. A waveform extractor (wav2vec2's,
    `raw`) has no chunk: the clips are padded to `max_seconds` (--max_duration_in_seconds), one
    shape for every batch, each normalised over its own samples; `AudioMask` marks them."""

    def __init__(self, extractor, max_seconds=None):
        self.extractor = extractor
        self.input_name = extractor.model_input_names[0]
        self.raw = self.input_name == "input_values"
        # The model inputs beside the features: a waveform's attention mask.
        self.extra_inputs = ("attention_mask",) if self.raw else ()
        self.samples = round(max_seconds * extractor.sampling_rate) if self.raw else None
        # Whisper's features computed for all frames at once (`tasks.audio.whisper_log_mel`: the same numbers).
        self.whisper = type(extractor).__name__ == "WhisperFeatureExtractor" and not getattr(extractor, "dither", 0.0)

    def __call__(self, source):
        samples = audio.load(source, self.extractor.sampling_rate)
        if self.whisper:
            return audio.whisper_log_mel(samples, self.extractor)
        if self.raw:
            return self.extractor(samples, sampling_rate=self.extractor.sampling_rate, padding="max_length",
                                  max_length=self.samples, truncation=True, return_attention_mask=True,
                                  return_tensors="np")[self.input_name][0]
        return self.extractor(samples, sampling_rate=self.extractor.sampling_rate,
                              return_tensors="np")[self.input_name][0]

    @property
    def shape(self):
        if self.raw:
            return (self.samples,)
        return (self.extractor.feature_size, self.extractor.nb_max_frames)

    @property
    def longest_seconds(self):
        """The longest clip the model hears whole (the rest is cut)."""
        return self.samples / self.extractor.sampling_rate if self.raw else chunk_seconds(self.extractor)

    def sample_counts(self, seconds):
        """The samples of clips lasting `seconds` at the extractor's rate, at most `samples`: what
        `tasks.audio.resample` writes (SciPy's polyphase filter: ceil(frames x up / down); the
        rate ratio's denominator is far below 1e6, so the small tolerance never rounds a real fraction)."""
        counts = np.ceil(np.asarray(seconds, np.float64) * self.extractor.sampling_rate - 1e-6).astype(np.int64)
        return np.minimum(counts, self.samples)

    def mask_columns(self, clips):
        """{"attention_mask": `AudioMask`} of a split's `Clips` for a waveform model; {} for Whisper."""
        return {"attention_mask": AudioMask(self.sample_counts(clips.seconds), self.samples)} if self.raw else {}


class AudioMask:
    """The attention mask of padded waveforms: `mask[indices]` is int32 [len(indices), samples], 1 on
    each clip's own samples, made from their counts when read (never held whole)."""

    def __init__(self, counts, samples):
        self.counts, self.samples = np.asarray(counts, np.int64), samples

    def __len__(self):
        return len(self.counts)

    def __getitem__(self, indices):
        counts = self.counts[np.atleast_1d(np.asarray(indices, np.int64))]
        return (np.arange(self.samples)[None, :] < counts[:, None]).astype(np.int32)


class FeatureColumn:
    """A column of input features: `column[indices]` computes those clips' features (on a pool of
    `workers` threads) into float32 [len(indices), *features.shape]. What `utils.data.batch_order.gather` reads.
    Features that give several arrays per clip (a dict: wav2vec2 pretraining's samples and their attention
    mask) make one column each (`parts`), which share one computation per batch."""

    def __init__(self, sources, features, workers=None):
        self.sources, self.features = sources, features
        self.workers = workers or audio.default_workers()
        self._pool = None
        self._last = (None, None)  # (indices, rows) of the last batch: the parts of one batch ask for the same

    def __len__(self):
        return len(self.sources)

    @property
    def shape(self):
        return (len(self), *self.features.shape)

    def rows(self, indices):
        indices = np.atleast_1d(np.asarray(indices))
        if self._last[0] is not None and np.array_equal(self._last[0], indices):
            return self._last[1]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="eval-audio")
        rows = list(self._pool.map(lambda i: self.features(self.sources[int(i)]), indices))
        self._last = (indices, rows)
        return rows

    def __getitem__(self, indices):
        rows = self.rows(indices)
        return np.stack(rows).astype(np.float32) if rows else np.zeros((0, *self.features.shape), np.float32)

    def parts(self):
        """{name: column} of features giving a dict of arrays per clip (`features.shapes`: name -> shape)."""
        return {name: FeaturePart(self, name, shape) for name, shape in self.features.shapes.items()}


class FeaturePart:
    """One array of a `FeatureColumn` whose features are dicts: `part[indices]` stacks that array."""

    def __init__(self, column, name, shape):
        self.column, self.name, self.shape = column, name, (len(column), *shape)

    def __len__(self):
        return len(self.column)

    def __getitem__(self, indices):
        return np.stack([row[self.name] for row in self.column.rows(indices)])


def stack_features(rows, input_name):
    """{name: [rows, ...]} of per-clip features: arrays (the model's one input, `input_name`), or
    dicts of arrays (an input and its attention mask)."""
    if rows and isinstance(rows[0], dict):
        return {name: np.stack([row[name] for row in rows]) for name in rows[0]}
    return {input_name: np.stack(rows)}


class SpeechData(ThreadedData):
    """The training clips of a run, for `utils.run.spine`, batched by `utils.run.threaded_feed`'s threads:
    each batch's features computed from its clips, its labels taken from the encoded transcripts."""

    def __init__(self, sources, labels, features, workers=None):
        super().__init__(len(sources), workers)
        self.sources, self.labels, self.features = sources, labels, features

    def host_batch(self, indices, seed, epoch):
        indices = np.asarray(indices, np.int64)
        batch = stack_features([self.features(self.sources[int(i)]) for i in indices], self.features.input_name)
        return {**batch, **{name: column[indices] for name, column in self.labels.items()}}


def eval_columns(clips, labels, features, workers=None):
    """{split: input features (`FeatureColumn`) and label arrays (and the waveform's mask, with the
    labels)} of the splits evaluated or predicted."""
    return {split: {features.input_name: FeatureColumn(found.sources, features, workers), **labels[split]}
            for split, found in clips.items() if split != "train"}


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
MODEL_INPUTS = ("decoder_input_ids", "decoder_attention_mask")


def transcript_loss(logits, labels, decoder_attention_mask, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}) over the label tokens (the prefix's included, as the classic);
    padding counts nothing, padded rows (`example_weight` 0) neither."""
    return token_sums(logits, labels, decoder_attention_mask, example_weight, label_smoothing)


# ----------------------------------------------------------------------------------------------
# Generation
# ----------------------------------------------------------------------------------------------
def generation_settings(model, label_length, num_beams):
    """A generation config of its own for the predict path: the model's, copied, generating up to the
    labels' length after the start token, with `num_beams`, and no forced tokens (the prompt carries
    them). The model's stays untouched."""
    settings = copy.deepcopy(model.generation_config)
    settings.max_length = label_length + 1
    settings.num_beams = num_beams
    settings.forced_decoder_ids = None
    settings.return_timestamps = False
    settings._from_model_config = False
    return settings


def source_positions(model, features):
    """The encoder positions of one clip (what throughput counts): Whisper's, or the frames a waveform
    model's convolutions make of `features.samples`."""
    if features.raw:
        return int(model._get_feat_extract_output_lengths(features.samples))
    return model.config.max_source_positions


def frame_mask(model, attention_mask, frames):
    """int32 [rows, frames]: the encoder frames of each waveform's own samples (`attention_mask`), as
    the wav2vec2 encoder's convolutions shorten them (`_get_feat_extract_output_lengths`)."""
    lengths = model._get_feat_extract_output_lengths(jnp.sum(attention_mask, axis=-1))
    return (jnp.arange(frames)[None, :] < lengths[:, None]).astype(jnp.int32)


def generate_ids(model, params, inputs, prompt, settings, attention_mask=None):
    """The generated token ids [rows, settings.max_length] of `inputs` (input features), each row
    started from `prompt` (traceable). Through the generic Flax `generate`: Whisper's override
    writes task, language and forced tokens into the config it is given. With the waveform's
    `attention_mask` (a speech encoder-decoder), the encoder runs here and the decoder gets the mask
    of its frames: `generate` would pass the sample mask on to the cross-attention, of another length."""
    from transformers.generation.flax_utils import FlaxGenerationMixin

    rows = inputs.shape[0]
    decoder_input_ids = jnp.broadcast_to(jnp.asarray(prompt), (rows, len(prompt)))
    kwargs = {}
    if attention_mask is not None:
        encoded = model.encode(inputs, attention_mask=attention_mask, params=params)
        kwargs = dict(encoder_outputs=encoded,
                      attention_mask=frame_mask(model, attention_mask, encoded.last_hidden_state.shape[1]))
    return FlaxGenerationMixin.generate(model, inputs, generation_config=settings, params=params,
                                        decoder_input_ids=decoder_input_ids, **kwargs).sequences


def decode_texts(tokenizer, ids):
    """The transcript of each row of generated `ids`, special tokens dropped, surrounding spaces stripped."""
    return [text.strip() for text in tokenizer.batch_decode(ids, skip_special_tokens=True)]


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------
def normalize_text(text):
    """Lower case, punctuation and symbols replaced by spaces, whitespace collapsed (--do_normalize_eval)."""
    kept = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in text.lower())
    return re.sub(r"\s+", " ", kept).strip()


def edit_distance(reference, hypothesis):
    """Levenshtein distance between two sequences (substitutions, insertions, deletions all cost 1)."""
    previous = np.arange(len(hypothesis) + 1)
    for i, token in enumerate(reference, start=1):
        current = np.empty_like(previous)
        current[0] = i
        for j, other in enumerate(hypothesis, start=1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (token != other))
        previous = current
    return int(previous[-1])


def error_rate(references, hypotheses):
    """Edits summed over every pair of sequences, over the reference tokens summed (the corpus rate)."""
    edits = sum(edit_distance(ref, hyp) for ref, hyp in zip(references, hypotheses))
    return edits / max(sum(len(ref) for ref in references), 1)


def word_error_rate(references, hypotheses):
    return error_rate([r.split() for r in references], [h.split() for h in hypotheses])


def character_error_rate(references, hypotheses):
    return error_rate(references, hypotheses)


def recognition_metrics(references, hypotheses, normalize=False):
    """{"wer", "cer"} of the generated `hypotheses` against the `references` (optionally normalised)."""
    if normalize:
        references, hypotheses = [normalize_text(t) for t in references], [normalize_text(t) for t in hypotheses]
    return {"wer": word_error_rate(references, hypotheses), "cer": character_error_rate(references, hypotheses)}


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class Transcriber(Predictor):
    """run_speech_recognition_seq2seq.py's predict path for one clip: read and resampled by
    `tasks.audio`, the features of the feature extractor saved beside the model (a waveform padded to
    the run's --max_duration_in_seconds, with its mask), generation from the run's prompt (Whisper:
    its --language and --task) with its --max_label_length and --num_beams."""

    auto_class = "FlaxAutoModelForSpeechSeq2Seq"

    def __init__(self, output_dir, run_args):
        from transformers import AutoFeatureExtractor

        super().__init__(output_dir, run_args)
        self.extractor = AutoFeatureExtractor.from_pretrained(output_dir)
        self.features = Features(self.extractor, run_args.get("max_duration_in_seconds"))
        if self.config.model_type != JOINED:
            set_prefix(self.tokenizer, run_args.get("language"), run_args.get("task") or "transcribe")
        prompt = prompt_of(self.tokenizer, self.config)
        settings = generation_settings(self.model, label_length(run_args["max_label_length"], self.config),
                                       run_args.get("num_beams") or self.model.generation_config.num_beams)
        self._generate = jax.jit(lambda params, inputs, mask: generate_ids(self.model, params, inputs, prompt,
                                                                           settings, mask))

    def _mask(self, seconds):
        """The waveform's attention mask [1, samples] of a clip lasting `seconds`; None for Whisper."""
        if not self.features.raw:
            return None
        return AudioMask(self.features.sample_counts([seconds]), self.features.samples)[0]

    def predict(self, clip_bytes):
        if not clip_bytes:
            raise BadInput("no audio: upload a WAV file (or record one)")
        clip_bytes = bytes(clip_bytes)
        try:
            seconds = audio.clip_seconds(clip_bytes)
            inputs = self.features(clip_bytes)
        except (audio.AudioError, EOFError, ValueError) as e:
            raise BadInput(f"the file is not audio that can be read ({e}): upload a WAV file") from e
        answer = Answer()
        limit = self.features.longest_seconds
        if seconds > limit:
            answer.notes.append(f"the clip lasts {seconds:.1f} s; the model hears at most {limit:g} s, so only the "
                                f"first {limit:g} s were transcribed")
        ids = self._generate(self.params, inputs[None], self._mask(seconds))
        answer.text = decode_texts(self.tokenizer, np.asarray(ids))[0]
        return answer

    def warm_up(self):
        silence = np.zeros((1, *self.features.shape), np.float32)
        jax.block_until_ready(self._generate(self.params, silence, self._mask(self.features.longest_seconds)))


PREDICTOR = Transcriber


def demo_form(st, predictor):
    with st.form("request"):
        upload = st.file_uploader("Audio (WAV)", key="audio")
        recorded = st.audio_input("Or record", key="recording") if hasattr(st, "audio_input") else None
        submitted = st.form_submit_button("Transcribe")
    if submitted:
        clip = recorded if recorded is not None else upload
        return lambda: show_answer(st, predictor(clip.getvalue() if clip is not None else b""))
