"""Token classification: NER, POS, chunking (`run_flax_ner.py`)."""

import re

import jax
import numpy as np

from tasks import Task
from tasks import classification
from tasks.demo import Answer, Predictor, escape_markdown, require_text, show_answer

TASK = Task("token-classification", "token-classification", outputs=("predictions.txt",), widget="text")


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class EntityTagger(Predictor):
    """run_flax_ner.py's model on a sentence split into words (punctuation apart): each word's tag
    from its first sub-token, chunked into entities."""

    auto_class = "FlaxAutoModelForTokenClassification"
    WORD = re.compile(r"\w+|[^\w\s]")

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        if self.tokenizer.backend_tokenizer.pre_tokenizer.__class__.__name__ == "ByteLevel":
            import transformers
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(output_dir, add_prefix_space=True)
        self.max_length = run_args.get("max_seq_length") or min(512, self.tokenizer.model_max_length)
        self._logits = jax.jit(lambda params, inputs: self.model(**inputs, params=params).logits)

    def predict(self, text):
        require_text(text, "sentence")
        words = self.WORD.findall(text)
        encoded = self.tokenizer(words, is_split_into_words=True, max_length=self.max_length, truncation=True,
                                 padding="max_length", return_tensors="np")
        positions = classification.first_token_positions(encoded.word_ids(0))
        answer = Answer()
        if len(positions) < len(words):
            answer.notes.append(f"the model reads {self.max_length} tokens: the last {len(words) - len(positions)} "
                                "words were not tagged")
        inputs = {k: v for k, v in encoded.items()}
        tag_ids = np.asarray(self._logits(self.params, inputs))[0].argmax(-1)
        tags = [self.config.id2label[int(tag_ids[p])] for p in positions]
        answer.details = [(" ".join(words[first:last + 1]), kind)
                          for kind, first, last in classification.entities(tags)]
        answer.text = " ".join(f"{word}/{tag}" for word, tag in zip(words, tags))
        return answer

    def warm_up(self):
        self("warm up")


PREDICTOR = EntityTagger


def demo_form(st, predictor):
    with st.form("request"):
        text = st.text_area("Sentence", key="text")
        submitted = st.form_submit_button("Tag")
    if submitted:
        def show():
            answer = predictor(text)
            show_answer(st, answer)
            st.markdown(" ".join(f":blue-background[{escape_markdown(words)}] **{escape_markdown(kind)}**"
                                 for words, kind in answer.details) or "No entities found.")
        return show
