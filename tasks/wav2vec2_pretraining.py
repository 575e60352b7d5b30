"""wav2vec2 pretraining (`run_wav2vec2_pretrain_flax.py`): raw clips as the model's input, the
masked spans and the negatives, the Gumbel temperature, the contrastive and diversity losses, the
codevector perplexity, and the demo's page.

- clips: read, checked and filtered by duration as speech recognition reads them
  (`tasks.speech_recognition.load_clips`, no transcript needed); `Waveforms` resamples each to the
  feature extractor's rate and runs the model's own `Wav2Vec2FeatureExtractor` on it (zero mean, unit
  variance), padded to one length for every batch (--max_duration_in_seconds rounded up to
  --pad_to_multiple_of samples: one compiled step), with its attention mask.
- masks and negatives: `Masking` is the batches' host transform: for each row, spans of
  `mask_time_length` frames start at random frames (about `mask_time_prob` of the clip's real frames
  masked, at least `MIN_SPANS` spans), and each masked frame gets `num_negatives` distractors drawn
  uniformly from the other masked frames of the same clip (wav2vec 2.0's sampling, and transformers'
  PyTorch pretraining's). A row's draw is a pure function of (seed, step, its row in the global
  batch): a resumed run masks exactly as the uninterrupted one; evaluation draws by example, the
  same at every evaluation.
- keys and temperature: `step_keys` folds the step's key (of the seed and the step, `utils.layout.layouts`)
  into two: one for dropout, one for the Gumbel noise (the classic script gave both the same key);
  `gumbel_temperature` is max(max * decay ** step, min), carried in the batch.
- loss: `pretraining_loss` sums the contrastive loss (cosine similarity / the config's
  `contrastive_logits_temperature`, log-softmax over the true quantized frame and its negatives, a
  negative equal to the positive left out) over the masked frames, and adds the weighted diversity
  loss, (G V - perplexity) / (G V) per masked frame; the spine divides by the masked frames of the
  global batch (the classic script never divided the sum). The codevector perplexity is the model's,
  over each device's masked frames (soft in training, hard at evaluation), reported as its mean over
  the masked frames; `PerplexityWatch` warns when it collapses (transformers issue 19588).
"""

import logging
import math
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task, audio
from tasks.demo import Answer, BadInput, Predictor, show_answer
from utils.base.errors import UsageError

INPUT = "input_values"
MIN_SPANS = 2  # at least two masked spans per clip, so every masked frame has others to be told from
COSINE_EPSILON = 1e-8  # torch.cosine_similarity's: the product of the norms is at least this
logger = logging.getLogger(__name__)


def check_arguments(model_args, data_args, training_args):
    """The flags that have nothing to act on in pretraining."""
    if training_args.label_smoothing_factor:
        raise UsageError("--label_smoothing_factor has no labels to smooth in wav2vec2 pretraining: drop it")
    if training_args.do_predict:
        raise UsageError("--do_predict: wav2vec2 pretraining predicts nothing; evaluate with --do_eval")


# Clips without transcripts: the audio column alone is checked.
TASK = Task("wav2vec2-pretraining", "feature-extraction", file_formats=audio.FILE_FORMATS,
            check_arguments=check_arguments, check_data=partial(audio.check_columns, transcribed=False))


# ----------------------------------------------------------------------------------------------
# The model as `utils.models.loading.load_model` builds one
# ----------------------------------------------------------------------------------------------
class PretrainingModel:
    """`FlaxWav2Vec2ForPreTraining` with the two constructors `utils.models.loading.load_model` calls on an
    auto class (transformers has no auto class for it, and the class itself no `from_config`)."""

    @staticmethod
    def from_config(config, trust_remote_code=False, **kwargs):
        from transformers import FlaxWav2Vec2ForPreTraining

        return FlaxWav2Vec2ForPreTraining(config, **kwargs)  # a class of transformers': no remote code

    @staticmethod
    def from_pretrained(name, **kwargs):
        from transformers import FlaxWav2Vec2ForPreTraining

        return FlaxWav2Vec2ForPreTraining.from_pretrained(name, **kwargs)


def fit_config(config, model_args):
    """The config with the flags that override it (masking, negatives, diversity weight): the export
    keeps what the run trained with."""
    for name in ("mask_time_prob", "mask_time_length", "num_negatives", "diversity_loss_weight"):
        value = getattr(model_args, name)
        if value is not None:
            setattr(config, name, value)
    return config


def frame_lengths(config, samples):
    """The frames the convolutional feature encoder makes of `samples` samples (an int or an array)."""
    for kernel, stride in zip(config.conv_kernel, config.conv_stride):
        samples = (samples - kernel) // stride + 1
    return samples


def codebook_size(config):
    return config.num_codevector_groups * config.num_codevectors_per_group


# ----------------------------------------------------------------------------------------------
# Features: the samples themselves, normalised and padded to one length
# ----------------------------------------------------------------------------------------------
def padded_samples(max_seconds, rate, pad_to_multiple_of=None):
    """The length every clip is padded to: `max_seconds` of samples, rounded up to a multiple."""
    samples = math.ceil(max_seconds * rate)
    return -(-samples // pad_to_multiple_of) * pad_to_multiple_of if pad_to_multiple_of else samples


class Waveforms:
    """A clip -> {"input_values": float32 [length], "attention_mask": int32 [length]}: loaded,
    resampled to the extractor's rate, normalised by the extractor, padded to `length` samples."""

    input_name = INPUT

    def __init__(self, extractor, length):
        self.extractor, self.length = extractor, length
        self.shapes = {INPUT: (length,), "attention_mask": (length,)}

    def __call__(self, source):
        samples = audio.load(source, self.extractor.sampling_rate)[:self.length]
        out = self.extractor(samples, sampling_rate=self.extractor.sampling_rate, padding="max_length",
                             max_length=self.length, return_attention_mask=True, return_tensors="np")
        return {INPUT: out[INPUT][0].astype(np.float32), "attention_mask": out["attention_mask"][0].astype(np.int32)}


# ----------------------------------------------------------------------------------------------
# Masks, negatives, Gumbel temperature, keys
# ----------------------------------------------------------------------------------------------
def sample_row(length, frames, mask_prob, mask_length, num_negatives, rng):
    """(mask bool [frames], negatives int32 [frames, num_negatives]) of one clip of `length` real frames.

    Spans of `mask_length` frames (shorter for a clip too short for one) start at distinct random
    frames, about mask_prob x length / mask_length of them (at least `MIN_SPANS`; overlapping spans
    mask fewer frames), inside the real frames. Each masked frame's negatives are other masked frames
    of the clip, uniformly with replacement; an unmasked frame's are unused (0)."""
    mask = np.zeros(frames, bool)
    negatives = np.zeros((frames, num_negatives), np.int32)
    if length < 2:
        return mask, negatives
    span = min(mask_length, length - 1)
    starts = length - span + 1
    spans = min(max(int(mask_prob * length / span + rng.random()), MIN_SPANS), starts)
    begins = rng.choice(starts, spans, replace=False)
    mask[(begins[:, None] + np.arange(span)).ravel()] = True
    positions = np.flatnonzero(mask)
    draws = rng.integers(0, len(positions) - 1, size=(len(positions), num_negatives))
    draws += draws >= np.arange(len(positions))[:, None]  # skip the frame itself, uniform over the others
    negatives[positions] = positions[draws]
    return mask, negatives


def gumbel_temperature(step, max_temperature, min_temperature, decay):
    """The Gumbel softmax temperature of `step`: max(max x decay ** step, min)."""
    return max(max_temperature * decay ** step, min_temperature)


class Masking:
    """The host transform of every batch (`transform(batch, step, row_ids)` of `utils.run.loop`): adds
    "mask_time_indices" (bool [rows, frames]) and "negatives" (int32 [rows, frames, K]), each row's a
    pure function of (seed, step, row); in training (`temperatures`: (max, min, decay)) also the
    step's "gumbel_temperature" (float32 [rows], one value)."""

    TRAIN, EVAL = 0, 1  # separate streams of draws

    def __init__(self, config, seed, temperatures=None):
        self.config, self.seed, self.temperatures = config, seed, temperatures

    def __call__(self, batch, step, row_ids):
        config = self.config
        mask = np.asarray(batch["attention_mask"])
        frames = int(frame_lengths(config, mask.shape[1]))
        lengths = np.minimum(frame_lengths(config, mask.sum(axis=1)), frames)
        stream = self.TRAIN if self.temperatures else self.EVAL
        rows = [sample_row(int(length), frames, config.mask_time_prob, config.mask_time_length, config.num_negatives,
                           np.random.default_rng([self.seed, stream, int(step), int(row)]))
                for length, row in zip(lengths, row_ids)]
        batch = {**batch, "mask_time_indices": np.stack([row[0] for row in rows]),
                 "negatives": np.stack([row[1] for row in rows])}
        if self.temperatures:
            batch["gumbel_temperature"] = np.full(len(rows), gumbel_temperature(step, *self.temperatures), np.float32)
        return batch


def step_keys(rng):
    """(dropout key, Gumbel key): two keys folded from the step's key (itself of the seed, the step and
    the device), so the dropout masks and the Gumbel noise are independent draws."""
    return jax.random.fold_in(rng, 0), jax.random.fold_in(rng, 1)


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def contrastive_sums(projected, quantized, mask, negatives, temperature):
    """(sum over the masked frames of -log p(true quantized frame), masked frames).

    `projected`, `quantized`: [rows, frames, dim]; `mask`: [rows, frames] (0 on frames not scored);
    `negatives`: int32 [rows, frames, K], frames of the same row. The logits are cosine similarities
    over `temperature`; a negative identical to the positive is left out of the softmax."""
    projected, quantized = projected.astype(jnp.float32), quantized.astype(jnp.float32)
    distractors = jax.vmap(lambda q, idx: q[idx])(quantized, negatives)  # [rows, frames, K, dim]
    candidates = jnp.concatenate([quantized[:, :, None], distractors], axis=2)  # the positive first
    norms = jnp.linalg.norm(projected, axis=-1)[..., None] * jnp.linalg.norm(candidates, axis=-1)
    logits = jnp.einsum("btd,btkd->btk", projected, candidates) / jnp.maximum(norms, COSINE_EPSILON) / temperature
    same = jnp.all(distractors == quantized[:, :, None], axis=-1)
    logits = logits.at[..., 1:].set(jnp.where(same, -jnp.inf, logits[..., 1:]))
    losses = -jax.nn.log_softmax(logits, axis=-1)[..., 0]
    weights = mask.astype(jnp.float32)
    return (losses * weights).sum(), weights.sum()


def diversity_loss(perplexity, config):
    """(G V - perplexity) / (G V): 0 when every codevector of every group is used alike."""
    size = codebook_size(config)
    return (size - perplexity) / size


def scored_mask(batch):
    """The masked frames scored: padded rows (`example_weight` 0) have none."""
    mask = batch["mask_time_indices"]
    if "example_weight" in batch:
        mask = mask & (batch["example_weight"][:, None] > 0)
    return mask


def pretraining_loss(projected, quantized, perplexity, mask, negatives, config, diversity_weight, temperature=None):
    """(loss sum, sums) for the spine (`utils.layout.gradients`): the contrastive loss summed over the masked
    frames plus `diversity_weight` x the diversity loss per masked frame; "tokens" counts the masked
    frames, so the spine's division makes the mean contrastive loss over the global batch's masked
    frames plus the weighted diversity loss. "contrastive_loss", "diversity_loss",
    "codevector_perplexity" (and with `temperature` "gumbel_temperature") are sums weighted by the
    masked frames: the logs and results show their means. A batch without a masked frame (padding
    only) adds nothing (the model's perplexity of it is 0 / 0)."""
    contrastive, count = contrastive_sums(projected, quantized, mask, negatives, config.contrastive_logits_temperature)
    perplexity = jnp.where(count > 0, perplexity, 0.0)
    diversity = diversity_loss(perplexity, config) * count
    loss = contrastive + diversity_weight * diversity
    sums = {"loss": loss, "tokens": count, "contrastive_loss": contrastive, "diversity_loss": diversity,
            "codevector_perplexity": perplexity * count}
    if temperature is not None:
        sums["gumbel_temperature"] = temperature * count
    return loss, sums


class PerplexityWatch:
    """Warns (once per kind of measure) when the codevector perplexity falls towards its floor (one
    codevector per group, G): below `COLLAPSE_FRACTION` of the G x V codevectors, or below 2 G.
    Collapsed codebooks make the contrastive task trivial (transformers issue 19588)."""

    COLLAPSE_FRACTION = 0.1

    def __init__(self, config):
        self.size, self.groups = codebook_size(config), config.num_codevector_groups
        self.floor = max(self.COLLAPSE_FRACTION * self.size, 2 * self.groups)
        self.warned = set()

    def check(self, perplexity, where, step):
        """True (and a warning, the first time for `where`) when `perplexity` has collapsed."""
        collapsed = bool(perplexity < self.floor)
        if collapsed and where not in self.warned:
            self.warned.add(where)
            logger.warning("%s codevector perplexity %.2f at step %d: the codebook has collapsed towards its floor "
                           "(%d of %d codevectors; warned below %.1f): raise --diversity_loss_weight, or lower the "
                           "learning rate or --gumbel_temperature_decay's pace", where, perplexity, step, self.groups,
                           self.size, self.floor)
        return collapsed


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): what the pretrained model makes of a clip
# ----------------------------------------------------------------------------------------------
class CodebookProbe(Predictor):
    """A pretrained wav2vec2 predicts nothing a user reads: the page shows what the model makes of an
    uploaded clip, its frames and the hard codevector perplexity of their quantized features (how many
    codevectors the clip uses, of the G x V), read and featurised as `run_wav2vec2_pretrain_flax.py`
    reads its clips (`Waveforms`, padded to the run's --max_duration_in_seconds)."""

    auto_class = "FlaxWav2Vec2ForPreTraining"

    def __init__(self, output_dir, run_args):
        from transformers import AutoFeatureExtractor

        super().__init__(output_dir, run_args)
        extractor = AutoFeatureExtractor.from_pretrained(output_dir)
        self.max_seconds = run_args["max_duration_in_seconds"]
        self.waveforms = Waveforms(extractor, padded_samples(self.max_seconds, extractor.sampling_rate,
                                                             run_args.get("pad_to_multiple_of")))

        def perplexity(params, inputs, attention_mask):
            frames = jnp.arange(frame_lengths(self.config, inputs.shape[1]))
            real = frames[None] < frame_lengths(self.config, attention_mask.sum(axis=1))[:, None]
            return self.model(inputs, attention_mask=attention_mask, mask_time_indices=real, params=params,
                              train=False).codevector_perplexity

        self._perplexity = jax.jit(perplexity)

    def load_tokenizer(self):
        return None  # audio only

    def predict(self, clip_bytes):
        if not clip_bytes:
            raise BadInput("no audio: upload a WAV file")
        clip_bytes = bytes(clip_bytes)
        try:
            seconds = audio.clip_seconds(clip_bytes)
            inputs = self.waveforms(clip_bytes)
        except (audio.AudioError, EOFError, ValueError) as e:
            raise BadInput(f"the file is not audio that can be read ({e}): upload a WAV file") from e
        frames = int(frame_lengths(self.config, int(inputs["attention_mask"].sum())))
        if frames < 1:
            raise BadInput("the clip is too short for the model's feature encoder: upload a longer one")
        answer = Answer()
        if seconds > self.max_seconds:
            answer.notes.append(f"the clip lasts {seconds:.1f} s; the run read at most {self.max_seconds:g} s, so "
                                f"only the first {self.max_seconds:g} s were heard")
        value = float(self._perplexity(self.params, inputs[INPUT][None], inputs["attention_mask"][None]))
        answer.text = (f"{frames} frames; codevector perplexity {value:.2f} of {codebook_size(self.config)} "
                       "codevectors")
        return answer

    def warm_up(self):
        shape = (1, self.waveforms.length)
        jax.block_until_ready(self._perplexity(self.params, np.zeros(shape, np.float32), np.ones(shape, np.int32)))


PREDICTOR = CodebookProbe


def demo_form(st, predictor):
    with st.form("request"):
        upload = st.file_uploader("Audio (WAV)", key="audio")
        submitted = st.form_submit_button("Quantize")
    if submitted:
        return lambda: show_answer(st, predictor(upload.getvalue() if upload is not None else b""))
