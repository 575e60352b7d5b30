"""Long-document question answering with answer categories (Natural Questions style, `run_qa.py --answer_categories`).

A question about a long document has an answer of one category: null (the document does not
answer it), short (a span), long (a longer span, a paragraph), yes or no. What run_qa.py does with
a split, in order: `load_splits` reads it (rows of `question`, `context` and `answers`, a list of
{category, text, answer_start}; or the official simplified Natural Questions jsonl, converted by
`simplified_nq_row`), `prepare_split` reads and checks its examples (`read_examples`) and cuts each
document into windows (`tasks.question_answering.cut_windows`), each labelled from where its answer
really is (`window_label`: the span and category in the window that holds it, null in the others),
where the classic BigBird research project labels every window after the first null once the
answer is not in the first. The model is a stock question-answering model plus `CategoryHead`, a
small module on its first token's last hidden state that tells the window's category; its weights
sit in the parameters under `HEAD`, so checkpoints and the export keep them (the stock class drops
them on loading, with transformers' warning) and `add_category_head` reloads them. `loss` trains
the spans and categories together; `predicted_answers` decides each example's category from its
windows and takes the best span of the window most sure it holds the answer; `category_metrics`
scores exact match against any gold answer, as the research project's evaluation does.
`LongAnswerer` answers the demo page's question about a document the same way (a saved run of
this kind is its own task, "long-question-answering").
"""

import collections
import inspect
import json
import logging
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.serialization import msgpack_restore
from flax.traverse_util import flatten_dict, unflatten_dict
from transformers.utils import cached_file

from tasks import Task
from tasks import question_answering as qa
from tasks.demo import Answer, escape_markdown, show_answer
# By name: `datasets` hashes the map functions, and a module object among their globals cannot be hashed.
from tasks.question_answering import answer_tokens, cut_questions, cut_windows
from utils.base.errors import UsageError
from utils.data import arrow_columns
from utils.layout.layouts import finished
from utils.models import weights
from utils.models.loading import cast_floats
from utils.scoring.losses import cross_entropy_sums

logger = logging.getLogger(__name__)

# Its own task name: a saved run is served by `LongAnswerer`; the files are those of run_qa.py's runs.
TASK = Task("long-question-answering", "question-answering", outputs=qa.TASK.outputs,
            file_formats=qa.FILE_FORMATS)
# The other task modules this one is built on (tests/test_architecture.py holds tasks apart otherwise): long
# documents are windowed, their windows scored and their answers written as extractive QA does it.
BUILDS_ON = ("question_answering",)

CATEGORIES = ("null", "short", "long", "yes", "no")  # the research project's order (its CATEGORY_MAPPING)
SPAN_CATEGORIES = ("short", "long")
YES_NO = ("yes", "no")
HEAD = "answer_category_head"  # the head's key among the model's parameters
NQ_COLUMNS = ("document_text", "question_text", "annotations")  # the simplified Natural Questions jsonl
_HTML_TAG = re.compile(r"^<[^>]*>$")


# ----------------------------------------------------------------------------------------------
# Data: rows, the simplified Natural Questions layout, examples
# ----------------------------------------------------------------------------------------------
def simplified_nq_row(row):
    """A simplified Natural Questions row as {id, question, context, answers}: the document without
    its HTML tags (as the research project reads it), each annotation as {category, text,
    answer_start}: yes / no (the long answer its evidence), else its first short answer, else its
    long answer, else none (null)."""
    kept, characters, length = [], {}, 0  # the kept tokens; token index -> its (start, end) in the context
    for index, token in enumerate(row["document_text"].split(" ")):
        if token and not _HTML_TAG.match(token):
            start = length + 1 if kept else 0
            characters[index] = (start, start + len(token))
            length = start + len(token)
            kept.append(token)
    context = " ".join(kept)

    def span(first, last):  # token span [first, last) -> (text, character offset), or None when all tags
        inside = [characters[i] for i in range(first, last) if i in characters]
        return (context[inside[0][0]:inside[-1][1]], inside[0][0]) if inside else None

    answers = []
    for annotation in row.get("annotations") or []:
        long = annotation.get("long_answer") or {}
        long_span = span(long["start_token"], long["end_token"]) if long.get("start_token", -1) >= 0 else None
        yes_no = str(annotation.get("yes_no_answer", "NONE")).lower()
        shorts = [span(s["start_token"], s["end_token"]) for s in annotation.get("short_answers") or []]
        shorts = [s for s in shorts if s]
        if yes_no in YES_NO:
            text, start = long_span or ("", -1)
            answers.append({"category": yes_no, "text": text, "answer_start": start})
        elif shorts:
            answers.append({"category": "short", "text": shorts[0][0], "answer_start": shorts[0][1]})
        elif long_span:
            answers.append({"category": "long", "text": long_span[0], "answer_start": long_span[1]})
    return {"id": str(row.get("example_id", "")), "question": row["question_text"], "context": context,
            "answers": answers}


def load_splits(data_args, files, cache_dir):
    """{split: Dataset} as `tasks.question_answering.load_splits` reads them, simplified Natural
    Questions splits converted to rows of question, context and answers."""
    splits = qa.load_splits(data_args, files, cache_dir)
    for split, dataset in splits.items():
        if all(column in dataset.column_names for column in NQ_COLUMNS):
            splits[split] = dataset.map(simplified_nq_row, remove_columns=dataset.column_names,
                                        desc=f"reading the {split} Natural Questions")
    return splits


def parse_answers(value, split, row):
    """[(category, text, answer_start)] of a row's answers: a list of {category, text,
    answer_start} (in csv files as JSON); empty or missing: the question has no answer (null)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else []
        except json.JSONDecodeError:
            raise UsageError(f"row {row} of the {split} data: the answers {value[:60]!r} are not JSON such as "
                             '[{"category": "short", "text": "Lyon", "answer_start": 12}]') from None
    if value is None:
        return []
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(answer, dict) for answer in value):
        raise UsageError(f"row {row} of the {split} data: the answers must be a list of {{category, text, "
                         "answer_start}} (empty when the document does not answer the question)")
    answers = []
    for answer in value:
        category = answer.get("category")
        if category is None:
            raise UsageError(f"row {row} of the {split} data: an answer has no category: --answer_categories reads "
                             "answers as {category, text, answer_start}, the category one of "
                             f"{', '.join(CATEGORIES)} (SQuAD-style answers are read without --answer_categories)")
        if category not in CATEGORIES:
            raise UsageError(f"row {row} of the {split} data: unknown answer category {category!r}: use one of "
                             f"{', '.join(CATEGORIES)}")
        if category != "null":
            start = answer.get("answer_start")
            # A column of offsets with one float among them (pandas, a null elsewhere) reads as floats: 432.0 is 432
            start = int(start) if isinstance(start, float) and start.is_integer() else start
            answers.append((category, str(answer.get("text") or ""), -1 if start is None else start))
    return answers


def check_answer(category, text, start, context, split, row):
    """A span answer (short, long) must be its text at its offset; a yes / no answer may name its
    evidence the same way (without it, every window of the document is labelled yes / no)."""
    if category in YES_NO and not text:
        return
    if category in SPAN_CATEGORIES and not text:
        raise UsageError(f"row {row} of the {split} data: its {category} answer has no text: give the answer's "
                         "text and answer_start")
    if not isinstance(start, int) or isinstance(start, bool):
        raise UsageError(f"row {row} of the {split} data: answer_start {start!r} is not a character offset: give the "
                         f"{category} answer's offset in the document as a whole number")
    if not 0 <= start < len(context):
        raise UsageError(f"row {row} of the {split} data: answer_start {start} is outside its document of "
                         f"{len(context)} characters: it must be the {category} answer's character offset")
    if context[start:start + len(text)] != text:
        raise UsageError(f"row {row} of the {split} data: the {category} answer {text[:40]!r} is not at "
                         f"answer_start {start} of the document (which reads {context[start:start + len(text)][:40]!r}"
                         " there): fix the offset or the text")


def read_examples(dataset, split, data_args, tokenizer, has_answers):
    """The rows as id, question (left-stripped, cut to --max_question_length tokens), context,
    answer_categories, answer_texts, answer_starts (one entry per gold answer; none: null),
    question_tokens, question_cut; every answer checked against its document."""
    question_col, context_col, answer_col = (data_args.question_column_name, data_args.context_column_name,
                                             data_args.answer_column_name)

    def read(examples, indices):
        out = {"id": [], "question": [], "context": [], "answer_categories": [], "answer_texts": [],
               "answer_starts": []}
        for i, row in enumerate(indices):
            question, context = examples[question_col][i], examples[context_col][i]
            if not isinstance(question, str) or not isinstance(context, str):
                raise UsageError(f"row {row} of the {split} data: the question and the document must be text")
            empty = "document" if not context.strip() else "question" if not question.strip() else None
            if empty:  # nothing to find an answer in, or nothing to answer
                raise UsageError(f"row {row} of the {split} data has an empty {empty}: give it its text, or drop the row")
            answers = parse_answers(examples[answer_col][i], split, row) if has_answers else []
            for category, text, start in answers:
                check_answer(category, text, start, context, split, row)
            out["id"].append(str(examples["id"][i] if "id" in examples else row))
            out["question"].append(question.lstrip())
            out["context"].append(context)
            out["answer_categories"].append([category for category, _, _ in answers])
            out["answer_texts"].append([text for _, text, _ in answers])
            out["answer_starts"].append([int(start) for _, _, start in answers])
        out["question"], out["question_tokens"], out["question_cut"] = cut_questions(
            out["question"], tokenizer, data_args.max_question_length)
        return out

    return dataset.map(read, batched=True, with_indices=True, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                       desc=f"reading the {split} questions")


# ----------------------------------------------------------------------------------------------
# Windows and their labels
# ----------------------------------------------------------------------------------------------
def window_label(window, category, text, start):
    """(start token, end token, category id) of one window for the example's first answer
    (`category` None: none): a span answer where the window holds all of it, labelled there; a yes /
    no answer in every window that holds its evidence (all of them without evidence), pointing at the
    null token; the null token and category elsewhere. Each window is labelled from the answer's
    own position, whatever the windows before it held."""
    null = (window.null, window.null, CATEGORIES.index("null"))
    if category is None:
        return null
    if category in YES_NO and not text:
        return window.null, window.null, CATEGORIES.index(category)
    span = answer_tokens(window.offsets, window.context_mask, start, start + len(text))
    if span is None:
        return null
    if category in YES_NO:
        return window.null, window.null, CATEGORIES.index(category)
    return span[0], span[1], CATEGORIES.index(category)


def make_windows(examples, tokenizer, seq_length, doc_stride, data_args):
    """Fixed-length windows: the model inputs; start_positions / end_positions / category
    (`window_label`); example_index; offsets (flattened) and null_index for post-processing."""
    def tokenize(batch, indices):
        encoded, windows = cut_windows(tokenizer, batch["question"], batch["context"], seq_length, doc_stride)
        out = {"start_positions": [], "end_positions": [], "category": [], "example_index": [], "offsets": [],
               "null_index": []}
        for window in windows:
            categories = batch["answer_categories"][window.pair]
            first = (categories[0], batch["answer_texts"][window.pair][0], batch["answer_starts"][window.pair][0]) \
                if categories else (None, "", -1)
            start, end, category = window_label(window, *first)
            out["start_positions"].append(start)
            out["end_positions"].append(end)
            out["category"].append(category)
            out["example_index"].append(indices[window.pair])
            out["offsets"].append(window.offsets.reshape(-1).tolist())
            out["null_index"].append(window.null)
        return {**encoded, **out}

    return examples.map(tokenize, batched=True, with_indices=True, num_proc=data_args.preprocessing_num_workers,
                        remove_columns=examples.column_names, load_from_cache_file=not data_args.overwrite_cache,
                        desc="cutting windows")


def prepare_split(dataset, split, data_args, tokenizer, seq_length, has_answers, keep_null_windows=1.0, seed=0):
    """The `tasks.question_answering.Features` of a split: its examples read and checked, each cut
    into windows of `seq_length` tokens with their span and category labels; `references` {id:
    [(category, text)] of its gold answers} where the split has answers. Training keeps a
    `keep_null_windows` fraction of the windows labelled null (`thinned`)."""
    # Files read together share their columns: a test file without answers reads as answers all None.
    has_answers = has_answers and any(value is not None for value in dataset[data_args.answer_column_name])
    examples = read_examples(dataset, split, data_args, tokenizer, has_answers)
    if split != "train":
        qa.check_unique_ids(examples["id"], split)
    qa.report_cut_questions(examples, split, data_args.max_question_length)
    qa.check_windows(examples, split, seq_length, data_args.doc_stride, tokenizer.num_special_tokens_to_add(pair=True))
    references = None
    if split != "train" and has_answers:
        references = {example_id: list(zip(categories, texts)) for example_id, categories, texts in
                      zip(examples["id"], examples["answer_categories"], examples["answer_texts"])}
    dataset = make_windows(examples, tokenizer, seq_length, data_args.doc_stride, data_args)
    inputs = [name for name in qa.MODEL_INPUTS if name in dataset.features]
    labels = ["start_positions", "end_positions", "category"]
    if split == "train":
        dataset = thinned(dataset, keep_null_windows, seed)
        weighted = ["window_weight"] if "window_weight" in dataset.features else []
        return qa.Features(examples, arrow_columns.to_arrays(dataset, inputs + labels + weighted), len(dataset))
    arrays = arrow_columns.to_arrays(dataset, inputs + labels)
    windows = {name: column[:] for name, column in
               arrow_columns.to_arrays(dataset, ["example_index", "offsets", "null_index"]).items()}
    windows["offsets"] = windows["offsets"].reshape(len(dataset), seq_length, 2)
    return qa.Features(examples, arrays, len(dataset), windows, references)


def thinned(windows, keep_null_windows, seed):
    """The training windows with a `keep_null_windows` fraction of the null ones, drawn with `seed`:
    most windows of a long document hold no answer, and the research project trains on 40 % of them
    so that an epoch is shorter. Each kept null window weighs 1 / `keep_null_windows` in the loss
    (column `window_weight`, 1 for the others): the model still learns how rare an answering window
    is, else it answers questions that have none."""
    if keep_null_windows >= 1.0:
        return windows
    null = np.asarray(windows["category"]) == CATEGORIES.index("null")
    kept = ~null | (np.random.default_rng(seed).random(len(null)) < keep_null_windows)
    windows = windows.add_column("window_weight", np.where(null, 1.0 / keep_null_windows, 1.0).astype(np.float32))
    logger.info("training windows: %d with an answer, %d of %d null ones kept (--keep_null_windows %g)",
                int((~null).sum()), int((kept & null).sum()), int(null.sum()), keep_null_windows)
    return windows.select(np.flatnonzero(kept))


# ----------------------------------------------------------------------------------------------
# BigBird's attention
# ----------------------------------------------------------------------------------------------
def set_attention(config, attention_type, block_size, num_random_blocks):
    """--attention_type / --block_size / --num_random_blocks into a BigBird config (None: the
    config's own); a model without BigBird's attention settings takes none of them."""
    given = {name: value for name, value in (("attention_type", attention_type), ("block_size", block_size),
                                             ("num_random_blocks", num_random_blocks)) if value is not None}
    if given and not hasattr(config, "attention_type"):
        raise UsageError(f"--{next(iter(given))} is a BigBird setting, but the model is {config.model_type}: drop "
                         f"{', '.join('--' + name for name in given)} or use a big_bird model")
    for name, value in given.items():
        setattr(config, name, value)
    return config


def check_blocks(config, seq_length):
    """Block-sparse attention cuts the window into whole blocks, and needs more of them than BigBird
    attends to anyway (2 x random + 5: first, last, three sliding, the random ones twice over)."""
    if getattr(config, "attention_type", None) != "block_sparse":
        return
    block, random_blocks = config.block_size, config.num_random_blocks
    if seq_length % block:
        lower, upper = seq_length // block * block, (seq_length // block + 1) * block
        raise UsageError(f"--block_size {block} does not divide the window of {seq_length} tokens "
                         f"(--max_seq_length): block-sparse attention reads whole blocks; use --max_seq_length "
                         f"{upper}{f' or {lower}' if lower else ''}, or a block size that divides it")
    needed = 2 * random_blocks + 5
    if seq_length // block <= needed:
        raise UsageError(f"a window of {seq_length} tokens is {seq_length // block} blocks of {block}, too few for "
                         f"block-sparse attention with {random_blocks} random blocks (BigBird needs more than "
                         f"{needed}, else every token attends to all anyway): use --attention_type original_full, "
                         "a smaller --block_size or --num_random_blocks, or longer windows")


def random_blocks_key(model, dropout_rng):
    """{"indices_rng": a key} for a BigBird model in training (its block-sparse attention draws its
    random blocks from it), a pure function of the step's dropout key; {} otherwise."""
    if dropout_rng is None or "indices_rng" not in inspect.signature(model.__call__).parameters:
        return {}
    return {"indices_rng": jax.random.fold_in(dropout_rng, 1)}


def fit_question_end(config, tokenizer):
    """BigBird's question-answering model finds a question's end at the first `config.sep_token_id`
    (question tokens never win a span): a model made from scratch takes the tokenizer's."""
    if config.model_type == "big_bird" and tokenizer.sep_token_id is not None:
        config.sep_token_id = tokenizer.sep_token_id
    return config


# ----------------------------------------------------------------------------------------------
# The category head: its module, its weights in the model's parameters
# ----------------------------------------------------------------------------------------------
class CategoryHead(nn.Module):
    """A window's answer category from its first token's last hidden state (the CLS token): a tanh
    layer as BERT's pooler, dropout, then one logit per category."""
    hidden_size: int
    dropout_rate: float = 0.1
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, first_token_states, deterministic=True):
        hidden = jnp.tanh(nn.Dense(self.hidden_size, dtype=self.dtype, name="dense")(first_token_states))
        hidden = nn.Dropout(self.dropout_rate)(hidden, deterministic=deterministic)
        return nn.Dense(len(CATEGORIES), dtype=self.dtype, name="categories")(hidden)


def category_head(config, dtype):
    return CategoryHead(config.hidden_size, getattr(config, "hidden_dropout_prob", 0.1), dtype)


def saved_head(model_name_or_path, cache_dir=None, token=None):
    """The category head's weights in the checkpoint `model_name_or_path` (host arrays), None when
    it has none (a stock checkpoint): Flax msgpack weights, whole or sharded."""
    if not model_name_or_path:
        return None
    filename, path = weights.find_weights(model_name_or_path, cache_dir, token)
    if filename not in weights.FLAX_MSGPACK:
        return None
    paths = [path]
    if filename.endswith(".index.json"):
        with open(path, encoding="utf-8") as f:
            shards = {shard for key, shard in json.load(f)["weight_map"].items() if key.startswith(HEAD + "/")}
        paths = [cached_file(model_name_or_path, shard, cache_dir=cache_dir, token=token) for shard in sorted(shards)]
    found = {}
    for shard in paths:
        with open(shard, "rb") as f:
            flat = flatten_dict(msgpack_restore(f.read()), sep="/")
        found.update({key[len(HEAD) + 1:]: np.asarray(value) for key, value in flat.items()
                      if key.startswith(HEAD + "/")})
    return unflatten_dict(found, sep="/") if found else None


def add_category_head(params, model, model_args, config, seed, layout):
    """The model's parameters with the category head's under `HEAD`: those saved in
    --model_name_or_path (a run of this script), else fresh ones; placed by `layout` as the rest."""
    module = category_head(config, jnp.float32)
    param_dtype = jnp.dtype(model_args.param_dtype)

    def fresh(key):
        return cast_floats(module.init(key, jnp.zeros((1, config.hidden_size)))["params"], param_dtype)

    key = layout.seed_key(seed)  # the program's argument, not its constant: its compilation serves every seed

    saved = None if layout.plan else saved_head(model_args.model_name_or_path, model_args.cache_dir,
                                                model_args.token)
    if saved is None:
        if model_args.model_name_or_path:
            logger.warning("%s has no answer-category head: a fresh one is trained", model_args.model_name_or_path)
        return {**finished(params), HEAD: layout.init_params(fresh, key)}
    expected = jax.tree_util.tree_map(np.shape, jax.eval_shape(fresh, key))
    if jax.tree_util.tree_map(np.shape, saved) != expected:
        raise UsageError(f"the answer-category head saved in {model_args.model_name_or_path} does not fit "
                         f"{type(model).__name__} with hidden size {config.hidden_size} and {len(CATEGORIES)} "
                         "categories: train a new one from a checkpoint without it")
    logger.info("answer-category head reloaded from %s", model_args.model_name_or_path)
    return {**finished(params), HEAD: layout.place_params(cast_floats(saved, param_dtype))}


def model_params(params):
    """The stock model's own parameters (without the category head)."""
    return {name: value for name, value in params.items() if name != HEAD}


def answer_logits(model, head, params, inputs, dropout_rng=None, train=False):
    """(start logits, end logits [windows, tokens], category logits [windows, categories]) of the
    stock model and the category head on its first token's last hidden state, `params` holding
    both (`add_category_head`); dropout with `dropout_rng` when `train`."""
    outputs = model(**inputs, params=model_params(params), dropout_rng=dropout_rng, train=train,
                    output_hidden_states=True, **random_blocks_key(model, dropout_rng if train else None))
    category_logits = head.apply({"params": params[HEAD]}, outputs.hidden_states[-1][:, 0], deterministic=not train,
                                 rngs={"dropout": jax.random.fold_in(dropout_rng, 2)} if train else None)
    return outputs.start_logits, outputs.end_logits, category_logits


def export_note(model):
    logger.info("the export holds the answer-category head under %r in its weights: run_qa.py --answer_categories "
                "reloads it; %s.from_pretrained loads the rest and drops it (transformers warns of the unused "
                "weights)", HEAD, type(model).__name__)


# ----------------------------------------------------------------------------------------------
# Loss; the step's per-window outputs
# ----------------------------------------------------------------------------------------------
def loss(start_logits, end_logits, category_logits, batch, label_smoothing=0.0):
    """(loss sum, {"loss", "category_loss", "tokens"}): per window the mean of its start, end and
    category cross entropies (the research project's loss), summed, each window weighted by its
    `window_weight` (`thinned`) where the batch has one; "tokens" sums the weights."""
    weights_ = batch.get("example_weight")
    weights_ = jnp.ones(batch["category"].shape, jnp.float32) if weights_ is None else weights_
    if "window_weight" in batch:
        weights_ = weights_ * batch["window_weight"]
    span, sums = qa.span_loss(start_logits, end_logits, batch["start_positions"], batch["end_positions"], weights_,
                              label_smoothing)
    category, _ = cross_entropy_sums(category_logits, batch["category"], weights_, label_smoothing)
    total = (2 * span + category) / 3
    return total, {"loss": total, "category_loss": category, "tokens": sums["tokens"]}


def window_outputs(start_logits, end_logits, category_logits):
    """One row of floats per window, as the eval step returns it: its start logits, end logits,
    then its category logits (`split_outputs` takes them apart)."""
    return jnp.concatenate([start_logits, end_logits, category_logits], axis=-1).astype(jnp.float32)


def split_outputs(rows, seq_length):
    """(start logits, end logits [windows, tokens], category logits [windows, categories])."""
    rows = np.asarray(rows)
    return rows[:, :seq_length], rows[:, seq_length:2 * seq_length], rows[:, 2 * seq_length:]


# ----------------------------------------------------------------------------------------------
# Post-processing and metrics
# ----------------------------------------------------------------------------------------------
def log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def best_answers(examples, feature_examples, start_logits, end_logits, category_logits, offsets, top_k=20,
                 max_answer_length=30, max_long_answer_length=1024):
    """{id: {"category", "answer", "score"}}: each example's category and answer from all its windows.

    `examples` is a list of (id, context), `feature_examples[f]` window f's example index. A window's
    answer score is how much more likely its best answering category is than null (log
    probabilities); the example takes the category of its window with the highest score, or null
    when no window's is above 0. A short or long answer is that window's best span of its `top_k`
    best start and end tokens, at most `max_answer_length` (short) or `max_long_answer_length` (long)
    tokens, as the research project's evaluation picks it; yes / no answer their category's name.
    """
    windows = collections.defaultdict(list)
    for feature, example in enumerate(feature_examples):
        windows[int(example)].append(feature)
    log_probabilities = log_softmax(np.asarray(category_logits, np.float64))
    answers = {}
    for index, (example_id, context) in enumerate(examples):
        features = windows[index]
        scores = [log_probabilities[f, 1:].max() - log_probabilities[f, 0] for f in features]
        best = features[int(np.argmax(scores))]
        score = float(max(scores))
        if score <= 0:
            answers[example_id] = {"category": "null", "answer": "", "score": score}
            continue
        category = CATEGORIES[1 + int(np.argmax(log_probabilities[best, 1:]))]
        text = category
        if category in SPAN_CATEGORIES:
            limit = max_answer_length if category == "short" else max_long_answer_length
            spans = qa.window_spans(start_logits[best], end_logits[best], offsets[best], top_k, limit)
            text = ""
            if spans:
                _, _, _, first, last = max(spans, key=lambda span: span[0])
                text = context[first:last]
        answers[example_id] = {"category": category, "answer": text, "score": score}
    return answers


def predicted_answers(features, rows, data_args, seq_length):
    """`best_answers` of a split's `Features` from the eval step's rows (`window_outputs`)."""
    start_logits, end_logits, category_logits = split_outputs(rows, seq_length)
    return best_answers(list(zip(features.examples["id"], features.examples["context"])),
                        features.windows["example_index"], start_logits, end_logits, category_logits,
                        features.windows["offsets"], data_args.n_best_size, data_args.max_answer_length,
                        data_args.max_long_answer_length)


def is_match(prediction, gold):
    """Exact match of a predicted {category, answer} against an example's gold [(category, text)]:
    null, yes and no by category (null: the example has no answer), short and long by the SQuAD
    normalised text of any gold short or long answer."""
    category = prediction["category"]
    if category == "null":
        return not gold
    if category in YES_NO:
        return any(gold_category == category for gold_category, _ in gold)
    return any(gold_category in SPAN_CATEGORIES and qa.normalize_answer(text) == qa.normalize_answer(
        prediction["answer"]) for gold_category, text in gold)


def category_metrics(predictions, references):
    """In percent over the examples of `references` ({id: [(category, text)]}): exact_match;
    has_answer_exact_match over those with an answer (the research project's EM, which leaves the
    null ones out); category_accuracy (the predicted category among the gold ones, null when none);
    and has_answer_total."""
    matches = {example_id: is_match(predictions[example_id], gold) for example_id, gold in references.items()}
    answered = [example_id for example_id, gold in references.items() if gold]
    right_category = [predictions[example_id]["category"] in ([c for c, _ in gold] or ["null"])
                      for example_id, gold in references.items()]
    results = {"exact_match": 100.0 * np.mean(list(matches.values())),
               "category_accuracy": 100.0 * np.mean(right_category), "has_answer_total": len(answered)}
    if answered:
        results["has_answer_exact_match"] = 100.0 * np.mean([matches[example_id] for example_id in answered])
    return {name: float(value) for name, value in results.items()}


def eval_metrics(means, features, answers):
    """A split's results: the eval step's mean losses over the windows ("features": how many), the
    category metrics of `answers` against the split's references, and "samples", the examples scored."""
    loss_means = {name: value for name, value in means.items() if name != "tokens"}
    return {**loss_means, "features": means["tokens"], **category_metrics(answers, features.references),
            "samples": len(features.examples)}


def write_predictions(run, prefix, answers):
    """`{prefix}_predictions.json`: per example id its category, answer and answer score."""
    run.write_json(f"{prefix}_predictions.json", answers)


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class LongAnswerer(qa.QuestionAnswerer):
    """run_qa.py --answer_categories' predict path for one question and its document: the windows
    of `tasks.question_answering.QuestionAnswerer`, read by the model and its category head (saved
    in the run's weights), then `best_answers` with the run's settings. The answer is the span's
    text (short, long), "yes" / "no", or "" (null); `details` [{category, score}]."""

    MAX_WINDOWS = 64  # a document of several thousand tokens in windows of a few hundred

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        saved = saved_head(output_dir)
        if saved is None:
            raise UsageError(f"{output_dir} holds no answer-category head in its weights: export the model of a "
                             "run_qa.py --answer_categories run again")
        self.head = category_head(self.config, self.model.dtype)
        self.params = {**self.params, HEAD: saved}
        self.settings = dict(top_k=run_args["n_best_size"], max_answer_length=run_args["max_answer_length"],
                             max_long_answer_length=run_args["max_long_answer_length"])

    def window_outputs(self, params, inputs):
        return window_outputs(*answer_logits(self.model, self.head, params, inputs))

    def predict(self, question, context):
        answer = Answer()
        windows, rows = self.read_windows(question, context, answer)
        start_logits, end_logits, category_logits = split_outputs(rows, self.seq_length)
        found = best_answers([("request", context)], [0] * len(windows), start_logits, end_logits, category_logits,
                             np.stack([w.offsets for w in windows]), **self.settings)["request"]
        answer.text, answer.details = found["answer"], [{"category": found["category"], "score": found["score"]}]
        return answer


PREDICTOR = LongAnswerer


def demo_form(st, predictor):
    with st.form("request"):
        question = st.text_input("Question", key="text")
        context = st.text_area("Document", height=250, key="context")
        submitted = st.form_submit_button("Answer")
    if submitted:
        def show():
            answer = predictor(question, context)
            show_answer(st, answer)
            (found,) = answer.details
            st.markdown(f"Answer category: **{escape_markdown(found['category'])}** (score {found['score']:.3f}: "
                        "how much more likely an answer than none, in log probability)")
        return show
