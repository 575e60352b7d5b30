"""Chat and instruction rows for causal-LM fine-tuning (`run_clm_flax.py`): found from the data's
columns, one example per row, the loss on the answers only, the ids an answer ends at, generated
answers cut there and their exact match.

- `messages` rows (a list of {"role", "content"}) are rendered with the tokenizer's chat template
  (`--chat_template FILE` gives or overrides it); every assistant turn is an answer. Which tokens
  are answers comes from rendering the conversation up to each assistant turn: the text the turn
  adds after the template's generation prompt (its content and end-of-turn token) is the answer.
- `prompt` / `completion` rows are the tokenizer's start token (where it has one besides eos), the
  prompt's tokens, then the completion's and the end-of-sequence token: the answer.

A row longer than `--block_size` loses tokens from its start (the prompt's), and a run says how many
rows did; the generation prompt (the conversation up to its last assistant turn, ending in the
template's generation prompt) likewise. Rows are padded to one width, the smallest length bucket
(powers of two from 16, and --block_size) that holds the longest, so every batch has one shape.

An answer ends at any of `end_ids`: the template's end-of-turn token (often not the tokenizer's eos:
Llama 3's <|eot_id|>, Gemma's <end_of_turn>, ChatML's <|im_end|>), the generation config's ids, the model
config's and the tokenizer's eos.
"""

import logging
from typing import NamedTuple

import numpy as np

from tasks.demo import bucket_for, buckets
from utils.base.errors import UsageError

MESSAGES = "messages"
PROMPT, COMPLETION = "prompt", "completion"
ROW_FORMATS = {MESSAGES: (MESSAGES,), "prompt-completion": (PROMPT, COMPLETION)}
logger = logging.getLogger(__name__)


def row_format(columns):
    """"messages", "prompt-completion" or None (plain text) from {split: column names}: every split
    must agree."""
    formats = {split: next((name for name, needed in ROW_FORMATS.items() if set(needed) <= set(names)), None)
               for split, names in columns.items()}
    found = set(formats.values())
    if len(found) > 1:
        listed = ", ".join(f"{split}: {kind or 'text'}" for split, kind in formats.items())
        raise UsageError(f"the data splits hold different kinds of rows ({listed}): give every split "
                         "`messages`, or `prompt` and `completion`, or text")
    return found.pop() if found else None


def read_template(path):
    """The text of `--chat_template` FILE, checked: readable UTF-8, not blank, and a Jinja template
    that compiles (a UsageError naming the file, before any work); None without the flag."""
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            template = f.read()
    except OSError as e:
        raise UsageError(f"--chat_template {path}: {e.strerror}: pass a readable template file")
    except UnicodeDecodeError as e:
        raise UsageError(f"--chat_template {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}): save it as UTF-8")
    if not template.strip():
        raise UsageError(f"--chat_template {path} is empty: give a Jinja template that renders `messages`")
    _compile(template, f"--chat_template {path}")
    return template


def _compile(template, source):
    """Compile a chat template as transformers renders it; a syntax error is a UsageError naming `source`."""
    from jinja2 import TemplateSyntaxError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except TemplateSyntaxError as e:
        raise UsageError(f"{source} is not a valid Jinja template (line {e.lineno}: {e.message}): fix its syntax")


def use_template(tokenizer, path):
    """Install `--chat_template` FILE's template in the tokenizer (it is saved with it)."""
    if path is not None:
        tokenizer.chat_template = read_template(path)


def check_template(tokenizer, kind):
    if kind != MESSAGES:
        return
    if not tokenizer.chat_template:
        raise UsageError("the data has `messages` rows but the tokenizer has no chat template: pass one with "
                         "--chat_template FILE (a Jinja template), or a tokenizer that has one")
    if isinstance(tokenizer.chat_template, str):  # a tokenizer's own (a file's was checked when read)
        _compile(tokenizer.chat_template, "the tokenizer's chat template")


class Example(NamedTuple):
    ids: list  # the row's tokens
    answer: list  # 1 where a token is an answer's, else 0
    prompt: list  # the tokens a generated answer starts from
    reference: str  # the answer generation is scored against


def _render(tokenizer, messages, where, generation_prompt=False):
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # noqa: BLE001 - raise_exception(), an undefined name, or Python's errors in the template
        reason = str(e) if isinstance(e, TemplateError) else f"{type(e).__name__}: {e}"
        raise UsageError(f"{where}: the chat template rejects it ({reason}): fix the row, or give a template that "
                         "takes its roles with --chat_template")


def _check_messages(messages, where):
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: `messages` is not a list of turns: give each row a list of "
                         '{"role": ..., "content": ...}')
    for turn in messages:
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)):
            raise UsageError(f"{where}: a turn of `messages` lacks a text `role` or `content`: give every turn both")
    if not any(turn["role"] == "assistant" for turn in messages):
        raise UsageError(f"{where}: the conversation has no assistant turn, so nothing to learn: add one or drop "
                         "the row")
    empty = next((i for i, turn in enumerate(messages) if turn["role"] == "assistant" and not turn["content"].strip()),
                 None)
    if empty is not None:
        raise UsageError(f"{where}: assistant turn {empty + 1} of `messages` is empty, so it has no answer to learn: "
                         "give it its text, or drop the row")


def encode_conversation(tokenizer, messages, where):
    """The `Example` of one `messages` row (`where` names it in errors)."""
    _check_messages(messages, where)
    text = _render(tokenizer, messages, where)
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], where, generation_prompt=True)
        through = _render(tokenizer, messages[: i + 1], where)
        if not (through.startswith(before) and text.startswith(through)):
            raise UsageError(f"{where}: the chat template renders a conversation's start differently from the whole "
                             "conversation, so its answers cannot be told apart: use a template that renders each "
                             "turn after the ones before (--chat_template)")
        spans.append((len(before), len(through)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    answer = [int(any(start <= first < end for start, end in spans) and last > first)
              for first, last in encoded["offset_mapping"]]
    last_answer = max(i for i, turn in enumerate(messages) if turn["role"] == "assistant")
    prompt = _render(tokenizer, messages[:last_answer], where, generation_prompt=True)
    return Example(encoded["input_ids"], answer, tokenizer(prompt, add_special_tokens=False)["input_ids"],
                   messages[last_answer]["content"])


ANSWER_PROBE = "flaxtune-answer-probe"


def check_template_writes_answers(tokenizer, messages, where):
    """The chat template must write the assistant turns' `content` (a template that ignores it, or
    `messages` altogether, would train on its own fixed text): `messages` (a checked row) rendered with
    a probe as every answer must show the probe."""
    probed = [{**turn, "content": ANSWER_PROBE} if turn["role"] == "assistant" else turn for turn in messages]
    if ANSWER_PROBE not in _render(tokenizer, probed, where):
        raise UsageError(f"the chat template does not write the assistant turns' `content` (tried on {where}), so "
                         "there is no answer to learn: use a template that renders each message's content "
                         "(--chat_template)")


def encode_instruction(tokenizer, prompt, completion, where):
    """The `Example` of one `prompt` / `completion` row."""
    if not isinstance(prompt, str) or not isinstance(completion, str) or not completion.strip():
        raise UsageError(f"{where}: `prompt` and `completion` must be text, the completion not empty: fix the row")
    if tokenizer.eos_token_id is None:
        raise UsageError("prompt / completion rows end each completion with the end-of-sequence token, but the "
                         "tokenizer has none: use a tokenizer with an eos token")
    # The tokenizer's own special tokens may close the text with eos too: only a start token, where it has one.
    start = [tokenizer.bos_token_id] if tokenizer.bos_token_id not in (None, tokenizer.eos_token_id) else []
    prompt_ids = start + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return Example(prompt_ids + answer, [0] * len(prompt_ids) + [1] * len(answer), prompt_ids, completion)


def encode_rows(dataset, tokenizer, kind, split):
    """The `Example` of every row of `dataset` (split `split`), in order."""
    examples = []
    for number, row in enumerate(dataset, start=1):
        where = f"row {number} of the {split} data"
        if kind == MESSAGES:
            if row[MESSAGES] is None and any(row.get(name) is not None for name in (PROMPT, COMPLETION)):
                raise UsageError(f"{where} has `prompt` / `completion` where the other rows have `messages`: give "
                                 "every row of the data one kind")
            examples.append(encode_conversation(tokenizer, row[MESSAGES], where))
            if number == 1:
                check_template_writes_answers(tokenizer, row[MESSAGES], where)
        else:
            examples.append(encode_instruction(tokenizer, row[PROMPT], row[COMPLETION], where))
    return examples


class Rows(NamedTuple):
    arrays: dict  # input_ids, attention_mask, answer_mask [rows, width]
    prompts: dict  # input_ids, attention_mask [rows, prompt width], left-padded for generation
    references: list


def to_arrays(examples, tokenizer, block_size, max_new_tokens, split):
    """`Rows` of `examples`: each cut to its last `block_size` tokens (reported), right-padded to
    the bucket of the longest; generation prompts cut to their last block_size - max_new_tokens
    tokens, left-padded to theirs. A row left without an answer token is dropped (reported)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    kept = [(e.ids[-block_size:], e.answer[-block_size:], e) for e in examples]
    cut = sum(len(e.ids) > block_size for e in examples)
    answerless = {i for i, (_, answer, _) in enumerate(kept) if not any(answer)}
    if cut:
        logger.warning("%s: %d of %d rows are longer than --block_size %d: they lose their first tokens (the "
                       "prompt's start)%s", split, cut, len(examples), block_size,
                       f"; {len(answerless)} of them keep no answer token and are left out" if answerless else "")
    kept = [row for i, row in enumerate(kept) if i not in answerless]
    if not kept:
        raise UsageError(f"no {split} row keeps an answer within --block_size {block_size}: raise --block_size")
    width = bucket_for(max(len(ids) for ids, _, _ in kept), buckets(block_size))
    arrays = {name: np.zeros((len(kept), width), np.int32) for name in ("input_ids", "attention_mask", "answer_mask")}
    arrays["input_ids"][:] = pad
    for row, (ids, answer, _) in enumerate(kept):
        arrays["input_ids"][row, :len(ids)] = ids
        arrays["attention_mask"][row, :len(ids)] = 1
        arrays["answer_mask"][row, :len(ids)] = answer
    prompt_limit = block_size - max_new_tokens
    prompts = [e.prompt[-prompt_limit:] for _, _, e in kept]
    cut_prompts = sum(len(e.prompt) > prompt_limit for _, _, e in kept)
    if cut_prompts:
        logger.warning("%s: %d generation prompts are longer than --block_size %d - --max_new_tokens %d: they lose "
                       "their first tokens", split, cut_prompts, block_size, max_new_tokens)
    prompt_width = bucket_for(max(map(len, prompts)), buckets(prompt_limit))
    left = {"input_ids": np.full((len(prompts), prompt_width), pad, np.int32),
            "attention_mask": np.zeros((len(prompts), prompt_width), np.int32)}
    for row, ids in enumerate(prompts):
        left["input_ids"][row, prompt_width - len(ids):] = ids
        left["attention_mask"][row, prompt_width - len(ids):] = 1
    return Rows(arrays, left, [e.reference for _, _, e in kept])


# ----------------------------------------------------------------------------------------------
# Where an answer ends, generated answers
# ----------------------------------------------------------------------------------------------
# What `end_of_turn` renders: an assistant turn whose text is found again in the rendering.
PROBE_QUESTION, PROBE_ANSWER = "Which answer?", "This answer"


def end_of_turn(tokenizer):
    """The id of the special token the tokenizer's chat template closes an assistant turn with (Llama 3's
    <|eot_id|>, Gemma's <end_of_turn>, ChatML's <|im_end|>, Phi-3's <|end|>), or None: a small conversation
    rendered as training renders it (the assistant's turn last), and the first token after the answer's text,
    whitespace skipped, taken where it is a special token. A template whose turns end otherwise (plain text, or
    nothing) is said in the log."""
    from jinja2 import TemplateError

    if not tokenizer.chat_template:
        return None
    messages = [{"role": "user", "content": PROBE_QUESTION}, {"role": "assistant", "content": PROBE_ANSWER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except (TemplateError, ValueError, TypeError) as e:
        logger.warning("the chat template could not render a user and an assistant turn (%s), so its end-of-turn "
                       "token is unknown: generation stops at the other end ids", e)
        return None
    after = text[text.rfind(PROBE_ANSWER) + len(PROBE_ANSWER):] if PROBE_ANSWER in text else ""
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    first = next((i for i in ids if tokenizer.decode([i]).strip()), None)
    special = set(tokenizer.all_special_ids) | {i for i, token in tokenizer.added_tokens_decoder.items()
                                                if token.special}
    if first is None or first not in special:
        logger.warning("the chat template ends an assistant turn with no special token (it renders %r after the "
                       "answer): generation stops at the other end ids", after)
        return None
    return first


def _listed(token_ids):
    """An `eos_token_id` of a config (None, an int or a list) as a list."""
    if token_ids is None:
        return []
    return [int(i) for i in token_ids] if isinstance(token_ids, (list, tuple)) else [int(token_ids)]


def end_ids(tokenizer, config, generation_config):
    """Every id generation stops at, logged with its token and where it comes from: the chat template's end of
    turn first (the one a chat model ends its answers with), then those the generation config lists, the model
    config's and the tokenizer's eos; each once."""
    sources = {}
    for source, ids in (("the chat template's end of turn", _listed(end_of_turn(tokenizer))),
                        ("the generation config", _listed(generation_config.eos_token_id)),
                        ("the model config", _listed(getattr(config, "eos_token_id", None))),
                        ("the tokenizer's eos", _listed(tokenizer.eos_token_id))):
        for token_id in ids:
            sources.setdefault(token_id, []).append(source)
    listed = "; ".join(f"{token_id} {tokenizer.convert_ids_to_tokens(token_id)!r} ({', '.join(where)})"
                       for token_id, where in sources.items())
    logger.info("generation stops at %s", listed or "no end id: every answer runs to its length limit")
    return list(sources)


def until_end(ids, end_token_ids):
    """`ids` (generated tokens) up to the first end id, which is left out."""
    ids = [int(i) for i in ids]
    return ids[:next((n for n, token in enumerate(ids) if token in end_token_ids), len(ids))]


def answer_texts(tokenizer, generated, end_token_ids):
    """The text of each row of generated token ids [rows, new tokens], up to its first end id."""
    return [tokenizer.decode(until_end(ids, end_token_ids), skip_special_tokens=True) for ids in generated]


def normalise(text):
    return " ".join(text.split())


def exact_match(predictions, references):
    """The share of predictions equal to their reference, whitespace normalised."""
    return float(np.mean([normalise(p) == normalise(r) for p, r in zip(predictions, references)]))
