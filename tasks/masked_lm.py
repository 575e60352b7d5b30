"""Masked language modelling (`run_mlm_flax.py`): masked-token loss, accuracy and perplexity."""

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task
from tasks.demo import (Answer, BadInput, Predictor, bucket_for, buckets, escape_markdown, require_text, show_answer,
                        shown_token, truncation_note)

TOP_K = 10  # the fill-mask table shows at most this many tokens per mask (one compiled top-k)

TASK = Task("masked-lm", "fill-mask", widget="mask")


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
