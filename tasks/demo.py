"""The model behind the demo page (`demo.py`): one predictor per task, loaded once from an output
dir, answering one request at a time with plain data (text, probabilities, spans) the page shows.

Each predictor encodes inputs as its training script does (`tasks.summarization` where a script has a
predict path) and pads them to a few shape buckets, all compiled by `warm_up`: after it no request
compiles. A bad request raises `BadInput` with the message the page shows; the predictor keeps
serving. A new task plugs in as one more class in `PREDICTORS` (and a form in `demo.py`).
"""

import inspect
import os
import re
import threading
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
from PIL import UnidentifiedImageError

from utils import compat
from tasks import classification, image_classification as images, summarization as generation, question_answering as qa
from utils.errors import UsageError
from utils.rundir import one_line
from utils.models import max_positions
from tasks import saved_task

MODEL_FILES = ("flax_model.msgpack", "flax_model.msgpack.index.json")
TOP_K = 10  # the fill-mask table shows at most this many tokens per mask (one compiled top-k)


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
    """Loads the model class `auto_class` and the tokenizer saved in `output_dir`."""

    auto_class = None

    def __init__(self, output_dir, run_args):
        import transformers

        compat.apply()  # before the first model is built, as the scripts do
        self.output_dir, self.run_args = output_dir, run_args
        self.tokenizer = self.load_tokenizer()
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
class Summarizer(Predictor):
    """run_summarization_flax.py's predict path for one document: its source prefix and length, and
    the generation settings it saved (generation_config.json)."""

    auto_class = "FlaxAutoModelForSeq2SeqLM"

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        self.prefix = run_args.get("source_prefix") or ""
        self.max_length = run_args["max_source_length"]
        self._generate = jax.jit(lambda params, ids, mask: generation.generate_ids(self.model, params, ids, mask))

    def predict(self, text):
        require_text(text, "document")
        answer = Answer()
        length = len(self.tokenizer(self.prefix + text)["input_ids"])
        if length > self.max_length:
            answer.notes.append(truncation_note(length, self.max_length))
        inputs = generation.encode_sources(self.tokenizer, [text], self.prefix, self.max_length)
        ids = self._generate(self.params, inputs["input_ids"], inputs["attention_mask"])
        answer.text = one_line(generation.decode_texts(self.tokenizer, np.asarray(ids))[0])
        return answer

    def warm_up(self):
        self("warm up")


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


# ----------------------------------------------------------------------------------------------
# One forward pass: masked LM, text and token classification
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


class QuestionAnswerer(Predictor):
    """run_qa.py's predict path for one question and its context: the same windows
    (`tasks.question_answering.cut_windows`) and post-processing (`tasks.question_answering.best_answers`) with the run's n-best
    size, answer length and SQuAD v2.0 settings. `details` is the n-best list (text, probability,
    score, character offsets into the context); the answer is "" when the model says the context
    does not answer the question (v2.0)."""

    auto_class = "FlaxAutoModelForQuestionAnswering"
    MAX_WINDOWS = 8  # windows read per request (a longer context is cut, and the page says so)

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        # As run_qa.py sizes its windows: the argument, at most the tokenizer's and the model's length.
        self.seq_length = min(run_args["max_seq_length"], self.tokenizer.model_max_length,
                              max_positions(self.config) or run_args["max_seq_length"])
        self.doc_stride = run_args["doc_stride"]
        self.settings = dict(n_best_size=run_args["n_best_size"], max_answer_length=run_args["max_answer_length"],
                             with_negative=run_args["version_2_with_negative"],
                             null_score_diff_threshold=run_args["null_score_diff_threshold"])
        self.window_buckets = buckets(self.MAX_WINDOWS, smallest=1)
        accepted = inspect.signature(self.model.__call__).parameters
        self.inputs = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in accepted]

        def logits(params, inputs):
            outputs = self.model(**inputs, params=params)
            return jnp.stack([outputs.start_logits, outputs.end_logits], axis=-1).astype(jnp.float32)

        self._logits = jax.jit(logits)

    def predict(self, question, context):
        require_text(question, "question")
        require_text(context, "context")
        question = question.lstrip()  # as run_qa.py reads its questions
        question_tokens = len(self.tokenizer(question, add_special_tokens=False)["input_ids"])
        room = self.seq_length - question_tokens - self.tokenizer.num_special_tokens_to_add(pair=True)
        if room <= self.doc_stride:
            raise BadInput(f"the question takes {question_tokens} tokens, leaving {max(room, 0)} of the model's "
                           f"{self.seq_length} for the context: ask a shorter question")
        answer = Answer()
        encoded, windows = qa.cut_windows(self.tokenizer, [question], [context], self.seq_length, self.doc_stride)
        if len(windows) > self.MAX_WINDOWS:
            read = int(windows[self.MAX_WINDOWS - 1].offsets.max())
            answer.notes.append(f"the context needs {len(windows)} windows of {self.seq_length} tokens; the model "
                                f"reads the first {self.MAX_WINDOWS}, its first {read} characters")
            windows = windows[:self.MAX_WINDOWS]
        size = bucket_for(len(windows), self.window_buckets)
        inputs = {}
        for name in self.inputs:
            rows = np.zeros((size, self.seq_length), np.int32)
            rows[:len(windows)] = np.asarray(encoded[name][:len(windows)])
            inputs[name] = rows
        logits = np.asarray(self._logits(self.params, inputs))[:len(windows)]
        answers, nbest, _ = qa.best_answers(
            [("request", context)], [0] * len(windows), logits[..., 0], logits[..., 1],
            np.stack([w.offsets for w in windows]), [w.null for w in windows], **self.settings)
        answer.text, answer.details = answers["request"], nbest["request"]
        return answer

    def warm_up(self):
        for size in self.window_buckets:
            ids = np.zeros((size, self.seq_length), np.int32)
            jax.block_until_ready(self._logits(self.params, {name: ids for name in self.inputs}))


class ImageClassifier(Predictor):
    """run_image_classification.py's model on one uploaded image, transformed as the script's
    evaluation and prediction transform it (`tasks.image_classification.Transforms.eval` with the image
    processor saved beside the model): the `TOP_LABELS` best labels with their probabilities."""

    auto_class = "FlaxAutoModelForImageClassification"
    TOP_LABELS = 5

    def __init__(self, output_dir, run_args):
        from transformers import AutoImageProcessor

        super().__init__(output_dir, run_args)
        processor = AutoImageProcessor.from_pretrained(output_dir)
        # The size the run trained at, found as run_image_classification.py finds it.
        size = run_args.get("image_size") or getattr(self.config, "image_size", None) or images.processor_size(
            processor)
        self.transforms = images.Transforms(size, images.Normalisation(processor))
        top = min(self.TOP_LABELS, self.config.num_labels)
        self._top = jax.jit(lambda params, pixels: jax.lax.top_k(jax.nn.softmax(
            self.model(pixels, params=params, train=False)[0].astype(jnp.float32), axis=-1), top))

    def load_tokenizer(self):
        return None  # images need none: the transform is read from the saved image processor

    def predict(self, image_bytes):
        if not image_bytes:
            raise BadInput("no image: upload a PNG, JPEG, GIF, BMP, WebP or TIFF file")
        try:
            pixels = self.transforms.eval(bytes(image_bytes))
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
            raise BadInput(f"the file is not an image that can be read ({type(e).__name__}): upload a PNG, JPEG, "
                           "GIF, BMP, WebP or TIFF file") from e
        probabilities, label_ids = (np.asarray(x)[0] for x in self._top(self.params, pixels[None]))
        answer = Answer(details=[(self.config.id2label[int(i)], float(p)) for i, p in zip(label_ids, probabilities)])
        answer.text = answer.details[0][0]
        return answer

    def warm_up(self):
        side = self.transforms.size
        jax.block_until_ready(self._top(self.params, np.zeros((1, 3, side, side), np.float32)))


# Task (tasks) -> predictor.
PREDICTORS = {
    "summarization": Summarizer,
    "causal-lm": TextGenerator,
    "masked-lm": MaskFiller,
    "span-corruption": SpanFiller,
    "text-classification": TextClassifier,
    "token-classification": EntityTagger,
    "question-answering": QuestionAnswerer,
    "image-classification": ImageClassifier,
}


def check_output_dir(output_dir):
    """(task, run_args) of the model in `output_dir`, or a UsageError saying what is missing."""
    if not os.path.isdir(output_dir):
        raise UsageError(f"{output_dir} is not a directory: pass the --output_dir of a training run")
    missing = [name for name in ("config.json", "run_args.json") if not os.path.isfile(os.path.join(output_dir, name))]
    if missing or not any(os.path.isfile(os.path.join(output_dir, name)) for name in MODEL_FILES):
        raise UsageError(f"{output_dir} holds no model ({', '.join(missing) or MODEL_FILES[0]} missing): pass the "
                         "--output_dir of a training run that finished at least one save")
    try:
        task, run_args = saved_task(output_dir)
    except ValueError as e:
        raise UsageError(f"{output_dir}: a saved JSON file is broken ({e}): export the model again") from e
    if task not in PREDICTORS:
        raise UsageError(f"the demo does not serve {task or 'this kind of'} models yet (served: "
                         f"{', '.join(PREDICTORS)})")
    return task, run_args


def load(output_dir):
    """(task, the predictor of the model in `output_dir`, warmed up)."""
    task, run_args = check_output_dir(output_dir)
    predictor = PREDICTORS[task](output_dir, run_args)
    predictor.warm_up()
    return task, predictor
