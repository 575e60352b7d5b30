"""Causal language modelling (`run_clm_flax.py`): the text in blocks, or chat and instruction rows
one per example (`tasks.chat`), the next-token loss (on the answers only for rows) and perplexity,
answers generated greedily or sampled, up to their first end id, and the text-generation demo."""

import copy
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from transformers import GenerationConfig
from transformers.generation.flax_logits_process import (FlaxLogitsProcessor, FlaxLogitsProcessorList,
                                                         FlaxTemperatureLogitsWarper, FlaxTopKLogitsWarper,
                                                         FlaxTopPLogitsWarper)

from tasks import Task, chat, lm
from tasks.demo import (Answer, BadInput, Predictor, bucket_for, buckets, escape_markdown, require_text,
                        show_answer)
from utils.base.errors import UsageError
from utils.data import loaders
from utils.kernels import lm_head
from utils.layout import devices
from utils.models.family_model import FamilyModel
from utils.run.preflight import needed_splits, phase_datasets

PREDICTIONS_FILE = "generated_predictions.txt"
ROW_FILE_FORMATS = ("json",)
DEFAULT_GENERATION = GenerationConfig()


# ----------------------------------------------------------------------------------------------
# Examples
# ----------------------------------------------------------------------------------------------
def fit_block_size(data_args, tokenizer, config):
    """--block_size, by default min(1024, the tokenizer's max length); at most the model's positions."""
    return lm.sequence_length(data_args.block_size, 1024, tokenizer, config, "block_size")


def check_data(columns, model_args, data_args, training_args):
    """The rows' format, "messages", "prompt-completion", or None for text (`chat.row_format`), after the
    LM checks (`lm.check_data`) and the --chat_template file's. Local files tell their rows' format now; a hub
    dataset's is read once it is loaded (`rows_format_of`)."""
    lm.check_data(columns, model_args, data_args, training_args)
    chat.read_template(data_args.chat_template)  # the file checked now; installed with the tokenizer
    if not columns:
        return None
    rows = chat.row_format(columns)
    check_row_arguments(rows, data_args)
    return rows


def check_row_arguments(rows, data_args):
    """The flags that apply to chat or instruction rows only, and the one that applies to text only."""
    if rows and data_args.streaming:
        raise UsageError("--streaming reads text; chat and instruction rows are read into memory, one example "
                         "each: drop --streaming")
    if rows is None:
        for flag, given in (("test_file", data_args.test_file), ("chat_template", data_args.chat_template),
                            ("predict_with_generate", data_args.predict_with_generate)):
            if given:
                raise UsageError(f"--{flag} applies to chat or instruction rows (`messages`, or `prompt` and "
                                 f"`completion`), but the data is text: drop --{flag}")


# The LM checks, with the rows' format found by `check_data`.
TASK = Task("causal-lm", "text-generation", outputs=(PREDICTIONS_FILE,), widget="prompt",
            **{**lm.INPUTS, "check_data": check_data})


def rows_format_of(raw, data_args):
    """The rows' format of a loaded hub dataset (`check_before_work` for local files)."""
    rows = chat.row_format({split: dataset.column_names for split, dataset in raw.items()})
    check_row_arguments(rows, data_args)
    return rows


def load_row_splits(data_args, training_args, cache_dir):
    """{split: dataset} of the splits the run's phases read, --max_*_samples applied; the validation
    rows carved off the training rows when there is no validation file."""
    files = {"train": data_args.train_file, "validation": data_args.validation_file, "test": data_args.test_file}
    splits = needed_splits(training_args)
    wanted = {split: files[split] for split in splits}
    if "validation" in wanted and not wanted["validation"] and not data_args.dataset_name:
        wanted["train"] = data_args.train_file
    raw = loaders.load_splits(data_args, wanted, cache_dir, allowed=ROW_FILE_FORMATS)
    if "validation" in splits and "validation" not in raw and "train" in raw:
        raw["train"], raw["validation"] = lm.split_off_validation(raw["train"], data_args.validation_split_percentage)
    return phase_datasets(raw, {split: split for split in splits}, data_args)


def read_rows(raw, rows, tokenizer, block_size, max_new_tokens):
    """{split: `chat.Rows`} of each loaded split: every row checked and encoded (`chat.encode_rows`),
    cut and padded (`chat.to_arrays`)."""
    if max_new_tokens >= block_size:
        raise UsageError(f"--max_new_tokens {max_new_tokens} leaves no room for a prompt in --block_size "
                         f"{block_size}: lower it")
    return {split: chat.to_arrays(chat.encode_rows(dataset, tokenizer, rows, split), tokenizer, block_size,
                                  max_new_tokens, split)
            for split, dataset in raw.items()}


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
def next_token_loss(logits, input_ids, example_weight=None, label_smoothing=0.0, answer_mask=None):
    """(loss sum, {"loss", "tokens"}) of predicting each next token of a block.

    The labels are the inputs shifted by one: position t predicts token t + 1, the last position
    nothing, so a block of n tokens scores n - 1. With `answer_mask` (chat and instruction rows)
    only the answers' tokens are scored. `example_weight` (eval: 0 for padded rows) scales a row's
    tokens. `logits` may be the LM head's `utils.kernels.lm_head.HeadInputs` (--chunked_loss).
    """
    weights = None if answer_mask is None else answer_mask[:, 1:].astype(jnp.float32)
    scored = (lm_head.without_last_position(logits) if isinstance(logits, lm_head.HeadInputs)
              else logits[:, :-1])
    return lm.token_sums(scored, input_ids[:, 1:], weights, example_weight=example_weight,
                         label_smoothing=label_smoothing)


class Decoding(NamedTuple):
    """How answers are generated: the ids that end one (`chat.end_ids`; the first is the one Flax's loop stops
    at), and greedily or by sampling with these settings (`temperature`, `top_k` 0 for no cut, `top_p`)."""
    end_ids: tuple
    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0


def decoding_of(data_args, end_ids):
    """The `Decoding` of run_clm_flax.py's arguments (--do_sample, --temperature, --top_k, --top_p)."""
    if not data_args.do_sample:
        return Decoding(tuple(end_ids))
    return Decoding(tuple(end_ids), True, 1.0 if data_args.temperature is None else data_args.temperature,
                    data_args.top_k or 0, 1.0 if data_args.top_p is None else data_args.top_p)


def generation_inputs(prompts, decoding, seed):
    """The generate step's rows: the left-padded `prompts` and, when sampling, each row's key (`sample_keys`)."""
    if not decoding.sample:
        return prompts
    return {**prompts, "sample_key": sample_keys(seed, len(prompts["input_ids"]))}


def exported_generation(decoding):
    """The generation config's settings that record `decoding` in the export (generation_config.json), so that
    the demo, transformers and serving engines stop and sample as the run did: every end id (a list when there
    are several)."""
    ends = list(decoding.end_ids)
    settings = {"eos_token_id": ends[0] if len(ends) == 1 else ends or None}
    if decoding.sample:
        settings.update(do_sample=True, temperature=decoding.temperature, top_k=decoding.top_k, top_p=decoding.top_p)
    return settings


def sample_keys(seed, rows):
    """Each row's sampling key [rows, 2], made on the host's CPU: (seed, the row's place among the rows) folded,
    so a row draws the same tokens in any batch, on any device, in any layout, and no two rows draw alike."""
    with jax.default_device(devices.host_cpu()):
        root = jax.random.PRNGKey(seed)
        return np.asarray(jax.vmap(jax.random.fold_in, (None, 0))(root, jnp.arange(rows)))


class NextToken(FlaxLogitsProcessor):
    """The scores whose argmax Flax's greedy loop takes as the next token: with `decoding.sample`, warped
    (temperature, top-k, top-p, as transformers warps them) and perturbed by Gumbel noise from each row's own key
    and the number of tokens it has generated (the argmax is then a draw from the warped distribution:
    `jax.random.categorical`'s own method); and where the pick is an end id other than the first, the first put
    in its place, so that the loop, which stops at one id, stops the row there."""

    def __init__(self, decoding, keys, prompt_width):
        self.decoding, self.keys, self.prompt_width = decoding, keys, prompt_width
        warpers = []
        if decoding.temperature != 1.0:
            warpers.append(FlaxTemperatureLogitsWarper(decoding.temperature))
        if decoding.top_k:
            warpers.append(FlaxTopKLogitsWarper(decoding.top_k))
        if decoding.top_p < 1.0:
            warpers.append(FlaxTopPLogitsWarper(decoding.top_p))
        self.warp = FlaxLogitsProcessorList(warpers)

    def __call__(self, input_ids, scores, cur_len):
        scores = scores.astype(jnp.float32)
        if self.decoding.sample:
            scores = self.warp(input_ids, scores, cur_len)
            drawn = cur_len - self.prompt_width

            def noise(key):
                return jax.random.gumbel(jax.random.fold_in(key, drawn), scores.shape[-1:])

            scores = scores + jax.vmap(noise)(self.keys)
        if len(self.decoding.end_ids) > 1:
            ends = jnp.isin(scores.argmax(-1), jnp.asarray(self.decoding.end_ids))
            first_only = jnp.where(jnp.arange(scores.shape[-1]) == self.decoding.end_ids[0], 0.0, -jnp.inf)
            scores = jnp.where(ends[:, None], first_only, scores)
        return scores


def generate_answers(model, params, batch, max_new_tokens, decoding):
    """The `max_new_tokens` tokens appended to each left-padded prompt of `batch` (with `decoding.sample`, its
    rows' "sample_key"s: `sample_keys`), greedy or sampled; a row that ends goes on with the first end id
    (traceable: the generate step).

    transformers' Flax `generate` stops a row at one id and samples with one key for the whole batch: its greedy
    loop runs here with `NextToken` choosing, so every end id stops a row and each row draws from its own key. A
    model of the project's decoder family runs its own loop (`FamilyModel.generate_tokens`) with the same
    chooser, a finished row going on with the first end id as transformers' loop pads it."""
    width = batch["input_ids"].shape[1]
    # No end id at all: one no row can draw (past the vocabulary), so every row runs to max_new_tokens.
    first_end = decoding.end_ids[0] if decoding.end_ids else model.config.vocab_size
    choose = NextToken(decoding, batch.get("sample_key"), width)
    if isinstance(model, FamilyModel):  # the family's own KV-cache loop, choosing and stopping alike
        return model.generate_tokens(params, batch["input_ids"], batch["attention_mask"], max_new_tokens,
                                     lambda logits, drawn: choose(None, logits, width + drawn).argmax(-1),
                                     first_end if decoding.end_ids else None)
    # The model's other generation settings hold (a checkpoint's suppressed tokens...); its sampling ones are
    # `decoding`'s, applied by `NextToken`: reset, so `generate` does not warn that greedy search ignores them.
    settings = copy.deepcopy(model.generation_config)
    settings.update(**{name: getattr(DEFAULT_GENERATION, name) for name in ("do_sample", "temperature", "top_k",
                                                                             "top_p")})
    sequences = model.generate(batch["input_ids"], generation_config=settings, attention_mask=batch["attention_mask"],
                               params=params, max_new_tokens=max_new_tokens, eos_token_id=first_end,
                               pad_token_id=first_end if decoding.end_ids else 0,
                               logits_processor=FlaxLogitsProcessorList([choose])).sequences
    return sequences[:, width:]


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class TextGenerator(Predictor):
    """Continues a prompt, greedily or by sampling with a seed; a model whose tokenizer has a chat
    template (`chat`) answers a conversation instead: its turns rendered as the training script
    renders a generation prompt (`reply`). It generates as the script does (`generate_answers`), up to the
    first of the end ids the export records (`chat.end_ids`), sampling with the export's settings. Prompts are
    left-padded to a bucket and every request generates `max_new_tokens` tokens, cut to the number asked for:
    the tokens before a cut do not depend on where it is (greedy, and sampling's keys per token drawn alike), so
    one program per (bucket, greedy or sampling) serves every length."""

    auto_class = "FlaxAutoModelForCausalLM"

    def __init__(self, output_dir, run_args):
        super().__init__(output_dir, run_args)
        positions = self.config.max_position_embeddings if hasattr(self.config, "max_position_embeddings") else None
        positions = positions or getattr(self.config, "n_positions", None) or 1024
        self.max_new_tokens = min(64, positions // 2)
        self.prompt_buckets = buckets(positions - self.max_new_tokens, smallest=32)
        self.chat = bool(self.tokenizer.chat_template)
        # The export's generation config (generation_config.json) holds the run's end ids and sampling settings.
        settings = self.model.generation_config
        self.end_ids = chat.end_ids(self.tokenizer, self.config, settings)
        self.pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else (
            self.end_ids[0] if self.end_ids else 0)
        decodings = {False: Decoding(tuple(self.end_ids)),
                     True: Decoding(tuple(self.end_ids), True, settings.temperature or 1.0, settings.top_k or 0,
                                    settings.top_p or 1.0)}
        self._programs = {sample: jax.jit(lambda params, batch, decoding=decoding: generate_answers(
            self.model, params, batch, self.max_new_tokens, decoding)) for sample, decoding in decodings.items()}

    def predict(self, prompt, max_new_tokens=32, sample=False, seed=0):
        require_text(prompt, "prompt")
        ids = self.tokenizer(prompt)["input_ids"]  # as training encoded its text (special tokens included)
        answer, ids, new = self._continue(ids, max_new_tokens, sample, seed, "the prompt")
        answer.text = self.tokenizer.decode(ids + new, skip_special_tokens=True)
        answer.details = [self.tokenizer.decode(new, skip_special_tokens=True)]
        return answer

    def reply(self, messages, max_new_tokens=32, sample=False, seed=0):
        """The assistant's next turn after `messages` ({"role", "content"}, the user's last)."""
        require_text(messages[-1]["content"] if messages else "", "message")
        prompt = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]  # as chat rows are encoded
        answer, _, new = self._continue(ids, max_new_tokens, sample, seed, "the conversation")
        answer.text = self.tokenizer.decode(new, skip_special_tokens=True).strip()
        return answer

    def _continue(self, ids, max_new_tokens, sample, seed, what):
        """(`Answer` with its notes, the ids kept, the new ids up to the end token)."""
        if not 1 <= max_new_tokens <= self.max_new_tokens:
            raise BadInput(f"max new tokens must be between 1 and {self.max_new_tokens}, got {max_new_tokens}")
        answer = Answer()
        limit = self.prompt_buckets[-1]
        if len(ids) > limit:
            answer.notes.append(f"{what} has {len(ids)} tokens; the model continues its last {limit}")
            ids = ids[-limit:]
        size = bucket_for(len(ids), self.prompt_buckets)
        padded = np.full((1, size), self.pad_id, np.int32)
        padded[0, size - len(ids):] = ids
        mask = np.zeros((1, size), np.int32)
        mask[0, size - len(ids):] = 1
        batch = {"input_ids": padded, "attention_mask": mask, "sample_key": sample_keys(seed, 1)}
        new = chat.until_end(np.asarray(self._programs[sample](self.params, batch))[0, :max_new_tokens], self.end_ids)
        return answer, ids, new

    def warm_up(self):
        for size in self.prompt_buckets:
            for sample in (False, True):
                ids = np.full((1, size), self.pad_id, np.int32)
                batch = {"input_ids": ids, "attention_mask": np.ones_like(ids), "sample_key": sample_keys(0, 1)}
                self._programs[sample](self.params, batch).block_until_ready()


PREDICTOR = TextGenerator


def demo_form(st, predictor):
    if predictor.chat:
        return chat_box(st, predictor)
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


def chat_box(st, predictor):
    """The conversation of this browser session so far, and a box for the next message."""
    conversation = st.session_state.setdefault("conversation", [])
    for turn in conversation:
        st.chat_message(turn["role"]).markdown(escape_markdown(turn["content"]))
    said = st.chat_input("Your message", key="message")
    if not said:
        return None

    def show():
        answer = predictor.reply(conversation + [{"role": "user", "content": said}], min(32, predictor.max_new_tokens))
        conversation.extend([{"role": "user", "content": said}, {"role": "assistant", "content": answer.text}])
        st.chat_message("user").markdown(escape_markdown(said))
        with st.chat_message("assistant"), st.container(key="answer"):
            st.markdown(escape_markdown(answer.text))
            for note in answer.notes:
                st.caption(note)
    return show
