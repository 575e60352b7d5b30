"""Causal language modelling (`run_clm_flax.py`): the text in blocks, the next-token loss and
perplexity, and the text-generation demo."""

import jax
import numpy as np

from tasks import Task, lm
from tasks.demo import Answer, BadInput, Predictor, bucket_for, buckets, require_text, show_answer

TASK = Task("causal-lm", "text-generation", widget="prompt")


# ----------------------------------------------------------------------------------------------
# Examples
# ----------------------------------------------------------------------------------------------
def fit_block_size(data_args, tokenizer, config):
    """--block_size, by default min(1024, the tokenizer's max length); at most the model's positions."""
    return lm.sequence_length(data_args.block_size, 1024, tokenizer, config, "block_size")


def read_blocks(data_args, training_args, tokenizer, block_size, cache_dir):
    """(train data, validation arrays or None): the text tokenized, concatenated and cut into
    `block_size` blocks; streamed (--streaming) or read into memory, where a split without one
    block fails."""
    return lm.read_examples(
        data_args, training_args, lm.Blocks(tokenizer, block_size),
        lambda raw, text_column: lm.tokenize_and_group(raw, tokenizer, text_column, block_size, data_args),
        ("input_ids",),
        lambda split: f"the {split} data has fewer than --block_size {block_size} tokens: lower --block_size or "
                      "add text", cache_dir)


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def next_token_loss(logits, input_ids, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}) of predicting each next token of a block.

    The labels are the inputs shifted by one: position t predicts token t + 1, the last position
    nothing, so a block of n tokens scores n - 1. `example_weight` (eval: 0 for padded rows) scales
    a row's tokens.
    """
    return lm.token_sums(logits[:, :-1], input_ids[:, 1:], example_weight=example_weight,
                         label_smoothing=label_smoothing)


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class TextGenerator(Predictor):
    """Continues a prompt, greedily or by sampling with a seed. Prompts are left-padded to a bucket
    and every request generates `max_new_tokens` tokens, cut to the number asked for: the tokens
    before a cut do not depend on where it is (greedy, and sampling's per-step keys alike), so one
    program per (bucket, greedy or sampling) serves every length."""

    auto_class = "FlaxAutoModelForCausalLM"

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        positions = self.config.max_position_embeddings if hasattr(self.config, "max_position_embeddings") else None
        positions = positions or getattr(self.config, "n_positions", None) or 1024
        self.max_new_tokens = min(64, positions // 2)
        self.prompt_buckets = buckets(positions - self.max_new_tokens, smallest=32)
        self.pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else (
            self.config.eos_token_id or 0)
        self.eos_id = self.config.eos_token_id
        self._programs = {sample: jax.jit(lambda params, ids, mask, key, sample=sample: self.model.generate(
            ids, attention_mask=mask, params=params, max_new_tokens=self.max_new_tokens, do_sample=sample,
            prng_key=key, pad_token_id=self.pad_id, eos_token_id=self.eos_id).sequences) for sample in (False, True)}

    def predict(self, prompt, max_new_tokens=32, sample=False, seed=0):
        require_text(prompt, "prompt")
        if not 1 <= max_new_tokens <= self.max_new_tokens:
            raise BadInput(f"max new tokens must be between 1 and {self.max_new_tokens}, got {max_new_tokens}")
        answer = Answer()
        ids = self.tokenizer(prompt)["input_ids"]  # as training encoded its text (special tokens included)
        limit = self.prompt_buckets[-1]
        if len(ids) > limit:
            answer.notes.append(f"the prompt has {len(ids)} tokens; the model continues its last {limit}")
            ids = ids[-limit:]
        size = bucket_for(len(ids), self.prompt_buckets)
        padded = np.full((1, size), self.pad_id, np.int32)
        padded[0, size - len(ids):] = ids
        mask = np.zeros((1, size), np.int32)
        mask[0, size - len(ids):] = 1
        sequences = np.asarray(self._programs[sample](self.params, padded, mask, jax.random.PRNGKey(seed)))
        new = list(sequences[0, size:size + max_new_tokens])
        if self.eos_id is not None and self.eos_id in new:
            new = new[:new.index(self.eos_id)]
        answer.text = self.tokenizer.decode(ids + new, skip_special_tokens=True)
        answer.details = [self.tokenizer.decode(new, skip_special_tokens=True)]
        return answer

    def warm_up(self):
        for size in self.prompt_buckets:
            for sample in (False, True):
                ids = np.full((1, size), self.pad_id, np.int32)
                self._programs[sample](self.params, ids, np.ones_like(ids), jax.random.PRNGKey(0)).block_until_ready()


PREDICTOR = TextGenerator


def demo_form(st, predictor):
    with st.form("request"):
        prompt = st.text_area("Prompt", key="text")
        left, middle, right = st.columns(3)
        max_new_tokens = left.number_input("Max new tokens", 1, predictor.max_new_tokens,
                                           min(32, predictor.max_new_tokens), key="max_new_tokens")
        decoding = middle.radio("Decoding", ("greedy", "sampling"), key="decoding")
        seed = right.number_input("Seed (sampling)", 0, 2**31 - 1, 0, key="seed")
        submitted = st.form_submit_button("Continue")
    if submitted:
        return lambda: show_answer(st, predictor(prompt, int(max_new_tokens), decoding == "sampling", int(seed)))
