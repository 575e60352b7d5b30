"""tasks/lm.py (and tasks/masked_lm.py's masking): grouping, masking, token-weighted loss, validation split,
file formats, limits."""

import json
import os
from functools import partial
from types import SimpleNamespace

import datasets
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from transformers import AutoConfig, AutoTokenizer

from tasks import lm, masked_lm
from utils.base.arguments import ModelArguments, TrainingArguments
from utils.base.errors import UsageError
from utils.layout.layouts import AXIS
from utils.run.preflight import check_before_work
from utils.scoring.losses import cross_entropy_sums

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "lm", "tokenizer")
SPECIAL, PAD, MASK, VOCAB = [0, 1, 2, 3, 4], 1, 4, 100


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def data_args(**kwargs):
    return lm.LMDataArguments(**kwargs)


def training_args(tmp_path, **kwargs):
    return TrainingArguments(output_dir=str(tmp_path / "out"), **kwargs)


# ----------------------------------------------------------------------------------------------
# Grouping
# ----------------------------------------------------------------------------------------------
def test_group_texts_exact_blocks_remainder_dropped():
    examples = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]],
                "attention_mask": [[1] * 3, [1] * 2, [1] * 4, [1]]}
    grouped = lm.group_texts(examples, block_size=4)
    assert grouped["input_ids"] == [[1, 2, 3, 4], [5, 6, 7, 8]]  # 9 and 10 dropped
    assert grouped["attention_mask"] == [[1] * 4] * 2


def test_group_texts_fewer_tokens_than_a_block():
    assert lm.group_texts({"input_ids": [[1, 2], [3]]}, block_size=4) == {"input_ids": []}


def test_tokenize_and_group_nothing_ragged(tokenizer):
    texts = [f"The cat number {i} sat on the mat." for i in range(50)] + ["", "   "]
    blocks = lm.tokenize_and_group(datasets.Dataset.from_dict({"text": texts}), tokenizer, "text", 16, data_args())
    assert set(map(len, blocks["input_ids"])) == {16}
    stream = [i for ids in tokenizer(texts[:50])["input_ids"] for i in ids]  # blank lines contribute nothing
    assert len(blocks) == len(stream) // 16
    assert np.array_equal(np.concatenate(blocks["input_ids"]), stream[: len(blocks) * 16])


def test_tokenize_lines_padded_to_fixed_length(tokenizer):
    texts = ["short", "a much longer line " * 20, "\n"]
    lines = lm.tokenize_lines(datasets.Dataset.from_dict({"text": texts}), tokenizer, "text", 24, data_args())
    assert len(lines) == 2  # the blank line is gone
    assert all(len(ids) == 24 for ids in lines["input_ids"])
    assert lines["input_ids"][0][-1] == tokenizer.pad_token_id and lines["attention_mask"][0][-1] == 0
    assert sum(lines["attention_mask"][1]) == 24  # truncated, no padding


# ----------------------------------------------------------------------------------------------
# Masking
# ----------------------------------------------------------------------------------------------
def random_batch(rng, rows=256, length=128):
    ids = rng.integers(len(SPECIAL), VOCAB, size=(rows, length))
    ids[:, 0], ids[:, -1] = 0, 2  # <s> ... </s>
    ids[: rows // 2, length // 2:] = PAD  # half the rows padded
    return ids


def test_mask_statistics():
    rng = np.random.default_rng(0)
    ids = random_batch(rng)
    replacements = np.arange(len(SPECIAL), VOCAB)
    inputs, selected = masked_lm.mask_tokens(ids, np.array(SPECIAL), MASK, replacements, 0.15,
                                             rng.random((3, *ids.shape)))
    selected = selected.astype(bool)
    special = np.isin(ids, SPECIAL)
    assert not selected[special].any()
    # Sampling, not float error: ~10^4 candidate tokens give a standard error of 0.0036 on 0.15, and
    # of ~0.01 (0.8) and ~0.008 (0.1) on the shares of the ~1,500 selected: each bound is 2-3 of those.
    assert abs(selected.sum() / (~special).sum() - 0.15) < 0.01
    masked = selected & (inputs == MASK)
    unchanged = selected & (inputs == ids)
    randomized = selected & ~masked & ~unchanged
    n = selected.sum()
    # A random token equals the original 1 time in 96: that part of the 10% counts as unchanged.
    assert abs(masked.sum() / n - 0.8) < 0.02
    assert abs(randomized.sum() / n - 0.1 * 95 / 96) < 0.015
    assert abs(unchanged.sum() / n - 0.1 * 97 / 96) < 0.015
    assert np.array_equal(inputs[~selected], ids[~selected])
    assert not np.isin(inputs[randomized], SPECIAL).any()


def test_masking_transform_is_a_pure_function_of_seed_step_and_row(tokenizer):
    ids = np.asarray(tokenizer(["the cat sat on the mat"] * 64, padding="max_length", max_length=16)["input_ids"])
    batch = {"input_ids": ids, "attention_mask": (ids != tokenizer.pad_token_id).astype(np.int64)}
    transform = masked_lm.masking(tokenizer, 0.15, seed=7, stream=lm.TRAIN_STREAM)
    rows = np.arange(64)
    first, again = transform(batch, 3, rows), transform(batch, 3, rows)
    for key in ("input_ids", "labels", "label_weights"):
        assert np.array_equal(first[key], again[key])
    assert np.array_equal(first["labels"], ids) and np.array_equal(first["attention_mask"], batch["attention_mask"])
    assert not np.array_equal(transform(batch, 4, rows)["label_weights"], first["label_weights"])
    other_stream = masked_lm.masking(tokenizer, 0.15, seed=7, stream=lm.EVAL_STREAM)(batch, 3, rows)
    assert not np.array_equal(other_stream["label_weights"], first["label_weights"])
    weights = first["label_weights"].astype(bool)
    assert not np.isin(ids[weights], tokenizer.all_special_ids).any()
    assert weights.any()


def test_a_rows_mask_does_not_depend_on_how_the_batch_is_split(tokenizer):
    """Two processes masking their halves (or eval batches of another size) mask each row as one would."""
    ids = np.asarray(tokenizer(["the cat sat on the mat by the door"] * 32, padding="max_length",
                               max_length=16)["input_ids"])
    transform = masked_lm.masking(tokenizer, 0.3, seed=7, stream=lm.TRAIN_STREAM)
    whole = transform({"input_ids": ids}, 5, np.arange(32))
    halves = [transform({"input_ids": ids[rows]}, 5, np.arange(32)[rows]) for rows in (slice(0, 16), slice(16, 32))]
    for key in ("input_ids", "label_weights"):
        assert np.array_equal(np.concatenate([half[key] for half in halves]), whole[key])
    # A stream's processes read rows round robin: process 1 of 2 holds the odd rows of the batch.
    odd = transform({"input_ids": ids[1::2]}, 5, np.arange(1, 32, 2))
    assert np.array_equal(odd["label_weights"], whole["label_weights"][1::2])
    assert not np.array_equal(whole["label_weights"][0], whole["label_weights"][1])  # rows differ


def test_masking_needs_a_mask_token(tokenizer):
    no_mask = SimpleNamespace(mask_token_id=None)
    with pytest.raises(UsageError, match="mask token"):
        masked_lm.masking(no_mask, 0.15, seed=0, stream=0)


# ----------------------------------------------------------------------------------------------
# Token-weighted loss across devices
# ----------------------------------------------------------------------------------------------
def test_token_weighted_loss_across_devices_matches_hand_computation():
    devices, rows, length, vocab = jax.local_device_count(), 2, 6, 11
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(devices, rows, length, vocab)).astype(np.float32)
    labels = rng.integers(vocab, size=(devices, rows, length))
    # Very uneven selections: device 0 predicts one token, the last device every token.
    weights = np.zeros((devices, rows, length), np.float32)
    for d in range(devices):
        weights[d].flat[: 1 + d * (rows * length - 1) // max(devices - 1, 1)] = 1

    def step(logits, labels, weights):
        loss, tokens = cross_entropy_sums(logits, labels, weights)
        return jax.lax.psum({"loss": loss, "tokens": tokens}, AXIS)

    sums = jax.pmap(step, AXIS)(logits, labels, weights)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    token_losses = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
    expected = token_losses[weights == 1].mean()
    # float32 log-softmax and psum of <= 96 token losses vs float64 numpy: ~sqrt(96) x eps32 = 1.2e-6 relative.
    assert float(sums["loss"][0] / sums["tokens"][0]) == pytest.approx(expected, rel=1e-5)
    if devices > 1:  # the per-device mean the classic scripts took is a different number
        per_device = [token_losses[d][weights[d] == 1].mean() for d in range(devices)]
        assert abs(np.mean(per_device) - expected) > 1e-3  # 100 x the rounding above: a real difference


def test_causal_shift_predicts_the_next_token():
    # The CLM loss: logits at t scored against the input at t + 1.
    ids = jnp.array([[3, 5, 7, 9]])
    logits = jax.nn.one_hot(jnp.array([[5, 7, 9, 0]]), 11) * 50.0
    loss, tokens = cross_entropy_sums(logits[:, :-1], ids[:, 1:], jnp.ones((1, 3)))
    assert float(tokens) == 3 and float(loss) < 1e-6


# ----------------------------------------------------------------------------------------------
# Loading: validation split, file formats, text column
# ----------------------------------------------------------------------------------------------
def write_txt(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


def test_split_off_validation_takes_the_first_rows():
    dataset = datasets.Dataset.from_dict({"text": [str(i) for i in range(100)]})
    train, validation = lm.split_off_validation(dataset, 5)
    assert validation["text"] == [str(i) for i in range(5)]
    assert train["text"] == [str(i) for i in range(5, 100)]
    assert len(lm.split_off_validation(dataset.select(range(10)), 5)[1]) == 1  # at least one row
    with pytest.raises(UsageError, match="too few"):
        lm.split_off_validation(dataset.select(range(1)), 5)


def test_load_splits_falls_back_to_a_validation_split(tmp_path):
    train = write_txt(tmp_path / "train.txt", [f"line {i}" for i in range(40)])
    raw = lm.load_splits(data_args(train_file=train, validation_split_percentage=10),
                         do_train=True, do_eval=True)
    assert len(raw["validation"]) == 4 and len(raw["train"]) == 36
    assert raw["validation"]["text"][0] == "line 0\n"
    # Eval-only holds out the same rows, so it evaluates on what training did not see.
    eval_only = lm.load_splits(data_args(train_file=train, validation_split_percentage=10),
                               do_train=False, do_eval=True)
    assert eval_only["validation"]["text"] == raw["validation"]["text"]


def test_load_splits_keeps_a_given_validation_file(tmp_path):
    train = write_txt(tmp_path / "train.txt", [f"line {i}" for i in range(40)])
    validation = write_txt(tmp_path / "validation.txt", ["held out"])
    raw = lm.load_splits(data_args(train_file=train, validation_file=validation),
                         do_train=True, do_eval=True)
    assert len(raw["train"]) == 40 and raw["validation"]["text"] == ["held out\n"]
    train_only = lm.load_splits(data_args(train_file=train, validation_file=validation),
                                do_train=True, do_eval=False)
    assert len(train_only["train"]) == 40  # nothing carved off when a validation file exists


@pytest.mark.parametrize("keep_linebreaks, expected", [(True, "first line\n"), (False, "first line")])
def test_txt_keep_linebreaks(tmp_path, keep_linebreaks, expected):
    train = write_txt(tmp_path / "train.txt", ["first line", "second line"])
    raw = lm.load_splits(data_args(train_file=train, keep_linebreaks=keep_linebreaks),
                         do_train=True, do_eval=False)
    assert raw["validation"]["text"] == [expected]  # the first row of two is held out
    assert lm.resolve_text_column(None, raw["train"]) == "text"


def test_csv_and_json_inputs(tmp_path, tokenizer):
    (tmp_path / "train.csv").write_text("id,content\n" + "".join(f"{i},sentence {i}\n" for i in range(20)))
    raw = lm.load_splits(data_args(train_file=str(tmp_path / "train.csv")), do_train=True, do_eval=False)
    with pytest.raises(UsageError, match="not text: pass --text_column"):
        lm.resolve_text_column(None, raw["train"])  # the first column holds numbers
    assert lm.resolve_text_column("content", raw["train"]) == "content"
    with pytest.raises(UsageError, match="not a column"):
        lm.resolve_text_column("body", raw["train"])

    rows = [{"title": f"t{i}", "text": f"sentence {i}"} for i in range(20)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "validation.json").write_text("".join(json.dumps(row) + "\n" for row in rows[:3]))
    raw = lm.load_splits(data_args(train_file=str(tmp_path / "train.jsonl"),
                                   validation_file=str(tmp_path / "validation.json")),
                         do_train=True, do_eval=True)
    column = lm.resolve_text_column(None, raw["train"])
    assert column == "text" and len(raw["validation"]) == 3
    blocks = lm.tokenize_and_group(raw["train"], tokenizer, column, 8, data_args())
    assert len(blocks) > 0 and set(map(len, blocks["input_ids"])) == {8}


def test_check_before_work(tmp_path):
    """An LM task's checks, run by the engine's preflight (`lm.INPUTS`)."""
    train = write_txt(tmp_path / "train.txt", ["a line"])
    (tmp_path / "tokenizer").mkdir()
    model = ModelArguments(model_type="gpt2", tokenizer_name=str(tmp_path / "tokenizer"))
    check = partial(check_before_work, masked_lm.TASK, model)
    check(data_args(train_file=train), training_args(tmp_path, do_eval=True))  # the held-out part
    with pytest.raises(UsageError, match="--do_predict"):
        check(data_args(train_file=train), training_args(tmp_path, do_predict=True))
    with pytest.raises(UsageError, match="--validation_file"):
        check(data_args(), training_args(tmp_path, do_eval=True))
    with pytest.raises(UsageError, match=r"--text_column 'body' is not a column of the train data; its columns: text"):
        check(data_args(train_file=train, text_column="body"), training_args(tmp_path, do_eval=True))
    with pytest.raises(UsageError, match="--streaming needs --max_steps"):
        check(data_args(train_file=train, streaming=True), training_args(tmp_path, do_train=True))
    with pytest.raises(UsageError, match="validation_split_percentage"):
        data_args(validation_split_percentage=100)


# ----------------------------------------------------------------------------------------------
# Length limits
# ----------------------------------------------------------------------------------------------
def test_sequence_length_defaults_and_clamps(tokenizer, caplog):
    gpt2 = AutoConfig.for_model("gpt2", n_positions=256)
    assert lm.sequence_length(None, 1024, tokenizer, gpt2, "block_size") == 256  # clamped
    assert "256 positions" in caplog.text
    assert lm.sequence_length(64, 1024, tokenizer, gpt2, "block_size") == 64
    roberta = AutoConfig.for_model("roberta", max_position_embeddings=514)
    assert lm.sequence_length(None, 512, tokenizer, roberta, "max_seq_length") == min(
        512, tokenizer.model_max_length)
