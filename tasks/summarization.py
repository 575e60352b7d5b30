"""Summarization (`run_summarization_flax.py`): the document and summary columns, the examples
tokenized to fixed lengths, the loss over the summary tokens, generation and ROUGE, the generated
lines, and the demo predictor.

The script's predict path and the demo share one definition of each step (inputs encoded and sized
the way the model was trained, generation with the settings saved beside the model, outputs decoded
into the lines the result files hold), so the page shows what the script writes."""

import logging
import os
from typing import NamedTuple

import jax
import numpy as np

from tasks import Task
from tasks.demo import Answer, Predictor, require_text, show_answer, truncation_note
from tasks.lm import token_sums
from utils.base.errors import UsageError
from utils.data import arrow_columns, file_formats
from utils.models.loading import decoder_input_ids, fit_length, max_positions
from utils.run.preflight import column_check
from utils.run.run_directory import one_line
from utils.scoring.metrics import rouge

PREDICTIONS_FILE = "generated_predictions.txt"
FILE_FORMATS = ("json", "csv")
logger = logging.getLogger(__name__)

# (document column, summary column) of well-known hub datasets.
SUMMARIZATION_COLUMNS = {
    "amazon_reviews_multi": ("review_body", "review_title"),
    "big_patent": ("description", "abstract"),
    "cnn_dailymail": ("article", "highlights"),
    "orange_sum": ("text", "summary"),
    "pn_summary": ("article", "summary"),
    "psc": ("extract_text", "summary_text"),
    "samsum": ("dialogue", "summary"),
    "thaisum": ("body", "summary"),
    "xglue": ("news_body", "news_title"),
    "xsum": ("document", "summary"),
    "wiki_summary": ("article", "highlights"),
    "multi_news": ("document", "summary"),
}
MODEL_INPUTS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
INPUT_COLUMNS = MODEL_INPUTS + ("labels",)


# ----------------------------------------------------------------------------------------------
# Model and lengths
# ----------------------------------------------------------------------------------------------
def check_config(config):
    """The model config must name the token that starts the decoder."""
    if config.decoder_start_token_id is None:
        raise UsageError(f"the {config.model_type} config has no decoder_start_token_id: set it in the config")


def _encoder_and_decoder(config):
    return (config.encoder, config.decoder) if config.model_type == "encoder-decoder" else (config, config)


def source_length(max_source_length, config):
    """--max_source_length, at most the encoder's positions: what the script and the demo encode to."""
    return fit_length(max_source_length, max_positions(_encoder_and_decoder(config)[0]), "max_source_length", logger)


class Lengths(NamedTuple):
    source: int  # document tokens
    target: int  # summary tokens in training
    eval_target: int  # summary tokens in eval and predict, and the most that generate writes


def fit_lengths(data_args, config):
    """The `Lengths` of --max_source_length, --max_target_length and --val_max_target_length, each at
    most the model's positions (with a warning where one is lowered)."""
    decoder_positions = max_positions(_encoder_and_decoder(config)[1])
    return Lengths(source_length(data_args.max_source_length, config),
                   *(fit_length(getattr(data_args, name), decoder_positions, name, logger)
                     for name in ("max_target_length", "val_max_target_length")))


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------
def resolve_columns(data_args, columns):
    """(document column, summary column): explicit, the dataset's known pair, or the first two.

    `columns` maps each split to its column names; every split must have both columns.
    """
    known = SUMMARIZATION_COLUMNS.get(os.path.basename(data_args.dataset_name or ""))
    split, names = next(iter(columns.items()))
    defaults = known or tuple(names[:2])
    text = data_args.text_column or defaults[0]
    summary = data_args.summary_column or (defaults[1] if len(defaults) > 1 else None)
    if summary is None:
        raise UsageError(f"the {split} data has only the column {names[0]!r}: summarization needs a document "
                         "column and a summary column (--text_column, --summary_column)")
    file_formats.require_columns(columns, (("text_column", text), ("summary_column", summary)))
    return text, summary


TASK = Task("summarization", "summarization", outputs=(PREDICTIONS_FILE,), widget="text", file_formats=FILE_FORMATS,
            check_data=column_check(resolve_columns))


def drop_empty(datasets, columns, data_args):
    """{split: its examples with a document and a summary}: empty ones teach nothing and break ROUGE.
    How many each split drops is logged; a split left with none is an error."""
    text_column, summary_column = columns

    def usable(example):
        return bool(str(example[text_column] or "").strip()) and bool(str(example[summary_column] or "").strip())

    kept = {}
    for split, dataset in datasets.items():
        kept[split] = dataset.filter(usable, num_proc=data_args.preprocessing_num_workers,
                                     load_from_cache_file=not data_args.overwrite_cache,
                                     desc="dropping empty examples")
        if len(kept[split]) < len(dataset):
            logger.warning("%s: dropped %d examples with an empty document or summary", split,
                           len(dataset) - len(kept[split]))
        if len(kept[split]) == 0:
            raise UsageError(f"the {split} data has no usable examples (all documents or summaries are empty)")
    return kept


def tokenize(dataset, tokenizer, config, data_args, columns, source_length, target_length):
    """The examples tokenized to fixed lengths; the labels are the summary, the decoder inputs the
    labels shifted right (by the family's convention)."""
    text_column, summary_column = columns

    def encode(examples):
        model_inputs = encode_sources(tokenizer, examples[text_column], data_args.source_prefix, source_length)
        labels = tokenizer(text_target=examples[summary_column], max_length=target_length,
                           padding="max_length", truncation=True, return_tensors="np")
        model_inputs["labels"] = labels["input_ids"]
        model_inputs["decoder_input_ids"] = decoder_input_ids(labels["input_ids"], config)
        model_inputs["decoder_attention_mask"] = labels["attention_mask"]
        return model_inputs

    return dataset.map(encode, batched=True, num_proc=data_args.preprocessing_num_workers,
                       remove_columns=dataset.column_names, load_from_cache_file=not data_args.overwrite_cache,
                       desc="tokenizing")


def preprocess(datasets, tokenizer, config, data_args, columns, lengths):
    """({split: arrays of `INPUT_COLUMNS`}, {split: examples}): each split `tokenize`d, its summaries
    to `lengths.target` tokens in "train", else `lengths.eval_target`."""
    arrays, sizes = {}, {}
    for split, dataset in datasets.items():
        target_length = lengths.target if split == "train" else lengths.eval_target
        tokenized = tokenize(dataset, tokenizer, config, data_args, columns, lengths.source, target_length)
        arrays[split], sizes[split] = arrow_columns.to_arrays(tokenized, INPUT_COLUMNS), len(tokenized)
        logger.info("%s: %d examples", split, len(tokenized))
    return arrays, sizes


# ----------------------------------------------------------------------------------------------
# Loss
# ----------------------------------------------------------------------------------------------
def summary_loss(logits, labels, decoder_attention_mask, example_weight=None, label_smoothing=0.0):
    """(loss sum, {"loss", "tokens"}) over the summary tokens; the padding after a summary counts nothing.

    The decoder inputs are the labels shifted right (see `tokenize`), so position t predicts
    label t. `example_weight` (eval/predict: 0 for padded rows) scales a row's tokens.
    """
    return token_sums(logits, labels, decoder_attention_mask, example_weight, label_smoothing)


# ----------------------------------------------------------------------------------------------
# Generation, metrics, the generated lines
# ----------------------------------------------------------------------------------------------
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


def generation_metrics(tokenizer, predictions, labels, pad_token_id):
    """(ROUGE of the generated summaries against the reference `labels`, and "gen_len", the mean
    generated length in tokens; the generated texts, one per line of `PREDICTIONS_FILE`)."""
    texts = decode_texts(tokenizer, predictions)
    metrics = rouge(texts, tokenizer.batch_decode(labels, skip_special_tokens=True))
    metrics["gen_len"] = float(np.mean([np.count_nonzero(ids != pad_token_id) for ids in predictions]))
    return metrics, texts


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class Summarizer(Predictor):
    """run_summarization_flax.py's predict path for one document: its source prefix and length (the
    saved --max_source_length fitted to the model, as the script fits it), and the generation
    settings it saved (generation_config.json)."""

    auto_class = "FlaxAutoModelForSeq2SeqLM"

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        self.prefix = run_args.get("source_prefix") or ""
        self.max_length = source_length(run_args["max_source_length"], self.config)
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
