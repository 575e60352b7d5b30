"""tasks/chat.py and the chat parts of tasks/causal_lm.py: which tokens are answers (against
transformers' own assistant mask), the loss on them alone (against a plain numpy cross-entropy), one
example per row cut and padded as documented, exact match, and one line for each kind of bad row."""

import copy
import json
import logging
import os
import re

import numpy as np
import pytest
from transformers import AutoTokenizer

from tasks import chat
from tasks.causal_lm import next_token_loss
from tests.script_runner import ROOT
from utils.base.errors import UsageError

DATA = os.path.join(ROOT, "data", "chat")
# data/chat's template with the answers' generation blocks starting at their first word: transformers
# finds an answer's tokens by the characters the block starts and ends at, and a block starting with
# the space that the shipped template puts before each answer starts inside a token.
HF_MASKABLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ '<|' + message['role'] + '|>' + message['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


END_OF_TURN = "<|end|>"


def save_end_of_turn_tokenizer(directory):
    """data/chat's tokenizer, its template ending each assistant turn with <|end|> (a special token of its own,
    as Phi-3's does) where the shipped one ends it with eos: its eos stays </s>. Saved in `directory`."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(DATA, "tokenizer"))
    tokenizer.add_tokens([END_OF_TURN], special_tokens=True)
    shipped = "message['content'] + eos_token"
    assert tokenizer.chat_template.count(shipped) == 1
    tokenizer.chat_template = tokenizer.chat_template.replace(shipped, f"message['content'] + '{END_OF_TURN}'")
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(os.path.join(DATA, "tokenizer"))


def conversations(count, split="train"):
    with open(os.path.join(DATA, f"{split}.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["messages"] for line, _ in zip(f, range(count))]


def test_answer_mask_is_transformers_assistant_mask():
    """Over conversations with a system turn, one or two exchanges: the same tokens, the same answers."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(DATA, "tokenizer"))
    tokenizer.chat_template = HF_MASKABLE_TEMPLATE
    rows = conversations(60)
    assert {len(messages) for messages in rows} >= {2, 3, 4, 5}
    for number, messages in enumerate(rows):
        ours = chat.encode_conversation(tokenizer, messages, f"row {number}")
        theirs = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        assert ours.ids == theirs["input_ids"]
        assert ours.answer == theirs["assistant_masks"], number
        assert sum(ours.answer) > 0


def test_the_shipped_template_marks_each_answer_and_its_end_token(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1 plus 2?"},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "Reverse: cat dog owl"},
                {"role": "assistant", "content": "owl dog cat"}]
    example = chat.encode_conversation(tokenizer, messages, "row 1")
    answers = tokenizer.decode([i for i, a in zip(example.ids, example.answer) if a])
    assert answers == " 3</s> owl dog cat</s>"
    assert tokenizer.decode(example.prompt) == "<s><|system|> Be brief.<|user|> What is 1 plus 2?<|assistant|> 3</s>" \
                                               "<|user|> Reverse: cat dog owl<|assistant|>"
    assert example.reference == "owl dog cat"


def test_an_instruction_row_is_the_prompt_then_the_completion_and_eos(tokenizer):
    example = chat.encode_instruction(tokenizer, "Question: What is 2 plus 2?\nAnswer:", " 4", "row 1")
    prompt = tokenizer("Question: What is 2 plus 2?\nAnswer:", add_special_tokens=False)["input_ids"]
    answer = tokenizer(" 4", add_special_tokens=False)["input_ids"]
    assert example.ids == [tokenizer.bos_token_id] + prompt + answer + [tokenizer.eos_token_id]
    assert example.answer == [0] * (1 + len(prompt)) + [1] * (len(answer) + 1)
    assert example.prompt == [tokenizer.bos_token_id] + prompt and example.reference == " 4"


def test_the_loss_covers_the_answer_tokens_only():
    """Against a numpy cross-entropy over the positions whose next token is an answer token."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((2, 6, 11)).astype(np.float32)
    ids = rng.integers(0, 11, (2, 6)).astype(np.int32)
    answer = np.array([[0, 0, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0]], np.int32)
    loss, sums = next_token_loss(logits, ids, answer_mask=answer)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    want = -sum(log_probs[row, t, ids[row, t + 1]] for row in range(2) for t in range(5) if answer[row, t + 1])
    assert float(sums["tokens"]) == answer[:, 1:].sum() == 5
    assert float(loss) == pytest.approx(want, rel=1e-5)


def test_rows_are_cut_from_the_left_padded_to_a_bucket_and_reported(tokenizer, caplog):
    examples = [chat.Example(list(range(3, 13)), [0] * 7 + [1] * 3, list(range(3, 10)), "a"),  # 10 tokens
                chat.Example(list(range(3, 33)), [0] * 27 + [1] * 3, list(range(3, 30)), "b"),  # 30: cut to 20
                # its answer lies in the 10 tokens cut off
                chat.Example(list(range(3, 33)), [0] * 5 + [1] * 2 + [0] * 23, list(range(3, 8)), "c")]
    with caplog.at_level(logging.WARNING):
        rows = chat.to_arrays(examples, tokenizer, 20, 4, "train")
    assert "2 of 3 rows are longer than --block_size 20" in caplog.text and "1 of them keep no answer" in caplog.text
    assert "1 generation prompts are longer than" in caplog.text
    assert rows.arrays["input_ids"].shape == (2, 20)  # of the buckets 16 and 20, the 20 tokens need 20
    np.testing.assert_array_equal(rows.arrays["input_ids"][1], np.arange(13, 33))  # its last 20 tokens
    np.testing.assert_array_equal(rows.arrays["answer_mask"][1], [0] * 17 + [1] * 3)
    np.testing.assert_array_equal(rows.arrays["attention_mask"][0], [1] * 10 + [0] * 10)
    assert (rows.arrays["input_ids"][0, 10:] == tokenizer.pad_token_id).all()
    # prompts: cut to their last 20 - 4 = 16 tokens, left-padded to bucket 16
    np.testing.assert_array_equal(rows.prompts["input_ids"][1], np.arange(14, 30))
    np.testing.assert_array_equal(rows.prompts["attention_mask"][0], [0] * 9 + [1] * 7)
    assert rows.references == ["a", "b"]


def test_short_rows_take_the_smallest_bucket(tokenizer):
    rows = chat.to_arrays([chat.Example([5, 6, 7], [0, 1, 1], [5], "x")], tokenizer, 64, 8, "train")
    assert rows.arrays["input_ids"].shape == (1, 16) and rows.prompts["input_ids"].shape == (1, 16)


def test_answers_end_at_the_first_end_id_and_match_with_whitespace_normalised(tokenizer):
    """Two end ids (an end-of-turn token, eos): each row is cut at whichever comes first."""
    ids = tokenizer(" owl dog cat", add_special_tokens=False)["input_ids"]
    end_of_turn, eos = 401, tokenizer.eos_token_id
    generated = np.array([ids + [eos, 7, 8, 9], ids + [end_of_turn, 7, eos, 9], ids + [7, eos, end_of_turn, 9],
                          ids + [9, 9, 9, 9]])
    texts = chat.answer_texts(tokenizer, generated, [end_of_turn, eos])
    tail = [tokenizer.decode([7]), tokenizer.decode([9] * 4)]
    assert texts == [" owl dog cat", " owl dog cat", " owl dog cat" + tail[0], " owl dog cat" + tail[1]]
    # stopping at eos alone, the second row runs on past its end of turn (a special token, dropped from the text)
    assert chat.answer_texts(tokenizer, generated[1:2], [eos]) == [" owl dog cat" + tail[0]]
    assert chat.exact_match(texts, ["owl  dog\ncat", "owl dog cat", "owl dog cat", "owl dog cat"]) == 0.5


@pytest.mark.parametrize("columns, kind", [
    ({"train": ["messages"], "validation": ["messages", "id"]}, "messages"),
    ({"train": ["prompt", "completion"]}, "prompt-completion"),
    ({"train": ["text"]}, None),
])
def test_the_rows_format_comes_from_the_columns(columns, kind):
    assert chat.row_format(columns) == kind


def test_row_flags_need_rows_and_streaming_needs_text():
    from types import SimpleNamespace

    from tasks.causal_lm import check_row_arguments

    text_args = SimpleNamespace(streaming=False, test_file=None, chat_template="t.jinja", predict_with_generate=False)
    with pytest.raises(UsageError, match="--chat_template applies to chat or instruction rows"):
        check_row_arguments(None, text_args)
    streamed = SimpleNamespace(streaming=True, test_file=None, chat_template=None, predict_with_generate=True)
    with pytest.raises(UsageError, match="--streaming reads text"):
        check_row_arguments(chat.MESSAGES, streamed)
    check_row_arguments(chat.MESSAGES, text_args)


def test_splits_of_different_formats_are_refused():
    with pytest.raises(UsageError, match=r"different kinds of rows \(train: messages, validation: text\)"):
        chat.row_format({"train": ["messages"], "validation": ["text"]})


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "hi"}], "row 3 of the train data: the conversation has no assistant turn"),
    ("hi", "row 3 of the train data: `messages` is not a list of turns"),
    ([{"role": "user"}, {"role": "assistant", "content": "x"}], "lacks a text `role` or `content`"),
    ([{"role": "tool", "content": "42"}, {"role": "assistant", "content": "x"}],
     r"row 3 of the train data: the chat template rejects it \(roles are system, user and assistant, not tool\)"),
    # An empty answer would train on the end-of-turn token alone
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
     "row 3 of the train data: assistant turn 2 of `messages` is empty"),
])
def test_bad_rows_are_named(tokenizer, messages, message):
    with pytest.raises(UsageError, match=message):
        chat.encode_conversation(tokenizer, messages, "row 3 of the train data")


def test_an_empty_completion_is_named(tokenizer):
    with pytest.raises(UsageError, match="row 2 of the validation data: `prompt` and `completion` must be text"):
        chat.encode_rows([{"prompt": "a", "completion": "x"}, {"prompt": "a", "completion": " "}], tokenizer,
                         "prompt-completion", "validation")


def test_a_row_of_another_kind_is_named(tokenizer):
    """A json lines file of `messages` rows with one `prompt` / `completion` row: datasets gives that row
    `messages` None."""
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "prompt": None,
             "completion": None}, {"messages": None, "prompt": "a", "completion": "b"}]
    with pytest.raises(UsageError, match="row 2 of the train data has `prompt` / `completion` where the other rows "
                                         "have `messages`"):
        chat.encode_rows(rows, tokenizer, chat.MESSAGES, "train")


CONVERSATION = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]


@pytest.mark.parametrize("template, message", [
    # Renders no answer: trained, it would learn the template's own text
    ("{{ bos_token }}hello", r"the chat template does not write the assistant turns' `content` \(tried on row 1 of "
                             r"the train data\)"),
    ("{% for m in messages %}<|{{ m.role }}|>{% endfor %}", "does not write the assistant turns' `content`"),
    # Python's errors inside the template, not jinja's
    ("{% for m in messages %}{{ m.content }}{% endfor %}{{ 1 / 0 }}",
     r"row 1 of the train data: the chat template rejects it \(ZeroDivisionError: division by zero\)"),
    ("{% for m in messages %}{{ m.content }", r"the tokenizer's chat template is not a valid Jinja template \(line 1: "),
])
def test_a_template_that_cannot_give_answers_is_named(tokenizer, template, message):
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    with pytest.raises(UsageError, match=message):
        chat.check_template(tokenizer, chat.MESSAGES)
        chat.encode_rows([{"messages": CONVERSATION}], tokenizer, chat.MESSAGES, "train")


@pytest.mark.parametrize("content, message", [
    (b"caf\xe9 {{ messages }}", r"--chat_template {path} is not UTF-8 text \(byte 0xe9 at offset 3\): save it as UTF-8"),
    (b" \n", "--chat_template {path} is empty"),
    (b"{% if %}", r"--chat_template {path} is not a valid Jinja template \(line 1: "),
    (None, "--chat_template {path}: No such file or directory"),
])
def test_a_bad_template_file_is_named(tmp_path, content, message):
    path = tmp_path / "chat.jinja"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError, match=message.format(path=re.escape(str(path)))):
        chat.read_template(str(path))


def test_messages_need_a_template(tokenizer):
    bare = AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "lm", "tokenizer"))
    with pytest.raises(UsageError, match="no chat template: pass one with --chat_template FILE"):
        chat.check_template(bare, chat.MESSAGES)
    chat.check_template(bare, "prompt-completion")
    chat.check_template(tokenizer, chat.MESSAGES)


def test_a_template_file_replaces_the_tokenizers(tokenizer, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(HF_MASKABLE_TEMPLATE)
    own = AutoTokenizer.from_pretrained(os.path.join(DATA, "tokenizer"))
    chat.use_template(own, str(path))
    assert own.chat_template == HF_MASKABLE_TEMPLATE
    with pytest.raises(UsageError, match="--chat_template .*missing.jinja"):
        chat.use_template(own, str(tmp_path / "missing.jinja"))


# ----------------------------------------------------------------------------------------------
# The demo's chat box (a model whose tokenizer has a chat template)
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory, tokenizer):
    """A tiny untrained Llama with data/chat's tokenizer, saved as a run exports it."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    from utils.models import compat

    compat.apply()
    out = tmp_path_factory.mktemp("chat_model")
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, architectures=["FlaxLlamaForCausalLM"])
    FlaxLlamaForCausalLM(config, seed=3).save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "run_args.json").write_text(json.dumps({"train_file": "data/chat/train.jsonl"}))
    return str(out)


def greedy_answer(output_dir, messages, new_tokens):
    """A plain greedy loop over the full forward pass of the rendered generation prompt, in a buffer
    of one length (one compiled forward; causal attention ignores what follows a position)."""
    import jax
    from transformers import FlaxAutoModelForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    model = FlaxAutoModelForCausalLM.from_pretrained(output_dir)
    forward = jax.jit(lambda ids: model(ids, params=model.params).logits)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    start = len(ids)
    buffer = np.zeros((1, start + new_tokens), np.int32)
    buffer[0, :start] = ids
    for position in range(start, start + new_tokens):
        token = int(np.asarray(forward(buffer))[0, position - 1].argmax())
        if token == tokenizer.eos_token_id:
            break
        buffer[0, position] = token
        ids.append(token)
    return tokenizer.decode(ids[start:], skip_special_tokens=True).strip()


@pytest.mark.slow
def test_the_chat_box_answers_as_a_plain_greedy_loop_and_keeps_the_conversation(chat_model_dir):
    """Streamlit's browserless AppTest: two messages, each answered as a plain greedy loop over the
    rendered conversation answers, the first exchange kept above the second."""
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    def app(output_dir):
        import demo

        demo.page(output_dir)

    page = AppTest.from_function(app, args=(chat_model_dir,), default_timeout=300)
    page.run()
    for message in ("What is 1 plus 2?", "Reverse: cat dog owl"):
        page.chat_input(key="message").set_value(message).run()
    assert not page.exception
    conversation = page.session_state["conversation"]
    assert [turn["role"] for turn in conversation] == ["user", "assistant", "user", "assistant"]
    assert [turn["content"] for turn in conversation[::2]] == ["What is 1 plus 2?", "Reverse: cat dog owl"]
    new_tokens = 32  # the chat box's answers
    assert conversation[1]["content"] == greedy_answer(chat_model_dir, conversation[:1], new_tokens)
    assert conversation[3]["content"] == greedy_answer(chat_model_dir, conversation[:3], new_tokens)
    assert conversation[1]["content"] and conversation[3]["content"]
    shown = [(message.name, message.markdown[0].value) for message in page.chat_message]
    assert [role for role, _ in shown] == ["user", "assistant", "user", "assistant"]


# ----------------------------------------------------------------------------------------------
# Where answers end: the chat template's end of turn and every eos id
# ----------------------------------------------------------------------------------------------
# Templates in the style of real chat models (their turn structure, their end-of-turn tokens), and one whose
# turns end in plain text.
TEMPLATES = {
    "llama3": ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
               "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
               "<|eot_id|>"),
    "gemma": ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = "
              "'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + "
              "message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
              "{{ '<start_of_turn>model\n' }}{% endif %}", "<end_of_turn>"),
    "chatml": ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}", "<|im_end|>"),
    "phi3": ("{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}",
             "<|end|>"),
    "mistral": ("{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
                "message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + eos_token }}{% endif %}"
                "{% endfor %}", "</s>"),
    "plain text": ("{% for message in messages %}{% if message['role'] == 'user' %}{{ '### Instruction:\n' + "
                   "message['content'] + '\n\n' }}{% else %}{{ '### Response:\n' + message['content'] + '\n\n' }}"
                   "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '### Response:\n' }}{% endif %}", None),
}
TURN_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>",
               "<|im_start|>", "<|im_end|>", "<|end|>"]


@pytest.fixture(scope="module")
def turn_tokenizer():
    """data/chat's tokenizer with the turn tokens of those models, added as Llama 3's are: special tokens of
    the vocabulary, none of them the tokenizer's eos."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(DATA, "tokenizer"))
    tokenizer.add_tokens(TURN_TOKENS, special_tokens=True)
    return tokenizer


@pytest.mark.parametrize("style", TEMPLATES)
def test_generation_stops_at_the_templates_end_of_turn_and_every_eos(turn_tokenizer, style, caplog):
    from transformers import GenerationConfig, LlamaConfig

    turn_tokenizer.chat_template, end_token = TEMPLATES[style]
    eos = turn_tokenizer.eos_token_id
    # the model config's eos another id than the tokenizer's; the generation config lists several (Gemma's does)
    config, generation_config = LlamaConfig(eos_token_id=5), GenerationConfig(eos_token_id=[eos, 6])
    with caplog.at_level(logging.INFO, logger="tasks.chat"):
        ids = chat.end_ids(turn_tokenizer, config, generation_config)
    end_of_turn = [turn_tokenizer.convert_tokens_to_ids(end_token)] if end_token else []
    assert ids == end_of_turn + [i for i in (eos, 6, 5) if i not in end_of_turn]
    logged = caplog.records[-1].getMessage()  # each id, its token, then where it comes from
    assert logged.startswith("generation stops at ")
    assert [part.split(" (")[0] for part in logged[len("generation stops at "):].split("; ")] == [
        f"{i} {turn_tokenizer.convert_ids_to_tokens(i)!r}" for i in ids]
    if end_token is None:
        assert "the chat template ends an assistant turn with no special token (it renders '\\n\\n' after the " \
               "answer)" in caplog.text


def test_end_ids_without_a_template_are_the_configs_and_the_tokenizers(tokenizer):
    from transformers import GenerationConfig, GPT2Config

    bare = AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "lm", "tokenizer"))
    assert chat.end_ids(bare, GPT2Config(eos_token_id=[7, 8]), GenerationConfig(eos_token_id=9)) == [
        9, 7, 8, bare.eos_token_id]
    assert chat.end_ids(bare, GPT2Config(eos_token_id=None), GenerationConfig()) == [bare.eos_token_id]


# ----------------------------------------------------------------------------------------------
# Generating: every end id stops a row; sampling
# ----------------------------------------------------------------------------------------------
def warped_probabilities(logits, temperature, top_k, top_p):
    """numpy: softmax(logits / temperature) kept to the top_k likeliest (0: all), then to the likeliest whose
    probabilities, the one crossing top_p included, reach top_p; renormalised."""
    probs = np.exp(logits / temperature - (logits / temperature).max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    if top_k:
        probs[order[top_k:]] = 0
        probs /= probs.sum()
    before = np.cumsum(probs[order]) - probs[order]  # the probability of the likelier tokens
    probs[order[before >= top_p]] = 0
    return probs / probs.sum()


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.5, 4, 1.0), (1.5, 0, 0.7), (1.0, 5, 0.8)])
def test_sampled_tokens_follow_the_warped_distribution(temperature, top_k, top_p):
    """20,000 rows, each its own key, draw from one row of logits: the tokens' frequencies are the numpy
    probabilities (within 0.015, about 4 standard deviations), and a token cut off is never drawn."""
    from tasks.causal_lm import Decoding, NextToken, sample_keys

    logits = np.random.default_rng(0).normal(0, 1.5, 12).astype(np.float32)
    rows = 20_000
    choose = NextToken(Decoding((), True, temperature, top_k, top_p), sample_keys(3, rows), prompt_width=5)
    drawn = np.asarray(choose(None, np.tile(logits, (rows, 1)), 7).argmax(-1))
    frequencies = np.bincount(drawn, minlength=12) / rows
    want = warped_probabilities(logits.astype(np.float64), temperature, top_k, top_p)
    np.testing.assert_allclose(frequencies, want, atol=0.015)
    assert (frequencies[want == 0] == 0).all()


@pytest.fixture(scope="module")
def tiny_llama(tokenizer):
    """(an untrained one-layer Llama, its parameters: made in one program)."""
    import jax
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    from utils.models import compat

    compat.apply()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = FlaxLlamaForCausalLM(config, _do_init=False)
    return model, jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(5), (1, 1))


def left_padded(tokenizer, texts, width=16):
    batch = {"input_ids": np.full((len(texts), width), tokenizer.pad_token_id, np.int32),
             "attention_mask": np.zeros((len(texts), width), np.int32)}
    for row, text in enumerate(texts):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        batch["input_ids"][row, width - len(ids):] = ids
        batch["attention_mask"][row, width - len(ids):] = 1
    return batch


def test_every_end_id_stops_a_row_where_greedy_decoding_draws_it(tokenizer, tiny_llama):
    """Greedy answers with one end id, then with a second: the token a row draws at a random step: each row is
    the first answer up to where it drew either, then the first end id (what Flax's loop pads a row with)."""
    import jax

    from tasks.causal_lm import Decoding, generate_answers

    batch = left_padded(tokenizer, ["<|user|> What is 1 plus 2?<|assistant|>", "<|user|> Reverse: cat dog owl",
                                    "<|user|> Where does the", "Sam has a"])
    eos = tokenizer.eos_token_id

    model, params = tiny_llama

    def answers(end_ids):
        step = jax.jit(lambda params, batch: generate_answers(model, params, batch, 10, Decoding(end_ids)))
        return np.asarray(step(params, batch))

    once = answers((eos,))
    second = int(once[1, 4])
    assert second != eos
    both = answers((eos, second))
    for row, first in zip(both, once):
        stop = next((n for n, token in enumerate(first) if token in (eos, second)), len(first))
        np.testing.assert_array_equal(row, list(first[:stop]) + [eos] * (len(first) - stop))
    assert (both[1, 4:] == eos).all()


def test_sampled_answers_are_the_seeds_own_row_by_row_in_any_layout(tokenizer, tiny_llama):
    """Sixteen rows of one prompt: all sixteen answers differ (no two rows share draws), the same seed gives them
    again and another seed others; under --sharding dp (2 rows on each of 8 devices, each device running the
    same program) every row draws what it draws in one program over the whole batch."""
    import jax

    from tasks.causal_lm import Decoding, generate_answers, generation_inputs
    from utils.layout.layouts import DataParallel

    model, params = tiny_llama
    decoding = Decoding((tokenizer.eos_token_id,), True, 1.5)
    prompts = left_padded(tokenizer, ["<|user|> What is 1 plus 2?<|assistant|>"] * 16)

    def step(params, batch):
        return generate_answers(model, params, batch, 8, decoding)

    whole = jax.jit(step)
    answers = {seed: np.asarray(whole(params, generation_inputs(prompts, decoding, seed))) for seed in (0, 1)}
    assert len({tuple(row) for row in answers[0]}) == 16
    np.testing.assert_array_equal(whole(params, generation_inputs(prompts, decoding, 0)), answers[0])
    assert (answers[0] != answers[1]).any(axis=1).all()
    layout = DataParallel()
    per_device = layout.compile_step("generate_step", step)
    placed = layout.place_batch(generation_inputs(prompts, decoding, 0))
    on_devices = layout.rows_to_host(per_device(layout.replicated(params), placed))
    np.testing.assert_array_equal(on_devices, answers[0])
