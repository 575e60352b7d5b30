"""Causal language modelling (`run_clm_flax.py`): the text in blocks, or chat and instruction rows
one per example (`tasks.chat`), the next-token loss (on the answers only for rows) and perplexity,
greedy answers and their exact match, and the text-generation demo."""

import jax
import jax.numpy as jnp
import numpy as np

from tasks import Task, chat, lm
from tasks.demo import (Answer, BadInput, Predictor, bucket_for, buckets, escape_markdown, require_text,
                        show_answer)
from utils import dataset_loading, lm_head
from utils.errors import UsageError
from utils.run import needed_splits, phase_datasets

PREDICTIONS_FILE = "generated_predictions.txt"
TASK = Task("causal-lm", "text-generation", outputs=(PREDICTIONS_FILE,), widget="prompt")
ROW_FILE_FORMATS = ("json",)


# ----------------------------------------------------------------------------------------------
# Examples
# ----------------------------------------------------------------------------------------------
def fit_block_size(data_args, tokenizer, config):
    """--block_size, by default min(1024, the tokenizer's max length); at most the model's positions."""
    return lm.sequence_length(data_args.block_size, 1024, tokenizer, config, "block_size")


def check_before_work(training_args, data_args, task, model_args):
    """(`Preflight`, the rows' format: "messages", "prompt-completion", or None for text) of a run
    (`lm.check_before_work`, with --test_file for --do_predict). Local files tell their rows' format
    now; a hub dataset's is read once it is loaded (`rows_format_of`)."""
    preflight = lm.check_before_work(training_args, data_args, task, model_args, data_args.test_file)
    chat.read_template(data_args.chat_template)  # the file checked now; installed with the tokenizer
    if not preflight.columns:
        return preflight, None
    rows = chat.row_format(preflight.columns)
    check_row_arguments(rows, data_args)
    return preflight, rows


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
    raw = dataset_loading.load_splits(data_args, wanted, cache_dir, allowed=ROW_FILE_FORMATS)
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
    tokens. `logits` may be the LM head's `utils.lm_head.HeadInputs` (--chunked_loss).
    """
    weights = None if answer_mask is None else answer_mask[:, 1:].astype(jnp.float32)
    scored = (lm_head.without_last_position(logits) if isinstance(logits, lm_head.HeadInputs)
              else logits[:, :-1])
    return lm.token_sums(scored, input_ids[:, 1:], weights, example_weight=example_weight,
                         label_smoothing=label_smoothing)


def generate_answers(model, params, batch, max_new_tokens, tokenizer):
    """The `max_new_tokens` tokens greedy decoding appends to each left-padded prompt of `batch`
    (traceable: the generate step)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sequences = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], params=params,
                               max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                               eos_token_id=tokenizer.eos_token_id).sequences
    return sequences[:, batch["input_ids"].shape[1]:]


# ----------------------------------------------------------------------------------------------
# The demo page (demo.py): the predictor and the form asking for its input
# ----------------------------------------------------------------------------------------------
class TextGenerator(Predictor):
    """Continues a prompt, greedily or by sampling with a seed; a model whose tokenizer has a chat
    template (`chat`) answers a conversation instead: its turns rendered as the training script
    renders a generation prompt (`reply`). Prompts are left-padded to a bucket and every request
    generates `max_new_tokens` tokens, cut to the number asked for: the tokens before a cut do not
    depend on where it is (greedy, and sampling's per-step keys alike), so one program per (bucket,
    greedy or sampling) serves every length."""

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
        self.chat = bool(self.tokenizer.chat_template)
        self._programs = {sample: jax.jit(lambda params, ids, mask, key, sample=sample: self.model.generate(
            ids, attention_mask=mask, params=params, max_new_tokens=self.max_new_tokens, do_sample=sample,
            prng_key=key, pad_token_id=self.pad_id, eos_token_id=self.eos_id).sequences) for sample in (False, True)}

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
        sequences = np.asarray(self._programs[sample](self.params, padded, mask, jax.random.PRNGKey(seed)))
        new = list(sequences[0, size:size + max_new_tokens])
        if self.eos_id is not None and self.eos_id in new:
            new = new[:new.index(self.eos_id)]
        return answer, ids, new

    def warm_up(self):
        for size in self.prompt_buckets:
            for sample in (False, True):
                ids = np.full((1, size), self.pad_id, np.int32)
                self._programs[sample](self.params, ids, np.ones_like(ids), jax.random.PRNGKey(0)).block_until_ready()


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
