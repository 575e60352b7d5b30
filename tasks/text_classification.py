"""Sentence and sentence-pair classification and regression (`run_flax_glue.py`)."""

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task
from tasks import classification
from tasks.demo import Answer, Predictor, require_text, show_answer, truncation_note

TASK = Task("text-classification", "text-classification", outputs=("predict_results*.txt",), widget="text")


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class TextClassifier(Predictor):
    """run_flax_glue.py's model on one text (or sentence pair), encoded as the script encodes it:
    every label's probability, or the score of a regression."""

    auto_class = "FlaxAutoModelForSequenceClassification"

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        self.max_length = run_args.get("max_seq_length") or min(512, self.tokenizer.model_max_length)
        named = run_args.get("text_column_name")
        task = run_args.get("task_name")
        self.pair = bool(named and "," in named) or bool(task and classification.glue_task(task).text_columns[1])
        self.is_regression = self.config.num_labels == 1
        self._logits = jax.jit(lambda params, inputs: self.model(**inputs, params=params).logits.astype(jnp.float32))

    def predict(self, text, second_text=None):
        require_text(text, "text")
        if self.pair:
            require_text(second_text, "second text")
        texts = [text] + ([second_text] if self.pair else [])
        answer = Answer()
        length = len(self.tokenizer(*texts)["input_ids"])
        if length > self.max_length:
            answer.notes.append(truncation_note(length, self.max_length))
        inputs = self.tokenizer(*texts, max_length=self.max_length, padding="max_length", truncation=True,
                                return_tensors="np")
        logits = np.asarray(self._logits(self.params, dict(inputs)))[0]
        if self.is_regression:
            answer.text = f"{logits[0]:.3f}"
            return answer
        probabilities = np.exp(logits - logits.max())
        probabilities /= probabilities.sum()
        answer.details = sorted(((self.config.id2label[i], float(p)) for i, p in enumerate(probabilities)),
                                key=lambda item: -item[1])
        answer.text = answer.details[0][0]
        return answer

    def warm_up(self):
        self("warm up", "warm up")


PREDICTOR = TextClassifier


def demo_form(st, predictor):
    with st.form("request"):
        text = st.text_area("Text" if not predictor.pair else "First text", key="text")
        second = st.text_area("Second text", key="second_text") if predictor.pair else None
        submitted = st.form_submit_button("Classify")
    if submitted:
        def show():
            answer = predictor(text, second)
            show_answer(st, answer)
            if answer.details:
                st.table({"label": [label for label, _ in answer.details],
                          "probability": [f"{p:.3f}" for _, p in answer.details]})
        return show
