"""T5 span corruption (`run_t5_mlm_flax.py`): the lengths it needs, the raw blocks, the masking itself
on the host (pure numpy), the loss over the targets, and the span-filling demo.

A raw block of `raw_length` tokens gets `noise_tokens` noise tokens in `noise_spans` spans that
alternate with as many non-noise spans; each example starts with a noise span or a non-noise one at
random (the other kind then ends it). Each noise span becomes one sentinel in the inputs
(`<extra_id_0>`, `<extra_id_1>`, ... in order); the targets are each sentinel followed by its span's
tokens. EOS ends both. So, whichever kind comes first:

    inputs:  raw_length - noise_tokens + noise_spans + 1 tokens
    targets: noise_tokens + noise_spans + 1 tokens

`plan_span_corruption` finds the raw length that makes the inputs exactly `--max_seq_length` long
and checks the tokenizer, before any work; `span_corruption` masks batches of raw blocks, each row
from its own random numbers drawn from (seed, stream, step, the row's place in the global batch),
like `tasks.masked_lm.masking`. The flags named in the errors are those of `run_t5_mlm_flax.py`:
--max_seq_length, --mlm_probability (the noise density, under its classic name) and
--mean_noise_span_length.
"""

import logging
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from tasks import Task, lm
from tasks.demo import Answer, BadInput, Predictor, bucket_for, buckets, require_text, show_answer, truncation_note
from utils.base.errors import UsageError
from utils.data import batch_order
from utils.models.loading import fit_length, max_positions

TASK = Task("span-corruption", "text2text-generation", widget="sentinel", **lm.INPUTS)
# The families with sentinel-token pretraining and a Flax class in transformers 4.57 (UMT5 has none).
MODEL_TYPES = ("t5", "mt5", "longt5")
logger = logging.getLogger(__name__)

SENTINEL = "<extra_id_{}>"


class SpanLengths(NamedTuple):
    raw_length: int
    input_length: int
    target_length: int
    noise_tokens: int
    noise_spans: int


def span_counts(raw_length, noise_density, mean_noise_span_length):
    """(noise tokens, noise spans) for a raw block: T5's rounding, kept to what can be laid out.

    At least one noise token and one non-noise token; at least one span, and no more spans than
    there are tokens of either kind (every span, noise or not, holds one token or more).
    """
    noise = min(max(round(raw_length * noise_density), 1), raw_length - 1)
    spans = min(max(round(noise / mean_noise_span_length), 1), noise, raw_length - noise)
    return noise, spans


def _input_length(raw_length, noise_density, mean_noise_span_length):
    noise, spans = span_counts(raw_length, noise_density, mean_noise_span_length)
    return raw_length - noise + spans + 1


def span_corruption_lengths(max_seq_length, noise_density, mean_noise_span_length):
    """`SpanLengths` whose inputs are exactly `max_seq_length` tokens (EOS included).

    Of the raw lengths that give that input length, the longest (at density 0.5, one less when that
    keeps the targets from being longer than the inputs, as T5's helper does). Raises UsageError when the
    arguments are out of range or no raw length gives exactly `max_seq_length`.
    """
    if not 0 < noise_density < 1:
        raise UsageError(f"--mlm_probability (the noise density) must be between 0 and 1 (exclusive), got "
                         f"{noise_density}")
    if not 1 <= mean_noise_span_length < math.inf:
        raise UsageError(f"--mean_noise_span_length must be at least 1 and finite (a span holds one token or more), "
                         f"got {mean_noise_span_length}")

    def input_length(raw_length):
        return _input_length(raw_length, noise_density, mean_noise_span_length)

    # The input length never decreases as the raw length grows (the noise count grows by at most
    # one token per token), so the longest raw length fitting is a binary search. Past `high` even
    # the non-noise tokens alone, about raw_length x (1 - density), outgrow max_seq_length.
    low, high = 1, int((max_seq_length - 1.5) / (1 - noise_density)) + 2
    while high - low > 1:  # invariant: input_length(low) <= max_seq_length < input_length(high), or low == 1
        middle = (low + high) // 2
        low, high = (middle, high) if input_length(middle) <= max_seq_length else (low, middle)
    if low >= 2 and input_length(low) == max_seq_length:
        noise, spans = span_counts(low, noise_density, mean_noise_span_length)
        # At half noise T5's length helper (and the classic script) drops one raw token when the
        # targets come out one longer than the inputs, so both are the same round number: the
        # same here, whenever the inputs stay exact.
        if (noise_density == 0.5 and noise + spans + 1 > max_seq_length and low >= 3
                and input_length(low - 1) == max_seq_length):
            low -= 1
            noise, spans = span_counts(low, noise_density, mean_noise_span_length)
        return SpanLengths(low, max_seq_length, noise + spans + 1, noise, spans)
    nearest = ([input_length(low)] if low >= 2 else []) + [input_length(low + 1)]
    raise UsageError(
        f"no raw length gives exactly {max_seq_length} input tokens with --mlm_probability {noise_density} and "
        f"--mean_noise_span_length {mean_noise_span_length}: use --max_seq_length "
        f"{' or '.join(map(str, nearest))}, or change the density or span length"
    )


def sentinel_ids(tokenizer, count):
    """The ids of `<extra_id_0>` ... `<extra_id_{count-1}>`; UsageError when the tokenizer lacks some."""
    vocab = tokenizer.get_vocab()
    available = 0
    while SENTINEL.format(available) in vocab:
        available += 1
    if available == 0:
        raise UsageError("the tokenizer has no sentinel tokens (<extra_id_0>, <extra_id_1>, ...), which span "
                         "corruption needs: use a T5 tokenizer, or train one with train_tokenizer.py --extra_ids 100")
    if available < count:
        raise UsageError(f"span corruption needs {count} sentinel tokens per example but the tokenizer has only "
                         f"{available} (<extra_id_0> to <extra_id_{available - 1}>): lower --max_seq_length or "
                         "--mlm_probability, raise --mean_noise_span_length, or use a tokenizer with more sentinels")
    return np.array([vocab[SENTINEL.format(i)] for i in range(count)])


@dataclass(frozen=True)
class SpanCorruption:
    """What the T5 MLM script needs to know before loading data: the lengths and the token ids."""

    lengths: SpanLengths
    sentinel_ids: np.ndarray
    eos_id: int


def plan_span_corruption(tokenizer, max_seq_length, noise_density, mean_noise_span_length):
    """Every check span corruption needs, up front: lengths, EOS, enough sentinels."""
    lengths = span_corruption_lengths(max_seq_length, noise_density, mean_noise_span_length)
    if tokenizer.eos_token_id is None:
        raise UsageError("the tokenizer has no EOS token, which ends span-corrupted inputs and targets: "
                         "use one with an EOS token (e.g. </s>)")
    return SpanCorruption(lengths, sentinel_ids(tokenizer, lengths.noise_spans), tokenizer.eos_token_id)


def fit_plan(data_args, tokenizer, config):
    """`plan_span_corruption` for --max_seq_length fitted to the model's positions (the T5 family
    has relative ones: no limit), logged."""
    seq_length = fit_length(data_args.max_seq_length, max_positions(config), "max_seq_length", logger)
    plan = plan_span_corruption(tokenizer, seq_length, data_args.mlm_probability, data_args.mean_noise_span_length)
    lengths = plan.lengths
    logger.info("span corruption: raw blocks of %d tokens -> inputs of %d, targets of %d (%d noise tokens in %d "
                "spans)", lengths.raw_length, seq_length, lengths.target_length, lengths.noise_tokens,
                lengths.noise_spans)
    return plan


def read_raw_blocks(data_args, training_args, tokenizer, plan, cache_dir):
    """(train data, validation arrays or None): the text tokenized, concatenated and cut into the raw
    blocks of `plan`; streamed (--streaming) or read into memory, where a split without one block fails."""
    raw_length, seq_length = plan.lengths.raw_length, plan.lengths.input_length
    return lm.read_examples(
        data_args, training_args, lm.Blocks(tokenizer, raw_length),
        lambda raw, text_column: lm.tokenize_and_group(raw, tokenizer, text_column, raw_length, data_args),
        ("input_ids",),
        lambda split: f"the {split} data has fewer than {raw_length} tokens, the raw block that --max_seq_length "
                      f"{seq_length} needs: lower --max_seq_length or add text", cache_dir)


def random_compositions(total, parts, uniforms):
    """[rows, parts] positive integers, each row summing to `total`, uniform over all such rows.

    `uniforms` [rows, total - 1]: independent uniform [0, 1) numbers, one per gap between tokens.
    """
    # The parts - 1 cuts are a uniformly random subset of the total - 1 gaps between tokens.
    rows = len(uniforms)
    gaps = uniforms.argsort(axis=1)[:, :parts - 1]
    cuts = np.sort(gaps, axis=1) + 1
    bounds = np.concatenate([np.zeros((rows, 1), int), cuts, np.full((rows, 1), total)], axis=1)
    return np.diff(bounds, axis=1)


def uniforms_per_row(raw_length):
    """How many random numbers `corrupt` takes per raw block of `raw_length` tokens: one per gap
    between two noise tokens or two non-noise tokens (the span lengths), one for the first kind."""
    return raw_length - 1


def corrupt(blocks, noise_tokens, noise_spans, sentinel_ids, eos_id, uniforms):
    """(inputs, targets) for `blocks` [rows, raw_length], as laid out in the module docstring.

    Every row has `noise_tokens` noise tokens in `noise_spans` spans (lengths random), and starts
    with a noise span with probability 1/2. `uniforms` [rows, uniforms_per_row(raw_length)] are the
    row's independent uniform [0, 1) numbers: a row's layout is a function of its own alone.
    """
    rows, raw_length = blocks.shape
    noise_lengths = random_compositions(noise_tokens, noise_spans, uniforms[:, :noise_tokens - 1])
    other_lengths = random_compositions(raw_length - noise_tokens, noise_spans, uniforms[:, noise_tokens - 1: -1])
    noise_first = uniforms[:, -1] < 0.5
    # Span lengths in order, [rows, 2 x noise_spans]: noise, other, noise, ... or other, noise, ...
    lengths = np.where(noise_first[:, None, None], np.stack([noise_lengths, other_lengths], axis=2),
                       np.stack([other_lengths, noise_lengths], axis=2)).reshape(rows, -1)
    starts = np.cumsum(lengths, axis=1) - lengths
    is_start = np.zeros((rows, raw_length), bool)
    is_start[np.arange(rows)[:, None], starts] = True
    span = np.cumsum(is_start, axis=1) - 1
    is_noise = (span % 2 == 0) == noise_first[:, None]
    # Noise spans sit at even or odd span indices: span // 2 numbers them 0, 1, ... either way.
    sentinels = sentinel_ids[span // 2]
    opens_noise = is_start & is_noise

    eos = np.full((rows, 1), eos_id)
    # Inputs: the non-noise tokens, and a sentinel where each noise span was.
    kept = np.where(opens_noise, sentinels, blocks)[~is_noise | opens_noise]
    inputs = np.concatenate([kept.reshape(rows, -1), eos], axis=1)
    # Targets: before each noise token a slot holding its span's sentinel if the token opens the
    # span; the noise tokens and the filled slots, in order.
    slots = np.stack([sentinels, blocks], axis=2).reshape(rows, -1)
    filled = np.stack([opens_noise, is_noise], axis=2).reshape(rows, -1)
    targets = np.concatenate([slots[filled].reshape(rows, -1), eos], axis=1)
    return inputs.astype(blocks.dtype), targets.astype(blocks.dtype)


def span_corruption(plan, decoder_start_token_id, seed, stream):
    """`transform(batch, step, row_ids)` for `loop.train_batches` / `loop.eval_batches` / streams.

    `batch["input_ids"]` [rows, raw_length] raw blocks become a T5 batch: `input_ids` [rows,
    max_seq_length], `labels` [rows, target_length], and `decoder_input_ids`, the labels shifted
    right after `decoder_start_token_id` (T5: the pad id). Row i is corrupted from its own random
    numbers, drawn from (seed, stream, step, row_ids[i]), as `tasks.masked_lm.masking` masks: a training
    example's corruption depends on the step and its row in the global batch, an evaluation
    example's (step 0) on its index alone. So it is the same on any number of devices and
    processes, a resumed run corrupts its batches exactly as the uninterrupted run would, and
    every evaluation sees the same ones.
    """
    lengths = plan.lengths

    def transform(batch, step, row_ids):
        blocks = batch["input_ids"]
        if blocks.shape[1] != lengths.raw_length:
            raise ValueError(f"span corruption expects blocks of {lengths.raw_length} tokens, got {blocks.shape[1]}")
        (uniforms,) = batch_order.row_uniforms((seed, stream, step), row_ids,
                                               (len(blocks), uniforms_per_row(blocks.shape[1])))
        inputs, labels = corrupt(blocks, lengths.noise_tokens, lengths.noise_spans, plan.sentinel_ids, plan.eos_id,
                                 uniforms)
        start = np.full((len(labels), 1), decoder_start_token_id, labels.dtype)
        return {"input_ids": inputs, "labels": labels,
                "decoder_input_ids": np.concatenate([start, labels[:, :-1]], axis=1)}

    return transform


def train_eval_corruption(plan, decoder_start_token_id, seed):
    """(train transform, eval transform): `span_corruption` from the training and the evaluation
    random streams, which never coincide."""
    return tuple(span_corruption(plan, decoder_start_token_id, seed, stream)
                 for stream in (lm.TRAIN_STREAM, lm.EVAL_STREAM))


def span_target_loss(logits, labels, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "accuracy", "tokens"}) over every target token: each sentinel, the tokens
    of its span, the final EOS.

    Span corruption gives every row exactly `target_length` real target tokens, so nothing is
    padding and every one counts (no `labels != pad` mask: it would drop nothing, or, were a pad
    id ever in the text, a real target). `example_weight` (eval: 0 for padded rows) scales a row's
    tokens.
    """
    return lm.token_sums(logits, labels, example_weight=example_weight, label_smoothing=label_smoothing,
                         accuracy=True)


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class SpanFiller(Predictor):
    """Fills T5's sentinels (`<extra_id_0>`, ...) as run_t5_mlm_flax.py trained the model: the text
    (sentinels in it) in, the spans after their sentinels out."""

    auto_class = "FlaxAutoModelForSeq2SeqLM"
    SENTINEL = re.compile(r"<extra_id_(\d+)>")

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        self.input_buckets = buckets(run_args.get("max_seq_length") or 512)
        self.max_length = min(64, self.input_buckets[-1])
        self._generate = jax.jit(lambda params, ids, mask: self.model.generate(
            ids, attention_mask=mask, params=params, max_length=self.max_length, num_beams=1).sequences)

    def predict(self, text):
        require_text(text, "text")
        sentinels = self.SENTINEL.findall(text)
        if not sentinels:
            raise BadInput("the text has no <extra_id_0>: put <extra_id_0>, <extra_id_1>, ... where spans are "
                           "missing")
        answer = Answer()
        ids = self.tokenizer(text)["input_ids"]
        limit = self.input_buckets[-1]
        if len(ids) > limit:
            answer.notes.append(truncation_note(len(ids), limit))
            ids = ids[:limit - 1] + [self.tokenizer.eos_token_id]
        size = bucket_for(len(ids), self.input_buckets)
        padded = np.full((1, size), self.config.pad_token_id, np.int32)
        padded[0, :len(ids)] = ids
        output = np.asarray(self._generate(self.params, padded, (padded != self.config.pad_token_id).astype(np.int32)))
        decoded = self.tokenizer.decode(output[0], skip_special_tokens=False)
        for token in (self.tokenizer.pad_token, self.tokenizer.eos_token):
            decoded = decoded.replace(token, "")
        # "<extra_id_0> a span <extra_id_1> another" -> {0: "a span", 1: "another"}
        pieces = self.SENTINEL.split(decoded)
        spans = {int(number): piece.strip() for number, piece in zip(pieces[1::2], pieces[2::2])}
        answer.details = [(f"<extra_id_{n}>", spans.get(int(n), "")) for n in sentinels]
        answer.text = self.SENTINEL.sub(lambda m: spans.get(int(m.group(1)), ""), text)
        return answer

    def warm_up(self):
        for size in self.input_buckets:
            ids = np.full((1, size), self.config.pad_token_id, np.int32)
            self._generate(self.params, ids, np.ones_like(ids)).block_until_ready()


PREDICTOR = SpanFiller


def demo_form(st, predictor):
    with st.form("request"):
        text = st.text_input("Text with <extra_id_0>, <extra_id_1>, ...", key="text")
        submitted = st.form_submit_button("Fill the spans")
    if submitted:
        def show():
            answer = predictor(text)
            show_answer(st, answer)
            st.table({"sentinel": [s for s, _ in answer.details], "span": [span for _, span in answer.details]})
        return show
