"""What every task's demo predictor and form build on (`demo.py` serves the page).

Each task module holds its own `PREDICTOR` (a `Predictor`: loaded once from an output dir, answering
one request at a time with plain data, text, probabilities, spans, that the page shows) and its
`demo_form(st, predictor)`. A predictor encodes inputs as its training script does (the same task
module's functions) and pads them to a few shape buckets, all compiled by `warm_up`: after it no
request compiles. A bad request raises `BadInput` with the message the page shows; the predictor
keeps serving. A new task plugs in by declaring both in its module.
"""

import os
import threading
from dataclasses import dataclass, field

import tasks
from utils.base.errors import UsageError
from utils.layout import devices
from utils.models import compat, family_model, hub_checkpoint

MODEL_FILES = ("flax_model.msgpack", "flax_model.msgpack.index.json", hub_checkpoint.WEIGHTS, hub_checkpoint.INDEX)


class BadInput(ValueError):
    """A request the model cannot answer; its message says why and what to type instead."""


@dataclass
class Answer:
    """What a request gives the page: `text` (the main result), task-specific `details`, and `notes`
    (e.g. that the input was truncated)."""
    text: str = ""
    details: list = field(default_factory=list)
    notes: list = field(default_factory=list)


def buckets(limit, smallest=16):
    """Padded lengths up to `limit`: powers of two from `smallest`, and `limit` itself."""
    sizes = []
    size = smallest
    while size < limit:
        sizes.append(size)
        size *= 2
    return sizes + [limit]


def bucket_for(length, sizes):
    return next(size for size in sizes if size >= length)


def require_text(text, what):
    if not text or not text.strip():
        raise BadInput(f"the {what} is empty: type some text first")
    return text


def truncation_note(length, limit):
    return (f"the input has {length} tokens; the model reads at most {limit}, so it was truncated to the first "
            f"{limit}")


class Predictor:
    """Loads the model class `auto_class` (an architecture of the project's decoder family: its `FamilyModel`)
    and the tokenizer saved in `output_dir`."""

    auto_class = None

    def __init__(self, output_dir, run_args):
        import transformers

        compat.apply()  # before the first model is built, as the scripts do
        self.output_dir, self.run_args = output_dir, run_args
        self.tokenizer = self.load_tokenizer()
        if family_model.routed(transformers.AutoConfig.from_pretrained(output_dir)):  # the project's decoder family
            self.model, self.params = family_model.FamilyModel.from_pretrained(output_dir)
        else:
            self.model = getattr(transformers, self.auto_class).from_pretrained(output_dir)
            self.params = self.model.params
        self.config = self.model.config
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        """`predict`, one request at a time: the page serves each browser session from its own
        thread, and a fast tokenizer used by two threads at once fails ("Already borrowed")."""
        with self._lock:
            return self.predict(*args, **kwargs)

    def load_tokenizer(self):
        import transformers

        return transformers.AutoTokenizer.from_pretrained(self.output_dir)

    def warm_up(self):
        """Run every compiled shape once."""
        raise NotImplementedError


# ----------------------------------------------------------------------------------------------
# Generation: summarization, causal LM, T5 span corruption
# ----------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------
# One forward pass: masked LM, text and token classification
# ----------------------------------------------------------------------------------------------


def check_output_dir(output_dir):
    """(task, run_args) of the model in `output_dir`, or a UsageError saying what is missing."""
    if not os.path.isdir(output_dir):
        raise UsageError(f"{output_dir} is not a directory: pass the --output_dir of a training run")
    missing = [name for name in ("config.json", "run_args.json") if not os.path.isfile(os.path.join(output_dir, name))]
    if missing or not any(os.path.isfile(os.path.join(output_dir, name)) for name in MODEL_FILES):
        raise UsageError(f"{output_dir} holds no model ({', '.join(missing) or MODEL_FILES[0]} missing): pass the "
                         "--output_dir of a training run that finished at least one save")
    try:
        task, run_args = tasks.saved_task(output_dir)
    except ValueError as e:
        raise UsageError(f"{output_dir}: a saved JSON file is broken ({e}): export the model again") from e
    if task is None:
        raise UsageError(f"the demo does not serve this kind of models yet (served: {', '.join(tasks.MODULES)})")
    return task, run_args


def load(output_dir):
    """(task, the predictor of the model in `output_dir`, warmed up)."""
    task, run_args = check_output_dir(output_dir)
    devices.leave_absent_tpu_alone()
    predictor = tasks.module_of(task).PREDICTOR(output_dir, run_args)
    predictor.warm_up()
    return task, predictor


# The page's pieces every task's form uses (each form is its task module's `demo_form`).
def escape_markdown(text):
    """`text` shown literally by Streamlit's markdown (generated text may hold `*`, `_`, `<mask>`...)."""
    return "".join("\\" + c if c in "\\`*_{}[]()#+-.!|<>:~$" else c for c in text)


def shown_token(token):
    """A token as a table cell: its text, or for a token of whitespace only, its repr ('\\n')."""
    return escape_markdown(token.strip()) or repr(token)


def show_answer(st, answer):
    with st.container(key="answer"):
        st.markdown("**Answer**")
        for note in answer.notes:
            st.info(escape_markdown(note))
        st.text(answer.text)
