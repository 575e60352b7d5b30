"""Token classification: NER, POS, chunking (`run_flax_ner.py`): the columns of words and tags,
reading the sentences, the label list, tags aligned to sub-tokens, the loss, the per-word scores and
predictions.txt; the demo's predictor. The alignment and seqeval's scores themselves are
`tasks.classification`'s."""

import json
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from transformers import PretrainedConfig

from tasks import Task
from tasks import classification
from tasks.classification import IGNORE_INDEX
from tasks.demo import Answer, Predictor, escape_markdown, require_text, show_answer
from utils.base.errors import UsageError
from utils.data import arrow_columns, file_formats
from utils.models.loading import load_tokenizer
from utils.run.preflight import column_check
from utils.scoring.losses import cross_entropy_sums


TAGGINGS = ("ner", "pos", "chunk")  # --task_name: each picks the label column <task>_tags


# ----------------------------------------------------------------------------------------------
# Data: columns, sentences, tags
# ----------------------------------------------------------------------------------------------
def resolve_columns(data_args, columns):
    """Word and tag columns: explicit, else `tokens` / `<task>_tags`, else the first two (the classic
    rules). `columns` maps each split to its column names; every split must have both."""
    split, names = next(iter(columns.items()))
    text = data_args.text_column_name or ("tokens" if "tokens" in names else names[0])
    default_label = f"{data_args.task_name}_tags"
    others = [name for name in names if name != text]
    label = data_args.label_column_name or (default_label if default_label in names else
                                            (others[0] if others else None))
    if label is None:
        raise UsageError(f"the {split} data has only the column {names[0]!r}: tagging needs a column of words and "
                         "one of tags (--text_column_name, --label_column_name)")
    file_formats.require_columns(columns, (("text_column_name", text), ("label_column_name", label)))
    return text, label



TASK = Task("token-classification", "token-classification", outputs=("predictions.txt",), widget="text",
            check_data=column_check(resolve_columns))


def as_sequence(value, what, split, row):
    """A row's words or tags as a list; a string is whitespace-separated (csv files hold them so)."""
    if isinstance(value, str):
        return value.split()
    if not isinstance(value, (list, tuple)):
        raise UsageError(f"row {row} of the {split} data: the {what} are a {type(value).__name__}, not a list (or a "
                         "space-separated string)")
    return list(value)


def _is_tag(tag, names):
    """Whether `tag` is a tag: an id into `names` (a ClassLabel's), else a non-empty name or an integer
    (a missing tag, None, would otherwise become a class of its own, "None")."""
    if isinstance(tag, bool) or not isinstance(tag, (str, int)):
        return False
    if names is not None:
        return isinstance(tag, int) and 0 <= tag < len(names)
    return tag != ""


def read_sentences(dataset, text_column, label_column, split, tokenizer, data_args):
    """The rows as `words`, `tags` (names: ClassLabel ids named, other tags as strings) and `length`
    (tokens, special ones included, untruncated); each row checked: string words, one tag per word."""
    inner = getattr(dataset.features[label_column], "feature", None)
    names = list(inner.names) if hasattr(inner, "names") else None  # a Sequence(ClassLabel) of tag ids

    def read(examples, indices):
        words, tags = [], []
        for row, row_words, row_tags in zip(indices, examples[text_column], examples[label_column]):
            row_words = as_sequence(row_words, "words", split, row)
            row_tags = as_sequence(row_tags, "tags", split, row)
            if len(row_words) != len(row_tags):
                raise UsageError(f"row {row} of the {split} data has {len(row_words)} words but {len(row_tags)} "
                                 f"tags (--text_column_name {text_column!r}, --label_column_name {label_column!r}): "
                                 "give every word one tag")
            if not all(isinstance(word, str) for word in row_words):
                raise UsageError(f"row {row} of the {split} data: the words must be strings")
            bad = [tag for tag in row_tags if not _is_tag(tag, names)]
            if bad:
                raise UsageError(f"row {row} of the {split} data has the tag {bad[0]!r}: "
                                 + (f"its tag ids run from 0 to {len(names) - 1}" if names else
                                    "a tag must be a name (e.g. 'B-PER') or an integer")
                                 + "; fix the row's tags")
            words.append(row_words)
            tags.append([names[t] if names else str(t) for t in row_tags])
        # verbose=False: sentences longer than the model are expected here, --max_seq_length cuts them.
        lengths = [len(ids) for ids in tokenizer(words, is_split_into_words=True, verbose=False)["input_ids"]]
        return {"words": words, "tags": tags, "length": lengths}

    return dataset.map(read, batched=True, with_indices=True, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                       desc=f"reading the {split} sentences")


def longest_sentence(sentences):
    """The most tokens of a sentence of any split (`read_sentences`' lengths)."""
    return max(max(split["length"]) for split in sentences.values())


def has_label_map(config):
    """Whether `config` names its labels (a fine-tuned tagger), not transformers' LABEL_i defaults."""
    return config.label2id != PretrainedConfig(num_labels=config.num_labels).label2id


def choose_labels(config, sentences, training, model_name, logger):
    """(label list, whether a pretrained head may be replaced): the checkpoint's own labels when it
    names them and they cover the tags of the `sentences` ({split: `read_sentences`}), else those
    tags sorted. Evaluating or predicting needs the checkpoint's labels to cover the data."""
    data_tags = {tag for split in sentences.values() for tags in split["tags"] for tag in tags}
    if training:
        train_tags = sorted({tag for tags in sentences["train"]["tags"] for tag in tags})
        if len(train_tags) < 2:
            raise UsageError(f"the train data has {'one tag only' if train_tags else 'no tags'} "
                             f"({', '.join(map(repr, train_tags))}): tagging needs two tags or more (e.g. 'O' and "
                             "'B-PER'); check --label_column_name, or add tagged sentences")
    checkpoint_labels = [config.id2label[i] for i in range(config.num_labels)]
    if model_name and has_label_map(config):
        unknown = sorted(data_tags - set(checkpoint_labels))
        if not unknown:
            return checkpoint_labels, False
        if not training:
            raise UsageError(f"the data has tags {', '.join(unknown[:5])} that {model_name!r} does not know (its "
                             f"labels: {', '.join(checkpoint_labels)}): evaluate on data with those tags, or "
                             "fine-tune it on yours (--do_train)")
        logger.warning("%s knows the tags %s, not the data's %s: it is fine-tuned on the data's tags (a head for "
                       "another number of labels is replaced by a fresh one)", model_name,
                       ", ".join(checkpoint_labels), ", ".join(unknown[:5]))
    labels = sorted(data_tags)
    if model_name and not training and len(labels) != config.num_labels:
        raise UsageError(f"the data has {len(labels)} tags but {model_name!r} predicts {config.num_labels} "
                         "unnamed labels: fine-tune it on the data (--do_train)")
    return labels, True


def load_tagging_tokenizer(model_args):
    """A fast tokenizer (word ids need one); byte-level BPE ones (RoBERTa, GPT-2 style) get
    add_prefix_space, so that each pre-split word is tokenized as the word it is inside a sentence."""
    tokenizer = load_tokenizer(model_args)
    if not tokenizer.is_fast:
        raise UsageError(f"{type(tokenizer).__name__} is not a fast tokenizer: tagging aligns words to sub-tokens "
                         "by word ids, which only fast tokenizers give; use a tokenizer with a tokenizer.json (and "
                         "drop --use_fast_tokenizer false)")
    pre_tokenizer = tokenizer.backend_tokenizer.pre_tokenizer
    state = json.loads(pre_tokenizer.__getstate__()) if pre_tokenizer is not None else {}
    if state.get("type") == "ByteLevel" and not state.get("add_prefix_space"):
        tokenizer = load_tokenizer(model_args, add_prefix_space=True)
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Tokenizing: word tags onto sub-tokens
# ----------------------------------------------------------------------------------------------
def tokenize_and_align(sentences, tokenizer, seq_length, label_ids, inside_ids, data_args):
    """Fixed-length rows: input_ids, attention_mask (token_type_ids where the tokenizer makes them),
    labels (a word's tag on its first sub-token, IGNORE_INDEX on the others, or their I- tag with
    --label_all_tokens) and word_starts (1 on each word's first sub-token: the host scores words)."""

    def tokenize(examples):
        encoded = tokenizer(examples["words"], is_split_into_words=True, max_length=seq_length, truncation=True,
                            padding="max_length")
        labels, starts = [], []
        for row, tags in enumerate(examples["tags"]):
            word_ids = encoded.word_ids(row)
            labels.append(classification.align_word_labels(word_ids, [label_ids[tag] for tag in tags],
                                                           data_args.label_all_tokens, inside_ids))
            row_starts = [0] * seq_length
            for position in classification.first_token_positions(word_ids):
                row_starts[position] = 1
            starts.append(row_starts)
        return {**encoded, "labels": labels, "word_starts": starts}

    return sentences.map(tokenize, batched=True, num_proc=data_args.preprocessing_num_workers,
                         load_from_cache_file=not data_args.overwrite_cache, desc="tokenizing")


class TaggedSplit(NamedTuple):
    """A split ready for the steps: `arrays` (the tokenizer's inputs and "labels", rows of
    `seq_length`), `size` (sentences); for scoring on the host, `word_starts` ([size, seq_length], 1 on
    each word's first sub-token) and `true_tags` (each sentence's tags of the words within
    `seq_length`)."""
    arrays: dict
    size: int
    word_starts: np.ndarray
    true_tags: list


def tag_split(sentences, split, tokenizer, seq_length, label_list, data_args, logger):
    """The `TaggedSplit` of a split's sentences (`read_sentences`); a warning counts the words past
    `seq_length`, which are neither tagged nor scored."""
    inside_ids = classification.inside_label_ids(label_list) if data_args.label_all_tokens else None
    label_ids = {label: i for i, label in enumerate(label_list)}
    dataset = tokenize_and_align(sentences, tokenizer, seq_length, label_ids, inside_ids, data_args)
    inputs = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in dataset.features]
    word_starts = arrow_columns.to_arrays(dataset, ["word_starts"])["word_starts"][:]
    true_tags = [tags[:n] for tags, n in zip(dataset["tags"], word_starts.sum(axis=1))]
    cut = sum(map(len, dataset["tags"])) - int(word_starts.sum())
    if cut:
        logger.warning("%s: %d words lie past --max_seq_length %d: they are not tagged or scored (raise "
                       "--max_seq_length)", split, cut, seq_length)
    logger.info("%s: %d sentences of %d tokens", split, len(dataset), seq_length)
    return TaggedSplit(arrow_columns.to_arrays(dataset, inputs + ["labels"]), len(dataset), word_starts, true_tags)


# ----------------------------------------------------------------------------------------------
# Loss, prediction, scores, predictions.txt
# ----------------------------------------------------------------------------------------------
def tagging_loss(logits, labels, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}) over the labelled sub-tokens; IGNORE_INDEX (special tokens,
    padding, later sub-tokens) counts nothing, and `example_weight` (eval: 0 for padded rows) scales
    a row's tokens."""
    weights = (labels != IGNORE_INDEX).astype(jnp.float32)
    if example_weight is not None:
        weights = weights * example_weight[:, None]
    loss, tokens = cross_entropy_sums(logits, jnp.where(labels == IGNORE_INDEX, 0, labels), weights,
                                      label_smoothing)
    return loss, {"loss": loss, "tokens": tokens}


def step_fns(model, input_names):
    """(`loss_fn(params, batch, dropout_rng, train, label_smoothing)` for `utils.run.spine.make_steps`,
    `predict_fn(params, batch)`: each token's tag id)."""
    logits_of = classification.logits_fn(model, input_names)

    def loss_fn(params, batch, dropout_rng, train, label_smoothing):
        return tagging_loss(logits_of(params, batch, dropout_rng, train), batch["labels"], batch.get("example_weight"),
                            label_smoothing)

    def predict_fn(params, batch):
        return jnp.argmax(logits_of(params, batch), axis=-1).astype(jnp.int32)

    return loss_fn, predict_fn


def word_tags(predicted_ids, word_starts, label_list):
    """The tag predicted for each word of one example within --max_seq_length: its first sub-token's."""
    return [label_list[i] for i in predicted_ids[np.flatnonzero(word_starts)]]


def eval_results(means, rows, tagged, label_list, per_type):
    """(results, predicted tags per sentence) of a `TaggedSplit` from `Steps.evaluate`'s `means`
    (token-weighted loss over the labelled sub-tokens) and predicted `rows`: seqeval's scores over
    every word within --max_seq_length of every sentence (`per_type`: for each entity type too)."""
    predicted = [word_tags(ids, starts, label_list) for ids, starts in zip(rows, tagged.word_starts)]
    scores = classification.entity_metrics(tagged.true_tags, predicted, per_type=per_type)
    return {**means, **scores, "samples": tagged.size}, predicted


def prediction_lines(words, predicted):
    """predictions.txt's lines: "word tag" for each word, a blank line between sentences."""
    lines = []
    for sentence_words, tags in zip(words, predicted):
        lines.extend([""] if lines else [])
        lines.extend(f"{word} {tag}" for word, tag in zip(sentence_words, tags))
    return lines


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
