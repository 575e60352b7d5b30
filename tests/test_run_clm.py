"""End to end: run_clm_flax.py on a tiny GPT-2 (text in blocks) and a tiny Llama (chat rows) over 8 virtual
devices, as a user would run it."""

import json
import os

import jax
import numpy as np
import pytest

import run_clm_flax as clm
from tasks.causal_lm import next_token_loss
from tests.script_runner import (ROOT, calls_of_steps_compiled_once, read_json, read_metrics, run_script,
                                 run_streamed_config, script_env)
from test_chat import END_OF_TURN, save_end_of_turn_tokenizer
from utils.base.errors import UsageError

SCRIPT = "run_clm_flax.py"
MAX_STEPS = 60
# Calibrated: this run ends near 22; the untrained model scores ~870 (about the vocabulary's size).
PERPLEXITY_THRESHOLD = 35
MODEL = ["--model_type", "gpt2", "--tokenizer_name", "data/lm/tokenizer",
         "--config_overrides", "n_embd=64,n_layer=2,n_head=4,n_positions=64"]
DATA = ["--train_file", "data/lm/train.txt", "--validation_file", "data/lm/validation.txt", "--block_size", "32",
        "--max_train_samples", "1280", "--max_eval_samples", "40"]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir):
    out = str(tmp_path_factory.mktemp("clm"))
    result = run_script(SCRIPT, MODEL + DATA + [
        "--output_dir", out, "--overwrite_output_dir", "--do_train", "--do_eval", "--max_steps", MAX_STEPS,
        "--num_train_epochs", "100", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "2",
        "--learning_rate", "5e-3", "--warmup_steps", "5", "--logging_steps", "5", "--eval_steps", "30",
        "--save_steps", "30", "--compilation_cache_dir", cache_dir], steps_report=out + "_steps.json")
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out + "_output.txt", "w", encoding="utf-8", newline="") as f:  # newline="": "\r" kept as written
        f.write(result.stdout + result.stderr)
    return out


@pytest.mark.slow
def test_each_step_compiles_once(trained):
    """Train steps 2..N and every eval batch (the last one padded) reuse the first call's program."""
    calls = calls_of_steps_compiled_once(trained + "_steps.json")
    assert calls["train_step"] == MAX_STEPS and calls["eval_step"] > 2


@pytest.mark.slow
def test_loss_falls_and_max_steps_is_honoured(trained):
    train = read_metrics(trained)
    assert [row["step"] for row in train] == list(range(5, MAX_STEPS + 1, 5))
    assert train[-1]["loss"] < 0.6 * train[0]["loss"]
    assert [row["step"] for row in read_metrics(trained, "eval")] == [30, 60]


@pytest.mark.slow
def test_progress_into_a_pipe_is_plain_lines(trained):
    """Output captured through pipes, as in a file or a CI log: no bar redraws (ours or datasets'
    "grouping into blocks"), one progress line per logged step instead."""
    with open(trained + "_output.txt", encoding="utf-8", newline="") as f:
        output = f.read()
    assert "\r" not in output and "%|" not in output
    progress = [line.split(" INFO ", 1)[1] for line in output.splitlines() if " INFO step " in line]
    assert [line.split(":")[0] for line in progress] == [f"step {step}/{MAX_STEPS}" for step in range(5, MAX_STEPS + 1, 5)]
    assert all(" loss " in line and " lr " in line for line in progress)
    assert all(" tok/s " in line and " eta " in line for line in progress[1:])  # from the second log on


@pytest.mark.slow
def test_result_files(trained):
    results = read_json(os.path.join(trained, "eval_results.json"))
    assert set(results) == {"eval_loss", "eval_perplexity", "eval_tokens", "eval_samples"}
    assert results["eval_perplexity"] < PERPLEXITY_THRESHOLD
    assert results["eval_tokens"] == 40 * (32 - 1)  # every block token but the first is predicted
    everything = read_json(os.path.join(trained, "all_results.json"))
    assert everything["eval_perplexity"] == results["eval_perplexity"] and everything["train_runtime"] > 0
    assert everything["train_samples"] == 1280 and results["eval_samples"] == 40
    assert read_json(os.path.join(trained, "run_args.json"))["block_size"] == 32
    for name in ("config.json", "flax_model.msgpack", "tokenizer.json", "metrics.jsonl"):
        assert os.path.isfile(os.path.join(trained, name)), name
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(trained))
    assert sorted(os.listdir(os.path.join(trained, "checkpoints"))) == ["30", "60"]


@pytest.mark.slow
def test_eval_only_from_the_saved_model(trained, tmp_path, cache_dir):
    result = run_script(SCRIPT, ["--model_name_or_path", trained, "--do_eval", "--output_dir", tmp_path,
                                 "--validation_file", "data/lm/validation.txt", "--block_size", "32",
                                 "--max_eval_samples", "40", "--per_device_eval_batch_size", "2",
                                 "--compilation_cache_dir", cache_dir])
    assert result.returncode == 0, result.stderr[-3000:]
    again = read_json(os.path.join(tmp_path, "eval_results.json"))
    # Result files round to 4 decimals (each within 5e-5: 1e-4 apart), plus float32 sums of the same
    # 1240 token losses in other batches (~sqrt(1240) x eps32 x loss 3 = 1.3e-5): 2e-4.
    assert again["eval_loss"] == pytest.approx(read_json(os.path.join(trained, "eval_results.json"))["eval_loss"],
                                               abs=2e-4)
    assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))  # evaluation makes no checkpoint folder


@pytest.mark.slow
def test_usage_errors_are_one_line(tmp_path):
    result = run_script(SCRIPT, MODEL + DATA + ["--output_dir", tmp_path, "--do_eval", "--do_predict"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --do_predict does not apply to language modeling (there is no test split): use --do_eval")
    result = run_script(SCRIPT, MODEL + DATA + ["--output_dir", tmp_path, "--do_eval", "--predict_with_generate"])
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: --predict_with_generate applies to chat or instruction rows (`messages`, or `prompt` and "
        "`completion`), but the data is text: drop --predict_with_generate")


@pytest.mark.parametrize("flags, message", [
    ({"do_sample": True}, "--do_sample samples the answers of --predict_with_generate: add --predict_with_generate "
                          "or drop --do_sample"),
    ({"predict_with_generate": True, "temperature": 0.7},
     "--temperature applies to sampled answers: add --do_sample (and --predict_with_generate) or drop --temperature"),
    ({"predict_with_generate": True, "generation_seed": 3}, "--generation_seed applies to sampled answers"),
    ({"predict_with_generate": True, "do_sample": True, "temperature": 0.0},
     "--temperature must be above 0, got 0.0: for the likeliest tokens drop --do_sample"),
    ({"predict_with_generate": True, "do_sample": True, "top_k": -1},
     "--top_k must be 0 (every token) or more, got -1"),
    ({"predict_with_generate": True, "do_sample": True, "top_p": 0.0},
     "--top_p must be above 0 and at most 1, got 0.0"),
    ({"predict_with_generate": True, "do_sample": True, "top_p": 1.5},
     "--top_p must be above 0 and at most 1, got 1.5"),
])
def test_sampling_flags_are_checked(flags, message):
    with pytest.raises(UsageError) as raised:
        clm.DataTrainingArguments(train_file="data/chat/train.jsonl", **flags)
    assert str(raised.value).startswith(message)


def test_sampling_flags_in_range_are_taken():
    args = clm.DataTrainingArguments(train_file="data/chat/train.jsonl", predict_with_generate=True, do_sample=True,
                                     temperature=0.7, top_k=0, top_p=1.0, generation_seed=0)
    assert (args.temperature, args.top_k, args.top_p, args.generation_seed) == (0.7, 0, 1.0, 0)


@pytest.mark.slow
def test_trains_from_gzipped_json_lines(tmp_path):
    """A `.jsonl.gz` training file: checked, loaded and trained on (in this process, a tiny model, 2 steps)."""
    import gzip
    import json

    from utils.base.errors import run_main

    with open("data/lm/train.txt", encoding="utf-8") as f:
        lines = [line.strip() for line, _ in zip(f, range(400))]
    train = tmp_path / "train.jsonl.gz"
    with gzip.open(train, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    out = tmp_path / "out"
    argv = ["--model_type", "gpt2", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
            "n_embd=16,n_layer=1,n_head=2,n_positions=32", "--block_size", "32", "--train_file", str(train),
            "--do_train", "--max_steps", "2", "--per_device_train_batch_size", "1", "--logging_steps", "1",
            "--output_dir", str(out), "--compilation_cache_dir", "none", "--cache_dir", str(tmp_path / "cache")]
    assert run_main(lambda: clm.main(argv), argv) == 0
    assert [row["step"] for row in read_metrics(out)] == [1, 2]
    # The blocks of the 380 lines left for training once 5% are held out for validation.
    assert read_json(os.path.join(out, "all_results.json"))["train_samples"] == 202


@pytest.mark.slow
def test_fast_dp_steps_run_far_ahead_of_the_logging_without_losing_an_all_reduce(tmp_path, cache_dir):
    """Hundreds of tiny steps, their metrics fetched every 100: the host would queue more steps than
    XLA's CPU client can run with its collectives (`utils.layout.layouts.CPU_STEPS_IN_FLIGHT`), which aborted
    the run after 40 s near step 80."""
    result = run_script(SCRIPT, [
        "--model_type", "gpt2", "--tokenizer_name", "data/lm/tokenizer", "--config_overrides",
        "n_embd=32,n_layer=1,n_head=2,n_positions=16", "--train_file", "data/lm/train.txt", "--block_size", "16",
        "--do_train", "--max_steps", 400, "--num_train_epochs", 100, "--total_train_batch_size", 32,
        "--logging_steps", 100, "--output_dir", tmp_path, "--compilation_cache_dir", cache_dir], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    train = read_metrics(str(tmp_path))
    assert [row["step"] for row in train] == [100, 200, 300, 400]
    assert all(np.isfinite(row["loss"]) for row in train)


def peaked_logits(token_ids, vocab, peak=30.0):
    """Logits putting all but ~exp(-peak) of the probability on `token_ids`."""
    return peak * np.eye(vocab, dtype=np.float32)[token_ids]


def test_next_token_loss_scores_the_following_token():
    vocab = 11
    input_ids = (5 * np.arange(3)[:, None] + np.arange(6)) % vocab  # no token equals its neighbour
    example_weight = np.array([1.0, 1.0, 0.0])  # the last row is eval padding
    # Position t names token t + 1 (the last position, predicting nothing, names the first token);
    # the padding row names its current tokens, which would cost if it counted.
    predicts_next = peaked_logits(np.roll(input_ids, -1, axis=1), vocab)
    predicts_next[2] = peaked_logits(input_ids[2], vocab)
    loss, sums = next_token_loss(predicts_next, input_ids, example_weight)
    assert float(sums["tokens"]) == 2 * (6 - 1)  # real rows x (block - 1)
    assert float(loss) == float(sums["loss"])
    assert float(loss) / float(sums["tokens"]) < 1e-6

    loss, sums = next_token_loss(peaked_logits(input_ids, vocab), input_ids, example_weight)
    assert float(loss) / float(sums["tokens"]) > 20  # copying the current token is wrong everywhere
    assert float(next_token_loss(predicts_next, input_ids)[1]["tokens"]) == 3 * (6 - 1)


# One line repeated: each of its 11 tokens ("<s> Sam Ġhas ... Ġpond Ċ </s>") is always followed by
# the same other token, so a model that learned next-token prediction continues a prefix with the
# rest of the line, while one taught to copy its input repeats the prefix's last token.
CYCLE_LINE = "Sam has an orange lamp by the pond\n"


@pytest.mark.slow
def test_greedy_continuation_follows_the_learned_sequence(tmp_path, cache_dir):
    from transformers import AutoTokenizer, FlaxAutoModelForCausalLM

    tokenizer_dir = os.path.join(ROOT, "data", "lm", "tokenizer")
    line = AutoTokenizer.from_pretrained(tokenizer_dir)(CYCLE_LINE)["input_ids"]
    assert len(set(line)) == len(line)  # every token names its successor, which is never itself
    corpus = tmp_path / "cycle.txt"
    corpus.write_text(CYCLE_LINE * 200, encoding="utf-8")
    out = tmp_path / "out"
    result = run_script(SCRIPT, [
        "--model_type", "gpt2", "--tokenizer_name", tokenizer_dir,
        "--config_overrides", "n_embd=32,n_layer=1,n_head=2,n_positions=16", "--block_size", "16",
        "--train_file", corpus, "--output_dir", out, "--do_train", "--max_steps", "100",
        "--per_device_train_batch_size", "2", "--learning_rate", "1e-2", "--logging_steps", "50",
        "--save_steps", "100", "--compilation_cache_dir", cache_dir])
    assert result.returncode == 0, result.stderr[-3000:]

    # Greedy decoding, one argmax per step, in a buffer of fixed length so the forward compiles once:
    # a causal model's position t sees only tokens up to t, not what follows in the buffer.
    model, params = FlaxAutoModelForCausalLM.from_pretrained(out, _do_init=False)
    forward = jax.jit(lambda ids: model(ids, params=params).logits)
    tokens = np.zeros((1, len(line)), np.int32)
    tokens[0, :2] = line[:2]  # <s> Sam
    for position in range(2, len(line)):
        tokens[0, position] = np.asarray(forward(tokens))[0, position - 1].argmax()
    assert tokens[0].tolist() == line


@pytest.mark.slow
def test_the_embedded_config_streams_and_learns(tmp_path):
    """configs/clm_tiny.json with --streaming: read, tokenized and shuffled on the fly, evaluated on
    its validation file; a pass over the corpus is 53 steps, so the stream starts again for the last 7."""
    results, log = run_streamed_config(SCRIPT, "configs/clm_tiny.json", tmp_path / "out", 60, 10)
    assert "pass 2 of the training stream starts at step 54" in log and "ran out" not in log
    # A stream has no size: the examples trained on are the steps' (16 a step, the config's total batch).
    assert results["eval_samples"] > 0 and results["train_samples"] == 60 * 16


# ----------------------------------------------------------------------------------------------
# Chat rows (configs/chat_tiny.json: a tiny Llama on data/chat)
# ----------------------------------------------------------------------------------------------
CHAT_CONFIG = "configs/chat_tiny.json"
# Two of the config's three epochs; the held-out exact match was 0.405 there (8 devices, turns ending with <|end|>),
# an untrained model's 0.
CHAT_STEPS = 250
CHAT_EXACT_MATCH_THRESHOLD = 0.25


@pytest.fixture(scope="module")
def chat_trained(tmp_path_factory, cache_dir):
    """The config's run with a template that ends each assistant turn with <|end|>, not the tokenizer's eos </s>
    (as Llama 3, Gemma, Phi-3 and ChatML templates do)."""
    out = str(tmp_path_factory.mktemp("chat"))
    tokenizer = save_end_of_turn_tokenizer(tmp_path_factory.mktemp("end_of_turn_tokenizer"))
    # Optimized code: its 250 steps cost more than compiling them (52 s -> 30 s alone).
    result = run_script(SCRIPT, [CHAT_CONFIG, "--tokenizer_name", tokenizer, "--output_dir", out, "--max_steps",
                                 CHAT_STEPS, "--eval_steps", CHAT_STEPS, "--save_steps", CHAT_STEPS,
                                 "--compilation_cache_dir", cache_dir], env=script_env(optimized_code=True))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(out + "_output.txt", "w", encoding="utf-8") as f:
        f.write(result.stdout + result.stderr)
    return out


@pytest.mark.slow
def test_chat_fine_tuning_learns_the_held_out_answers(chat_trained, tmp_path, cache_dir):
    results = read_json(os.path.join(chat_trained, "eval_results.json"))
    assert results["eval_exact_match"] > CHAT_EXACT_MATCH_THRESHOLD
    assert results["eval_samples"] == 200 and results["eval_tokens"] == 804  # answers and their end tokens only
    with open(os.path.join(chat_trained, "generated_predictions.txt"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) == 200
    untrained = run_script(SCRIPT, [CHAT_CONFIG, "--do_train", "false", "--output_dir", tmp_path,
                                    "--compilation_cache_dir", cache_dir])
    assert untrained.returncode == 0, untrained.stderr[-3000:]
    assert read_json(os.path.join(tmp_path, "eval_results.json"))["eval_exact_match"] <= 0.02


@pytest.mark.slow
def test_chat_eval_only_and_predict_only_from_the_saved_model(chat_trained, tmp_path, cache_dir):
    """The export carries the chat template; evaluated again it answers as at the end of training, and
    it answers the test rows."""
    saved = ["--model_name_or_path", chat_trained, "--block_size", 64, "--max_new_tokens", 8,
             "--per_device_eval_batch_size", 25, "--compilation_cache_dir", cache_dir]
    result = run_script(SCRIPT, saved + ["--validation_file", "data/chat/validation.jsonl", "--do_eval",
                                         "--predict_with_generate", "--output_dir", tmp_path / "eval"])
    assert result.returncode == 0, result.stderr[-3000:]
    again, trained = (read_json(os.path.join(out, "eval_results.json")) for out in (tmp_path / "eval", chat_trained))
    assert again["eval_exact_match"] == trained["eval_exact_match"]
    assert again["eval_loss"] == pytest.approx(trained["eval_loss"], abs=2e-4)
    assert (tmp_path / "eval" / "generated_predictions.txt").read_text() == (
        open(os.path.join(chat_trained, "generated_predictions.txt"), encoding="utf-8").read())
    result = run_script(SCRIPT, saved + ["--test_file", "data/chat/test.jsonl", "--do_predict",
                                         "--predict_with_generate", "--output_dir", tmp_path / "predict"])
    assert result.returncode == 0, result.stderr[-3000:]
    test = read_json(tmp_path / "predict" / "test_results.json")
    assert test["test_exact_match"] > CHAT_EXACT_MATCH_THRESHOLD and test["test_samples"] == 200
    assert len((tmp_path / "predict" / "generated_predictions.txt").read_text().splitlines()) == 200


def plain_greedy_ids(output_dir, prompts, new_tokens):
    """[rows, new_tokens]: a plain greedy loop, never stopping, over the full forward pass of each prompt, the
    rows right-padded in one buffer (one compiled forward; causal attention ignores what follows a position)."""
    from transformers import FlaxAutoModelForCausalLM

    from utils.models import compat

    compat.apply()  # as the scripts and the demo load a model (Llama's head_dim)
    model = FlaxAutoModelForCausalLM.from_pretrained(output_dir)
    forward = jax.jit(lambda ids: model(ids, params=model.params).logits)
    lengths = np.array([len(ids) for ids in prompts])
    buffer = np.zeros((len(prompts), lengths.max() + new_tokens), np.int32)
    for row, ids in enumerate(prompts):
        buffer[row, :len(ids)] = ids
    rows = np.arange(len(prompts))
    for step in range(new_tokens):
        buffer[rows, lengths + step] = np.asarray(forward(buffer))[rows, lengths + step - 1].argmax(-1)
    return buffer[rows[:, None], lengths[:, None] + np.arange(new_tokens)]


@pytest.mark.slow
def test_chat_answers_end_at_the_end_of_turn_and_the_demo_answers_alike(chat_trained):
    """The model learnt to end its answers with <|end|>: the exported generation config lists it beside </s>, the
    exact match is the share of right answers of the raw greedy ids cut at the first of them (while cut at </s>
    alone, as before, few answers are right), the predictions are those answers, and the demo gives them too."""
    from transformers import AutoTokenizer

    from tasks.causal_lm import TextGenerator

    tokenizer = AutoTokenizer.from_pretrained(chat_trained)
    end_of_turn, eos = tokenizer.convert_tokens_to_ids(END_OF_TURN), tokenizer.eos_token_id
    assert read_json(os.path.join(chat_trained, "generation_config.json"))["eos_token_id"] == [end_of_turn, eos]
    with open(os.path.join(ROOT, "data", "chat", "validation.jsonl"), encoding="utf-8") as f:
        conversations = [json.loads(line)["messages"] for line in f]
    asked = [messages[:max(i for i, turn in enumerate(messages) if turn["role"] == "assistant")]
             for messages in conversations]
    references = [messages[len(before)]["content"] for messages, before in zip(conversations, asked)]
    prompts = [tokenizer(tokenizer.apply_chat_template(before, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)["input_ids"][-(64 - 8):] for before in asked]  # block - new tokens
    raw = plain_greedy_ids(chat_trained, prompts, 8)

    def answers(end_ids):
        cut = [[int(token) for token in row[:next((n for n, t in enumerate(row) if t in end_ids), len(row))]]
               for row in raw]
        return [" ".join(tokenizer.decode(ids, skip_special_tokens=True).split()) for ids in cut]

    def share_right(texts):
        return np.mean([text == " ".join(reference.split()) for text, reference in zip(texts, references)])

    exact_match = read_json(os.path.join(chat_trained, "eval_results.json"))["eval_exact_match"]
    assert exact_match == pytest.approx(share_right(answers({end_of_turn, eos})), abs=1e-9)
    assert share_right(answers({eos})) < exact_match / 2  # stopping at eos only, answers run on
    with open(os.path.join(chat_trained, "generated_predictions.txt"), encoding="utf-8") as f:
        predicted = f.read().splitlines()
    assert predicted == answers({end_of_turn, eos})
    demo = TextGenerator(chat_trained, read_json(os.path.join(chat_trained, "run_args.json")))
    fitting = [row for row, ids in enumerate(prompts) if len(ids) <= demo.prompt_buckets[-1]][:12]
    assert [" ".join(demo.reply(asked[row], 8).text.split()) for row in fitting] == [predicted[row] for row in fitting]
    with open(chat_trained + "_output.txt", encoding="utf-8") as f:
        assert f"generation stops at {end_of_turn} '{END_OF_TURN}' (the chat template's end of turn); {eos} '</s>'" \
            in f.read()


@pytest.mark.slow
def test_a_bad_chat_row_stops_the_run_before_any_work(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "hi"}]}]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    out = tmp_path / "out"
    result = run_script(SCRIPT, [CHAT_CONFIG, "--train_file", train, "--do_eval", "false", "--output_dir", out])
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: data file {train}: row 2 of the train data: the conversation has no assistant turn, so nothing to "
        "learn: add one or drop the row")
    assert not out.exists()
