"""tasks/span_corruption.py: the lengths rule, the masking, reproducibility, the up-front checks."""

import itertools
import os

import numpy as np
import pytest
from transformers import AutoTokenizer

from train_tokenizer import train_tokenizer
from tasks import span_corruption as sc
from utils.base.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 1
VOCAB = 5000
# Synthetic ids for the pure functions: T5's layout, sentinels counting down from the top.
SENTINELS = np.arange(VOCAB - 1, VOCAB - 1001, -1)
TEXTS = [f"The {animal} number {i} sleeps in the {place} on {day}." for i, (animal, place, day) in enumerate(
    itertools.product(["cat", "dog", "owl", "fox"], ["barn", "den", "nest"], ["Monday", "Friday"]))] * 5


def blocks(rows, raw_length, seed=0):
    """Random ordinary tokens: never EOS, never a sentinel."""
    return np.random.default_rng(seed).integers(2, VOCAB - 1000, size=(rows, raw_length))


def uniforms(rows, raw_length, seed=0):
    """The random numbers `corrupt` takes for `rows` blocks of `raw_length` tokens."""
    return np.random.default_rng(seed).random((rows, sc.uniforms_per_row(raw_length)))


def decompose(inputs, targets, sentinels=SENTINELS):
    """(original tokens, noise mask, first span is noise) of one example, checking its structure."""
    assert inputs[-1] == EOS and targets[-1] == EOS
    inputs, targets = list(inputs[:-1]), list(targets[:-1])
    sentinel_number = {int(s): k for k, s in enumerate(sentinels)}
    # Targets: sentinel 0, its tokens, sentinel 1, ... in order, each span non-empty.
    spans, opens = [], [i for i, t in enumerate(targets) if t in sentinel_number]
    assert opens and opens[0] == 0 and [sentinel_number[targets[i]] for i in opens] == list(range(len(opens)))
    for start, stop in zip(opens, opens[1:] + [len(targets)]):
        assert stop - start >= 2
        spans.append(targets[start + 1: stop])
    # Inputs: the same sentinels in the same order, one per span, never two in a row.
    in_inputs = [sentinel_number[t] for t in inputs if t in sentinel_number]
    assert in_inputs == list(range(len(spans)))
    original, noise = [], []
    for previous, token in zip([None] + inputs, inputs):
        assert not (previous in sentinel_number and token in sentinel_number)
        span = spans[sentinel_number[token]] if token in sentinel_number else [token]
        original += span
        noise += [token in sentinel_number] * len(span)
    return np.array(original), np.array(noise), inputs[0] in sentinel_number


def reachable_raw_lengths(max_seq_length, density, mean_span):
    """Every raw length whose input length is max_seq_length, by the spec's counts (brute force)."""
    # Longer blocks keep more than max_seq_length non-noise tokens.
    raw = np.arange(2, int(max_seq_length / (1 - density)) + 3)
    noise = np.clip(np.round(raw * density), 1, raw - 1)
    spans = np.clip(np.round(noise / mean_span), 1, np.minimum(noise, raw - noise))
    return raw[raw - noise + spans + 1 == max_seq_length]


# ----------------------------------------------------------------------------------------------
# Lengths
# ----------------------------------------------------------------------------------------------
def test_lengths_of_the_t5_defaults():
    # max_seq_length 512, 15% noise, spans of 3: blocks of 568 tokens, targets of 114 (T5's figures).
    assert sc.span_corruption_lengths(512, 0.15, 3) == (568, 512, 114, 85, 28)


def test_half_noise_keeps_the_targets_as_long_as_the_inputs():
    # T5's helper (and the classic script) take blocks of 766, not 767 (targets of 513), at density 0.5.
    assert sc.span_corruption_lengths(512, 0.5, 3) == (766, 512, 512, 383, 128)
    # Where one token less would change the inputs, the longest block stays (targets one longer).
    assert sc.span_corruption_lengths(63, 0.5, 2) == (83, 63, 64, 42, 21)


@pytest.mark.parametrize("density", [0.05, 0.1, 0.15, 0.2, 0.3, 0.45, 0.5, 0.51, 0.65, 0.8])
def test_lengths_grid_every_example_exact_or_refused_up_front(density):
    """Refused exactly when no raw length works (dense noise in short spans: see the next test)."""
    first_span_kinds = set()
    for max_seq_length, mean_span in itertools.product([64, 65, 100, 101, 128, 255, 256, 512, 513, 777, 1024],
                                                       [1, 1.5, 2, 2.5, 3, 4.5, 5, 7, 10]):
        reachable = reachable_raw_lengths(max_seq_length, density, mean_span)
        if len(reachable) == 0:
            with pytest.raises(UsageError, match="no raw length gives exactly"):
                sc.span_corruption_lengths(max_seq_length, density, mean_span)
            continue
        lengths = sc.span_corruption_lengths(max_seq_length, density, mean_span)
        half_noise_exception = density == 0.5 and lengths.raw_length == reachable.max() - 1
        assert lengths.raw_length == reachable.max() or half_noise_exception
        assert lengths.input_length == max_seq_length
        assert abs(lengths.noise_tokens - lengths.raw_length * density) <= 0.5  # an integer count rounded to nearest
        assert lengths.target_length == lengths.noise_tokens + lengths.noise_spans + 1
        inputs, targets = sc.corrupt(blocks(8, lengths.raw_length), lengths.noise_tokens, lengths.noise_spans,
                                     SENTINELS, EOS, uniforms(8, lengths.raw_length, seed=max_seq_length))
        assert inputs.shape == (8, max_seq_length) and targets.shape == (8, lengths.target_length)
        assert (np.isin(inputs, SENTINELS).sum(axis=1) == lengths.noise_spans).all()
        assert (targets[:, 0] == SENTINELS[0]).all()
        first_span_kinds |= set(np.isin(inputs[:, 0], SENTINELS))
    assert first_span_kinds == {True, False}  # the lengths hold whichever kind of span comes first


def test_refusals_name_the_nearest_lengths_that_work():
    # 80% noise in spans of 1: every non-noise token is its own span, so inputs are always odd.
    with pytest.raises(UsageError, match="use --max_seq_length 511 or 513,"):
        sc.span_corruption_lengths(512, 0.8, 1)
    assert sc.span_corruption_lengths(511, 0.8, 1).input_length == 511
    with pytest.raises(UsageError, match="use --max_seq_length 3,"):
        sc.span_corruption_lengths(2, 0.15, 3)


@pytest.mark.parametrize("density, mean_span, message", [
    (0, 3, r"--mlm_probability \(the noise density\) must be between 0 and 1"),
    (1, 3, r"--mlm_probability \(the noise density\) must be between 0 and 1"),
    (1.5, 3, r"--mlm_probability \(the noise density\) must be between 0 and 1"),
    (float("nan"), 3, r"--mlm_probability \(the noise density\) must be between 0 and 1"),
    (0.15, 0, "--mean_noise_span_length must be at least 1"),
    (0.15, -2, "--mean_noise_span_length must be at least 1"),
    (0.15, 0.5, "--mean_noise_span_length must be at least 1"),
    (0.15, float("inf"), "--mean_noise_span_length must be at least 1 and finite"),  # trained as one span a row
])
def test_bad_density_or_span_length_is_a_one_line_usage_error(density, mean_span, message):
    with pytest.raises(UsageError, match=message) as raised:
        sc.span_corruption_lengths(512, density, mean_span)
    assert "\n" not in str(raised.value)


# ----------------------------------------------------------------------------------------------
# Masking
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_seq_length, density, mean_span", [(64, 0.15, 3), (127, 0.5, 1.5), (101, 0.8, 10)])
def test_corruption_reconstructs_the_original(max_seq_length, density, mean_span):
    lengths = sc.span_corruption_lengths(max_seq_length, density, mean_span)
    original = blocks(64, lengths.raw_length)
    inputs, targets = sc.corrupt(original, lengths.noise_tokens, lengths.noise_spans, SENTINELS, EOS,
                                 uniforms(64, lengths.raw_length))
    assert inputs.dtype == original.dtype and targets.dtype == original.dtype
    noise_masks, noise_first = [], []
    for row in range(len(original)):
        restored, noise, first_is_noise = decompose(inputs[row], targets[row])
        assert np.array_equal(restored, original[row])
        assert noise.sum() == lengths.noise_tokens
        assert len(np.flatnonzero(np.diff(noise.astype(int)) == 1)) + noise[0] == lengths.noise_spans
        # The other kind of span ends the example: as many non-noise spans as noise spans.
        assert noise[-1] != first_is_noise
        noise_masks.append(noise)
        noise_first.append(first_is_noise)
    assert 0 < sum(noise_first) < len(noise_first)  # 64 rows: both starts (each with probability 1/2)
    # More layouts than the two starts: the span lengths vary too.
    assert len({mask.tobytes() for mask in noise_masks}) > 2


def test_span_lengths_are_random_compositions():
    parts = sc.random_compositions(10, 4, np.random.default_rng(0).random((2000, 9)))
    assert parts.shape == (2000, 4) and (parts >= 1).all() and (parts.sum(axis=1) == 10).all()
    # All C(9, 3) = 84 compositions of 10 into 4 parts turn up, none far more often than the rest.
    counts = np.unique(parts, axis=0, return_counts=True)[1]
    assert len(counts) == 84 and counts.max() < 3 * 2000 / 84
    assert (sc.random_compositions(5, 1, np.random.default_rng(0).random((3, 4))) == 5).all()
    assert (sc.random_compositions(5, 5, np.random.default_rng(0).random((3, 4))) == 1).all()


def test_extreme_counts_one_span_and_all_single_token_spans():
    original = blocks(16, 12)
    for noise_tokens, noise_spans in [(1, 1), (11, 1), (6, 6), (4, 4)]:
        inputs, targets = sc.corrupt(original, noise_tokens, noise_spans, SENTINELS, EOS, uniforms(16, 12, seed=1))
        assert inputs.shape == (16, 12 - noise_tokens + noise_spans + 1)
        assert targets.shape == (16, noise_tokens + noise_spans + 1)
        for row in range(16):
            assert np.array_equal(decompose(inputs[row], targets[row])[0], original[row])


# ----------------------------------------------------------------------------------------------
# Tokenizer, transform
# ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """Unigram (T5-style) tokenizers with 100 sentinels and with 3, reloaded from disk."""
    loaded = {}
    for extra_ids in (100, 3):
        path = tmp_path_factory.mktemp(f"extra_ids_{extra_ids}")
        train_tokenizer("unigram", TEXTS, vocab_size=300, extra_ids=extra_ids).save_pretrained(path)
        loaded[extra_ids] = AutoTokenizer.from_pretrained(path)
    return loaded


def test_plan_takes_the_sentinels_and_eos_from_the_tokenizer(tokenizers):
    tok = tokenizers[100]
    plan = sc.plan_span_corruption(tok, 64, 0.15, 3)
    assert plan.lengths == sc.span_corruption_lengths(64, 0.15, 3) and plan.eos_id == tok.eos_token_id
    assert list(plan.sentinel_ids) == [len(tok) - 1 - k for k in range(plan.lengths.noise_spans)]
    assert tok.convert_ids_to_tokens(list(plan.sentinel_ids[:2])) == ["<extra_id_0>", "<extra_id_1>"]


def test_transform_builds_a_t5_batch(tokenizers):
    tok = tokenizers[100]
    plan = sc.plan_span_corruption(tok, 32, 0.3, 2)
    text = " ".join(TEXTS)
    ids = np.array(tok(text)["input_ids"][: 3 * plan.lengths.raw_length], np.int32).reshape(3, -1)
    batch = sc.span_corruption(plan, tok.pad_token_id, seed=0, stream=0)({"input_ids": ids}, 0, np.arange(3))
    assert batch.keys() == {"input_ids", "labels", "decoder_input_ids"}
    assert batch["input_ids"].shape == (3, 32) and batch["labels"].shape == (3, plan.lengths.target_length)
    assert all(v.dtype == np.int32 for v in batch.values())
    assert (batch["decoder_input_ids"][:, 0] == tok.pad_token_id).all()
    assert np.array_equal(batch["decoder_input_ids"][:, 1:], batch["labels"][:, :-1])
    for row in range(3):
        restored = decompose(batch["input_ids"][row], batch["labels"][row], plan.sentinel_ids)[0]
        assert np.array_equal(restored, ids[row])
    # The sentinels are the tokenizer's own: the labels read as "<extra_id_0> ... <extra_id_1> ...".
    assert tok.decode(batch["labels"][0]).startswith("<extra_id_0>")


def test_masks_are_a_pure_function_of_seed_stream_step_and_global_row(tokenizers):
    """Each row is corrupted from (seed, stream, step, its row in the global batch) alone: process p of
    P (here rows 2..5 of 8, as process 1 of 4 gets them) corrupts its rows as one process corrupts
    those rows of the whole batch, and a row does not depend on the rows beside it."""
    plan = sc.plan_span_corruption(tokenizers[100], 64, 0.15, 3)
    raw = blocks(8, plan.lengths.raw_length)

    def corrupted(rows=slice(None), step=5, seed=0, stream=0):
        row_ids = np.arange(8)[rows]
        return sc.span_corruption(plan, 0, seed, stream)({"input_ids": raw[rows]}, step, row_ids)["input_ids"]

    whole = corrupted()
    assert np.array_equal(corrupted(), whole)
    assert np.array_equal(corrupted(slice(2, 6)), whole[2:6])
    assert np.array_equal(np.concatenate([corrupted(slice(0, 8, 2)), corrupted(slice(1, 8, 2))]),
                          whole[np.r_[0:8:2, 1:8:2]])  # round robin, as streams deal rows to processes
    for other in (corrupted(step=6), corrupted(seed=1), corrupted(stream=1)):
        assert (other != whole).any(axis=1).all()  # every row draws anew
    # The same raw block in another row of the batch gets another layout.
    same_block = sc.span_corruption(plan, 0, 0, 0)({"input_ids": raw[[0, 0]]}, 5, np.arange(2))["input_ids"]
    assert np.array_equal(same_block[0], whole[0]) and not np.array_equal(same_block[1], whole[0])


def test_transform_rejects_blocks_of_another_length(tokenizers):
    plan = sc.plan_span_corruption(tokenizers[100], 64, 0.15, 3)
    with pytest.raises(ValueError, match=f"expects blocks of {plan.lengths.raw_length} tokens, got 64"):
        sc.span_corruption(plan, 0, 0, 0)({"input_ids": blocks(2, 64)}, 0, np.arange(2))


def test_a_tokenizer_without_or_with_too_few_sentinels_is_refused(tokenizers):
    bpe = AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "lm", "tokenizer"))  # RoBERTa-style: no <extra_id_N>
    with pytest.raises(UsageError, match="no sentinel tokens .* train_tokenizer.py --extra_ids 100") as raised:
        sc.plan_span_corruption(bpe, 64, 0.15, 3)
    assert "\n" not in str(raised.value)
    # 65 input tokens, 15% noise in spans of 3: 4 spans, one more than 3 sentinels; 64: 3 spans.
    with pytest.raises(UsageError, match="needs 4 sentinel tokens per example but the tokenizer has only 3"):
        sc.plan_span_corruption(tokenizers[3], 65, 0.15, 3)
    assert sc.plan_span_corruption(tokenizers[3], 64, 0.15, 3).lengths.noise_spans == 3
    # Spans of one token at 50% noise in 511 tokens: 255 spans, more than T5's 100 sentinels.
    with pytest.raises(UsageError, match="needs 255 sentinel tokens .* only 100"):
        sc.plan_span_corruption(tokenizers[100], 511, 0.5, 1)
