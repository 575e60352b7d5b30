"""Masked language modelling (`run_mlm_flax.py`): examples (blocks or padded lines), BERT masking on
the host, the masked-token loss, accuracy and perplexity, and the fill-mask demo."""

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task, lm
from tasks.demo import (Answer, BadInput, Predictor, bucket_for, buckets, escape_markdown, require_text, show_answer,
                        shown_token, truncation_note)
from utils.base.errors import UsageError
from utils.data import batch_order

TOP_K = 10  # the fill-mask table shows at most this many tokens per mask (one compiled top-k)

TASK = Task("masked-lm", "fill-mask", widget="mask", **lm.INPUTS)


# ----------------------------------------------------------------------------------------------
# Examples
# ----------------------------------------------------------------------------------------------
def fit_sequence_length(data_args, tokenizer, config):
    """--max_seq_length, by default min(512, the tokenizer's max length); at most the model's positions."""
    return lm.sequence_length(data_args.max_seq_length, 512, tokenizer, config, "max_seq_length")


def read_examples(data_args, training_args, tokenizer, seq_length, cache_dir):
    """(train data, validation arrays or None): `seq_length` blocks of the text, or with --line_by_line
    one padded example per line; streamed (--streaming) or read into memory, where a split without
    one example fails."""
    # Blocks are all real tokens; padded lines also need their attention mask.
    encoder, tokenize, columns = (
        (lm.Lines(tokenizer, seq_length), lm.tokenize_lines, ("input_ids", "attention_mask")) if data_args.line_by_line
        else (lm.Blocks(tokenizer, seq_length), lm.tokenize_and_group, ("input_ids",)))
    return lm.read_examples(
        data_args, training_args, encoder,
        lambda raw, text_column: tokenize(raw, tokenizer, text_column, seq_length, data_args), columns,
        lambda split: f"the {split} data has no text (or, in blocks, fewer than --max_seq_length {seq_length} "
                      "tokens): add text, lower --max_seq_length or use --line_by_line", cache_dir)


# ----------------------------------------------------------------------------------------------
# Masking
# ----------------------------------------------------------------------------------------------
def mask_tokens(input_ids, special_ids, mask_token_id, replacement_ids, probability, draws):
    """BERT masking: (inputs, selected) with `selected` 1.0 where the model must predict the token.

    Each token that is not special (padding is special) is selected with `probability`; of those 80%
    become the mask token, 10% a random ordinary token, 10% stay as they are. The labels are the
    original `input_ids`, weighted by `selected`. `draws` holds three uniform [0, 1) arrays shaped
    like `input_ids` (selection, action, which replacement): the masks are a function of them alone.
    """
    selection, action, replacement = draws
    selected = (selection < probability) & ~np.isin(input_ids, special_ids)
    random_ids = replacement_ids[(replacement * len(replacement_ids)).astype(np.int64)]
    inputs = np.where(selected & (action < 0.8), mask_token_id, input_ids)
    inputs = np.where(selected & (action >= 0.8) & (action < 0.9), random_ids, inputs)
    return inputs.astype(input_ids.dtype), selected.astype(np.float32)


def masking(tokenizer, probability, seed, stream):
    """`transform(batch, step, row_ids)` for `loop.train_batches` / `loop.eval_batches` / streams.

    Row i of the batch is masked from its own random numbers, drawn from (seed, stream, step,
    row_ids[i]): a training example's mask depends on the step and its row in the global batch,
    an evaluation example's (step 0) on its index alone. So a resumed run masks exactly as the
    uninterrupted one, every evaluation sees the same masks, and neither depends on the number of
    devices or processes, or on the eval batch size. Adds `labels` (the original ids) and
    `label_weights` (1 at the tokens to predict).
    """
    if tokenizer.mask_token_id is None:
        raise UsageError("the tokenizer has no mask token, which masked LM needs: use one with a mask token "
                         "(e.g. <mask> or [MASK])")
    special_ids = np.array(sorted(set(tokenizer.all_special_ids)))
    replacement_ids = np.setdiff1d(np.arange(len(tokenizer)), special_ids)

    def transform(batch, step, row_ids):
        draws = batch_order.row_uniforms((seed, stream, step), row_ids, batch["input_ids"].shape, count=3)
        inputs, weights = mask_tokens(batch["input_ids"], special_ids, tokenizer.mask_token_id, replacement_ids,
                                      probability, draws)
        return {**batch, "input_ids": inputs, "labels": batch["input_ids"], "label_weights": weights}

    return transform


def train_eval_masking(tokenizer, probability, seed):
    """(train transform, eval transform): `masking` from the training and the evaluation random
    streams, which never coincide."""
    return tuple(masking(tokenizer, probability, seed, stream) for stream in (lm.TRAIN_STREAM, lm.EVAL_STREAM))


def check_masking_density(probability, seq_length, batch_size):
    """A density that masks less than one token of a training batch on average leaves most steps
    nothing to learn, and a logging window without a masked token no loss to report: refused before
    any work (`batch_size`: the global batch of `seq_length`-token rows)."""
    expected = probability * seq_length * batch_size
    if expected < 1:
        raise UsageError(f"--mlm_probability {probability:g} masks {expected:.2g} tokens of a training batch of "
                         f"{batch_size} x {seq_length} tokens on average, less than one, so most steps would learn "
                         "nothing: raise it (BERT's is 0.15), or the batch size or --max_seq_length")


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def masked_token_loss(logits, labels, label_weights, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "accuracy", "tokens"}) over the tokens the masking selected.

    Only tokens with `label_weights` 1 count, for the loss and for the accuracy: the others are
    visible in the input, and predicting them would be copying. `example_weight` (eval: 0 for
    padded rows) scales a row's tokens.
    """
    return lm.token_sums(logits, labels, label_weights, example_weight, label_smoothing, accuracy=True)


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class MaskFiller(Predictor):
    """The top-k tokens (as decoded alone, spaces included) with their probabilities for each mask
    token in a text."""

    auto_class = "FlaxAutoModelForMaskedLM"

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        self.input_buckets = buckets(run_args.get("max_seq_length") or self.tokenizer.model_max_length)

        def top_tokens(params, ids, mask):
            logits = self.model(ids, attention_mask=mask, params=params).logits
            return jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), TOP_K)

        self._top = jax.jit(top_tokens)

    def predict(self, text, top_k=5):
        require_text(text, "text")
        mask_token = self.tokenizer.mask_token
        if mask_token not in text:
            raise BadInput(f"the text has no {mask_token}: put {mask_token} where a word is missing")
        if not 1 <= top_k <= TOP_K:
            raise BadInput(f"top-k must be between 1 and {TOP_K}, got {top_k}")
        answer = Answer()
        ids = self.tokenizer(text)["input_ids"]
        limit = self.input_buckets[-1]
        if len(ids) > limit:
            answer.notes.append(truncation_note(len(ids), limit))
            ids = self.tokenizer(text, truncation=True, max_length=limit)["input_ids"]
        positions = [i for i, token in enumerate(ids) if token == self.tokenizer.mask_token_id]
        if not positions:
            raise BadInput(f"every {mask_token} is past the model's {limit} tokens: move one into the first part")
        size = bucket_for(len(ids), self.input_buckets)
        padded = np.full((1, size), self.tokenizer.pad_token_id, np.int32)
        padded[0, :len(ids)] = ids
        probabilities, token_ids = (np.asarray(x) for x in self._top(
            self.params, padded, (np.arange(size) < len(ids)).astype(np.int32)[None]))
        filled = list(ids)
        for position in positions:
            top = zip(token_ids[0, position, :top_k], probabilities[0, position, :top_k])
            answer.details.append([(self.tokenizer.decode([token]), float(p)) for token, p in top])
            filled[position] = int(token_ids[0, position, 0])
        answer.text = self.tokenizer.decode(filled, skip_special_tokens=True)
        return answer

    def warm_up(self):
        for size in self.input_buckets:
            ids = np.full((1, size), self.tokenizer.pad_token_id, np.int32)
            jax.block_until_ready(self._top(self.params, ids, np.ones_like(ids)))


PREDICTOR = MaskFiller


def demo_form(st, predictor):
    mask = predictor.tokenizer.mask_token
    with st.form("request"):
        text = st.text_input(f"Text with {mask}", key="text")
        top_k = st.slider("Top k", 1, TOP_K, 5, key="top_k")
        submitted = st.form_submit_button("Fill")
    if submitted:
        def show():
            answer = predictor(text, int(top_k))
            show_answer(st, answer)
            for number, candidates in enumerate(answer.details, start=1):
                st.table({f"{escape_markdown(mask)} {number}": [shown_token(token) for token, _ in candidates],
                          "probability": [f"{p:.3f}" for _, p in candidates]})
        return show
