"""What a script's predict path shares with the demo (`demo.py`): inputs encoded the way the model
was trained, generation with the settings saved beside the model, outputs decoded into the lines the
result files hold. One definition for both, so the page shows what the script writes."""

import jax
import numpy as np

from tasks import Task
from tasks.demo import Answer, Predictor, require_text, show_answer, truncation_note
from utils.rundir import one_line

TASK = Task("summarization", "summarization", outputs=("generated_predictions.txt",), widget="text")


def set_generation(model, **settings):
    """Put the predict path's generation settings (`max_length`, `num_beams`, ...) into the model's
    generation config: `generate` reads them from there, and the export saves them in
    generation_config.json, where the demo finds them."""
    for name, value in settings.items():
        setattr(model.generation_config, name, value)
    # No longer the model config's defaults: loaded back, these settings are kept (see `generate_ids`).
    model.generation_config._from_model_config = False


def encode_sources(tokenizer, texts, prefix, max_length):
    """{"input_ids", "attention_mask"} of `prefix` + each text, truncated and padded to `max_length`
    (one shape: one compiled program)."""
    return tokenizer([prefix + text for text in texts], max_length=max_length, padding="max_length",
                     truncation=True, return_tensors="np")


def generate_ids(model, params, input_ids, attention_mask):
    """The generated token ids [rows, max_length] under the model's generation config (traceable).

    Passed explicitly: left to itself, `generate` replaces a generation config it loaded unchanged
    (one marked as made from the model config) with the model config's defaults (max_length 20)."""
    return model.generate(input_ids, attention_mask=attention_mask, params=params,
                          generation_config=model.generation_config).sequences


def decode_texts(tokenizer, ids):
    """The text of each row of generated `ids`, special tokens dropped."""
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class Summarizer(Predictor):
    """run_summarization_flax.py's predict path for one document: its source prefix and length, and
    the generation settings it saved (generation_config.json)."""

    auto_class = "FlaxAutoModelForSeq2SeqLM"

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        self.prefix = run_args.get("source_prefix") or ""
        self.max_length = run_args["max_source_length"]
        self._generate = jax.jit(lambda params, ids, mask: generate_ids(self.model, params, ids, mask))

    def predict(self, text):
        require_text(text, "document")
        answer = Answer()
        length = len(self.tokenizer(self.prefix + text)["input_ids"])
        if length > self.max_length:
            answer.notes.append(truncation_note(length, self.max_length))
        inputs = encode_sources(self.tokenizer, [text], self.prefix, self.max_length)
        ids = self._generate(self.params, inputs["input_ids"], inputs["attention_mask"])
        answer.text = one_line(decode_texts(self.tokenizer, np.asarray(ids))[0])
        return answer

    def warm_up(self):
        self("warm up")


PREDICTOR = Summarizer


def demo_form(st, predictor):
    with st.form("request"):
        text = st.text_area("Document", height=150, key="text")
        submitted = st.form_submit_button("Summarize")
    if submitted:
        return lambda: show_answer(st, predictor(text))
