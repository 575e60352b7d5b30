"""tasks/denoising.py: sentences and their separator, blocks, the noise (permutation, Poisson infilling with
insertions, random tokens) checked on large samples against plain computations, purity and resume, the checks."""

import itertools
import math
import os
from collections import Counter
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from transformers import AutoTokenizer

from tasks import denoising as dn
from tasks import lm
from utils.base.errors import UsageError
from utils.data import arrow_columns
from utils.scoring.metrics import split_sentences

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASK, SEPARATOR = 1, 2
# Synthetic ordinary ids for the pure functions: all distinct, so a kept token tells where it came from.
FIRST_ORDINARY = 10


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "lm", "tokenizer"))  # BART-style BPE


@pytest.fixture(scope="module")
def lines():
    with open(os.path.join(ROOT, "data", "lm", "train.txt"), encoding="utf-8") as f:
        return f.read().splitlines()[:300]


def data_args(**changes):
    args = dict(max_seq_length=64, sentence_separator=None, mlm_probability=0.3, permute_sentence_ratio=1.0,
                poisson_lambda=3.0, random_token_ratio=0.0)
    return SimpleNamespace(**{**args, **changes})


def bart_config(positions=64, model_type="bart"):
    return SimpleNamespace(max_position_embeddings=positions, model_type=model_type)


def synthetic_plan(body_length=60, **changes):
    rates = dict(mlm_probability=0.3, permute_sentence_ratio=1.0, poisson_lambda=3.0, random_token_ratio=0.0)
    rates.update(changes)
    return dn.DenoisingPlan(body_length + 2, body_length, 0, 3, 4, MASK, SEPARATOR,
                            np.arange(FIRST_ORDINARY, 1000), **rates)


def distinct_body(length):
    return np.arange(FIRST_ORDINARY, FIRST_ORDINARY + length, dtype=np.int32)


def align(original, noised):
    """[(tokens hidden behind each mask run, masks in the run)] of a noised body whose kept tokens are
    distinct: the non-mask tokens must be the original's in order, and each run of masks stands for
    the original tokens between its neighbours."""
    kept = [token for token in noised if token != MASK]
    position = {token: i for i, token in enumerate(original)}
    places = [position[token] for token in kept]
    assert places == sorted(places) and len(set(places)) == len(places), "kept tokens out of order"
    runs, previous, masks = [], -1, 0
    for token in list(noised) + [None]:
        if token == MASK:
            masks += 1
            continue
        here = len(original) if token is None else position[token]
        hidden = here - previous - 1
        assert masks > 0 or hidden == 0, "tokens dropped without a mask"
        if masks:
            runs.append((hidden, masks))
        previous, masks = here, 0
    return runs


# ----------------------------------------------------------------------------------------------
# Sentences and blocks
# ----------------------------------------------------------------------------------------------
def test_sentence_pieces_cut_at_real_sentence_ends_and_line_breaks():
    text = "Dr. Smith met Mrs. Jones at 3 p.m. in the U.S. embassy. They talked.\nA new line  here. Last one  "
    pieces = dn.sentence_pieces(text)
    assert pieces == ["Dr. Smith met Mrs. Jones at 3 p.m. in the U.S. embassy.", " They talked.",
                      "\nA new line  here.", " Last one"]
    assert "".join(pieces) == text.rstrip()
    # The same sentences as Punkt finds line by line (no download: the packaged English parameters).
    assert [p.strip() for p in pieces] == [s for line in text.splitlines() for s in split_sentences(line)]
    assert dn.sentence_pieces("   ") == [] and dn.sentence_pieces("no end") == ["no end"]


def test_each_sentence_ends_with_the_separator_and_keeps_the_texts_tokens(tokenizer, lines):
    separator = tokenizer.eos_token_id
    texts = lines + ["", "   "]  # blank texts give nothing, as in lm.encode_texts
    encoded = dn.encode_sentences(tokenizer, texts, separator)
    assert len(encoded) == len(lines)
    for text, ids in zip(lines, encoded):
        # One separator after each sentence, and between them exactly the tokens of the whole text.
        assert ids[-1] == separator and ids.count(separator) == len(split_sentences(text))
        assert [i for i in ids if i != separator] == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert dn.encode_sentences(tokenizer, ["", " "], separator) == []


def test_streamed_blocks_equal_the_in_memory_ones(tokenizer, lines):
    import datasets

    plan = dn.plan_denoising(tokenizer, bart_config(), data_args())
    no_workers = SimpleNamespace(preprocessing_num_workers=None, overwrite_cache=True)
    in_memory = lm.tokenize_and_group(datasets.Dataset.from_dict({"text": lines}), tokenizer, "text",
                                      plan.body_length, no_workers,
                                      partial(dn.encode_sentences, separator_id=plan.separator_id))
    streamed = dn.SentenceBlocks(tokenizer, plan.body_length, plan.separator_id)(lines)["input_ids"]
    assert streamed.shape[1] == plan.body_length == 62 and len(streamed) > 50
    assert np.array_equal(arrow_columns.to_arrays(in_memory, ("input_ids",))["input_ids"], streamed)
    copied = dn.SentenceBlocks(tokenizer, plan.body_length, plan.separator_id).copy()
    assert copied.separator_id == plan.separator_id and np.array_equal(copied(lines)["input_ids"], streamed)
    assert copied.describe()["separator"] == tokenizer.eos_token_id


# ----------------------------------------------------------------------------------------------
# Sentence permutation
# ----------------------------------------------------------------------------------------------
def sentences_of(body):
    return [tuple(body[start:stop]) for start, stop in dn.sentence_bounds(body, SEPARATOR)]


def test_sentence_bounds_count_the_pieces_the_block_cuts():
    body = np.array([5, 6, SEPARATOR, 7, SEPARATOR, 8, 9])
    assert dn.sentence_bounds(body, SEPARATOR) == [(0, 3), (3, 5), (5, 7)]
    assert dn.sentence_bounds(body[:5], SEPARATOR) == [(0, 3), (3, 5)]
    assert dn.sentence_bounds(np.array([5, 6]), SEPARATOR) == [(0, 2)]


def test_permutation_is_a_uniform_permutation_of_the_sentences():
    """Ratio 1: every one of the 4! orders about equally often (a plain count), always the same sentences."""
    body = np.array([11, SEPARATOR, 12, 13, SEPARATOR, 14, SEPARATOR, 15, 16])  # the last one cut by the block
    sentences = sentences_of(body)
    orders = Counter()
    rng = np.random.default_rng(0)
    for _ in range(4800):
        permuted = dn.permute_sentences(body, SEPARATOR, 1.0, rng)
        assert len(permuted) == len(body)
        # The pieces between separators are the original sentences, each once.
        order = tuple(sentences.index(s) for s in pieces_in(permuted, sentences))
        orders[order] += 1
    assert set(orders) == set(itertools.permutations(range(4)))
    expected = 4800 / 24
    assert max(abs(count - expected) for count in orders.values()) < 5 * math.sqrt(expected)


def pieces_in(permuted, sentences):
    """The original sentences `permuted` consists of, in order (matched greedily; all are distinct)."""
    found, rest = [], tuple(permuted)
    while rest:
        match = next(s for s in sentences if rest[:len(s)] == s)
        found.append(match)
        rest = rest[len(match):]
    return found


@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5])
def test_a_ratio_moves_at_most_its_share_of_the_sentences(ratio):
    body = np.concatenate([[20 + i, SEPARATOR] for i in range(8)])
    rng = np.random.default_rng(1)
    moved = []
    for _ in range(500):
        permuted = dn.permute_sentences(body, SEPARATOR, ratio, rng)
        assert sorted(permuted) == sorted(body)
        moved.append(int((permuted[::2] != body[::2]).sum()))
    assert max(moved) <= math.ceil(8 * ratio)
    # The chosen ones trade places at random: some stay, mostly they move.
    assert (ratio == 0) == (max(moved) == 0)


# ----------------------------------------------------------------------------------------------
# Poisson span lengths and infilling
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("poisson_lambda", [3.0, 3.5, 0.7])
def test_span_lengths_are_poisson_and_cover_the_masked_tokens_exactly(poisson_lambda):
    rng = np.random.default_rng(2)
    drawn = [dn.poisson_span_lengths(600, poisson_lambda, rng) for _ in range(300)]
    assert all(lengths.sum() == 600 and (lengths >= 0).all() for lengths in drawn)
    pooled = np.concatenate(drawn)
    # The histogram against the Poisson probabilities, computed plainly: ~100,000+ lengths, so each
    # share is within 0.005 (the one cut length per row moves them by less than 1/200 of that).
    for k in range(8):
        pmf = math.exp(-poisson_lambda) * poisson_lambda ** k / math.factorial(k)
        assert abs((pooled == k).mean() - pmf) < 0.005, k
    assert abs(pooled.mean() - poisson_lambda) < 0.03
    assert (pooled == 0).any()  # insertions
    assert dn.poisson_span_lengths(0, 3.0, rng).size == 0


def test_infill_replaces_each_span_by_one_mask_and_keeps_the_rest_in_order():
    rng = np.random.default_rng(3)
    body = distinct_body(40)
    for _ in range(300):
        lengths = dn.poisson_span_lengths(12, 1.5, rng)
        noised = dn.infill(body, lengths, MASK, np.arange(FIRST_ORDINARY, 1000), 0.0, rng)
        assert noised.dtype == body.dtype
        assert (noised == MASK).sum() == len(lengths) and len(noised) == 40 - 12 + len(lengths)
        runs = align(body, noised)
        assert sum(hidden for hidden, _ in runs) == 12


def test_spans_lie_anywhere_with_equal_chance():
    """One span of 3 tokens in a body of 10: its 8 possible places about equally often (plain count)."""
    rng = np.random.default_rng(4)
    starts = Counter()
    for _ in range(4000):
        noised = dn.infill(distinct_body(10), np.array([3]), MASK, np.arange(100, 200), 0.0, rng)
        starts[int(np.flatnonzero(noised == MASK)[0])] += 1
    assert sorted(starts) == list(range(8))
    assert max(abs(count - 500) for count in starts.values()) < 5 * math.sqrt(500)


def test_random_token_ratio_replaces_that_share_of_the_masks_by_ordinary_tokens():
    rng = np.random.default_rng(5)
    replacements = np.arange(5000, 6000)  # apart from the body's ids, to be told from them
    fills = []
    for _ in range(400):
        lengths = dn.poisson_span_lengths(30, 3.0, rng)
        noised = dn.infill(distinct_body(100), lengths, MASK, replacements, 0.2, rng)
        fills += list(noised[(noised == MASK) | (noised >= 5000)])
    fills = np.array(fills)
    assert np.isin(fills[fills != MASK], replacements).all()
    share = (fills != MASK).mean()
    assert abs(share - 0.2) < 0.02, share
    assert len(np.unique(fills[fills != MASK])) > 500  # drawn over all ordinary tokens


def test_noise_masks_the_share_of_tokens_asked_with_insertions():
    """Over many bodies: exactly ceil(p x length) tokens hidden (from lengths alone: the noised body is
    length - hidden + masks long), and some masks are insertions (a mask between two neighbours)."""
    for p, poisson_lambda in [(0.3, 3.0), (0.15, 3.5), (0.5, 1.0)]:
        plan = synthetic_plan(body_length=97, mlm_probability=p, poisson_lambda=poisson_lambda,
                              permute_sentence_ratio=0.0)
        rng = np.random.default_rng(6)
        insertions = masks = 0
        for _ in range(300):
            noised = dn.noise(distinct_body(97), plan, rng)
            hidden = 97 - len(noised) + (noised == MASK).sum()
            assert hidden == math.ceil(97 * p)
            runs = align(distinct_body(97), noised)
            assert sum(h for h, _ in runs) == hidden
            insertions += sum(m for h, m in runs if h == 0)
            masks += (noised == MASK).sum()
        # A zero-length span is a Poisson zero: about exp(-lambda) of the spans, fewer seen alone
        # (an insertion next to another span joins its run of masks).
        assert 0 < insertions / masks <= math.exp(-poisson_lambda) * 1.3


# ----------------------------------------------------------------------------------------------
# The transform: a BART batch, each row from its own random numbers
# ----------------------------------------------------------------------------------------------
def test_transform_builds_a_bart_batch(tokenizer, lines):
    plan = dn.plan_denoising(tokenizer, bart_config(), data_args())
    bodies = dn.SentenceBlocks(tokenizer, plan.body_length, plan.separator_id)(lines)["input_ids"][:16]
    batch = dn.denoising(plan, tokenizer.eos_token_id, seed=0, stream=0)({"input_ids": bodies}, 3, np.arange(16))
    assert batch.keys() == {"input_ids", "attention_mask", "labels", "decoder_input_ids"}
    assert all(v.shape == (16, 64) and v.dtype == np.int32 for v in batch.values())
    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    assert (batch["labels"][:, 0] == bos).all() and (batch["labels"][:, -1] == eos).all()
    assert np.array_equal(batch["labels"][:, 1:-1], bodies)
    assert (batch["decoder_input_ids"][:, 0] == eos).all()  # BART starts decoding from EOS
    assert np.array_equal(batch["decoder_input_ids"][:, 1:], batch["labels"][:, :-1])
    for inputs, mask, body in zip(batch["input_ids"], batch["attention_mask"], bodies):
        length = int(mask.sum())
        assert (mask[:length] == 1).all() and (inputs[length:] == pad).all()
        assert inputs[0] == bos and inputs[length - 1] == eos
        # ceil(30% of 62) = 19 tokens hidden, in spans that each leave one mask token.
        assert length == 64 - 19 + (inputs == tokenizer.mask_token_id).sum()
    # The text reads as the original's sentences, some permuted, masked.
    assert tokenizer.mask_token in tokenizer.decode(batch["input_ids"][0])
    mbart = dn.denoising(plan, None, seed=0, stream=0)({"input_ids": bodies}, 3, np.arange(16))
    assert (mbart["decoder_input_ids"][:, 0] == mbart["labels"][:, -1]).all()  # mBART: the last label token
    assert np.array_equal(mbart["input_ids"], batch["input_ids"])


def test_insertions_beyond_the_length_are_cut_keeping_eos():
    # Poisson(0.05): almost every span is an insertion, so the noised body grows past the example.
    plan = synthetic_plan(body_length=30, mlm_probability=0.9, poisson_lambda=0.05, permute_sentence_ratio=0.0)
    batch = dn.denoising(plan, 3, 0, 0)({"input_ids": np.tile(distinct_body(30), (4, 1))}, 1, np.arange(4))
    assert (batch["attention_mask"] == 1).all() and (batch["input_ids"][:, -1] == plan.eos_id).all()
    assert (batch["input_ids"][:, 0] == plan.bos_id).all()


def test_noise_is_a_pure_function_of_seed_stream_step_and_global_row():
    plan = synthetic_plan()
    bodies = np.stack([np.where(np.arange(60) % 7 == 6, SEPARATOR, distinct_body(60)) for _ in range(8)])

    def noised(rows=slice(None), step=5, seed=0, stream=0):
        row_ids = np.arange(8)[rows]
        return dn.denoising(plan, 3, seed, stream)({"input_ids": bodies[rows]}, step, row_ids)["input_ids"]

    whole = noised()
    assert np.array_equal(noised(), whole)
    assert np.array_equal(noised(slice(2, 6)), whole[2:6])  # process 1 of 4
    assert np.array_equal(np.concatenate([noised(slice(0, 8, 2)), noised(slice(1, 8, 2))]),
                          whole[np.r_[0:8:2, 1:8:2]])  # round robin, as streams deal rows to processes
    for other in (noised(step=6), noised(seed=1), noised(stream=1)):
        assert (other != whole).any(axis=1).all()
    # Rows with the same body differ: each row draws its own.
    assert len({row.tobytes() for row in whole}) == 8


def resumes_exactly(make_transform, bodies, steps=8, resume_at=5):
    """Whether a run restarted at `resume_at` (a fresh process: the transform made anew) noises its
    batches as the uninterrupted run did."""
    rows = np.arange(len(bodies))
    uninterrupted = make_transform()
    whole = [uninterrupted({"input_ids": bodies}, step, rows)["input_ids"] for step in range(1, steps + 1)]
    resumed = make_transform()
    again = [resumed({"input_ids": bodies}, step, rows)["input_ids"] for step in range(resume_at, steps + 1)]
    return all(np.array_equal(a, b) for a, b in zip(whole[resume_at - 1:], again))


def test_a_resumed_run_noises_as_the_uninterrupted_one(monkeypatch):
    plan = synthetic_plan()
    bodies = np.stack([distinct_body(60)] * 4)
    assert resumes_exactly(lambda: dn.denoising(plan, 3, 42, lm.TRAIN_STREAM), bodies)

    # Negative control: the classic script's randomness, one generator seeded at start-up whose
    # state moves with every batch (global np.random), does not survive a restart.
    def global_random():
        shared = np.random.default_rng(42)
        monkeypatch.setattr(dn, "row_generator", lambda *key: shared)
        return dn.denoising(plan, 3, 42, lm.TRAIN_STREAM)

    assert not resumes_exactly(global_random, bodies)


# ----------------------------------------------------------------------------------------------
# Checks before any work, loss
# ----------------------------------------------------------------------------------------------
def test_plan_from_the_tokenizer(tokenizer):
    plan = dn.plan_denoising(tokenizer, bart_config(), data_args())
    assert (plan.seq_length, plan.body_length) == (64, 62)
    assert (plan.bos_id, plan.eos_id, plan.pad_id, plan.mask_id, plan.separator_id) == (
        tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.mask_token_id,
        tokenizer.eos_token_id)
    assert not np.isin(plan.replacement_ids, tokenizer.all_special_ids).any()
    assert len(plan.replacement_ids) == len(tokenizer) - len(set(tokenizer.all_special_ids))
    # Longer than the model's positions: lowered to them. Another separator: one of its tokens.
    assert dn.plan_denoising(tokenizer, bart_config(32), data_args(max_seq_length=100)).seq_length == 32
    dot = dn.plan_denoising(tokenizer, bart_config(), data_args(sentence_separator="."))
    assert dot.separator_id == tokenizer.convert_tokens_to_ids(".") != tokenizer.unk_token_id


def test_what_cannot_work_is_refused_up_front(tokenizer):
    no_mask = AutoTokenizer.from_pretrained(os.path.join(ROOT, "data", "summarization", "tokenizer"))
    with pytest.raises(UsageError, match="the tokenizer has no mask token, which BART denoising needs"):
        dn.plan_denoising(no_mask, bart_config(), data_args())
    with pytest.raises(UsageError, match="--sentence_separator 'no such token' is not a token of the tokenizer"):
        dn.plan_denoising(tokenizer, bart_config(), data_args(sentence_separator="no such token"))
    with pytest.raises(UsageError, match="--max_seq_length 3 leaves fewer than 2 tokens"):
        dn.plan_denoising(tokenizer, bart_config(), data_args(max_seq_length=3))
    for rates, flag in [((1.0, 1, 3, 0), "--mlm_probability"), ((0.3, 1.5, 3, 0), "--permute_sentence_ratio"),
                        ((0.3, 1, 0, 0), "--poisson_lambda"), ((0.3, 1, float("nan"), 0), "--poisson_lambda"),
                        ((0.3, 1, float("inf"), 0), "--poisson_lambda"),
                        ((0.3, 1, 3, -0.1), "--random_token_ratio")]:
        with pytest.raises(UsageError, match=flag) as raised:
            dn.check_rates(*rates)
        assert "\n" not in str(raised.value)


def test_reconstruction_loss_counts_every_token_of_real_rows():
    vocab = 7
    labels = np.arange(15).reshape(3, 5) % vocab
    example_weight = np.array([1.0, 1.0, 0.0])  # the last row is eval padding
    right = 30.0 * np.eye(vocab, dtype=np.float32)[labels]
    wrong = 30.0 * np.eye(vocab, dtype=np.float32)[(labels + 1) % vocab]
    real = example_weight[:, None, None] == 1
    for logits, accuracy, per_token in ((np.where(real, right, wrong), 10, 0.0), (np.where(real, wrong, right), 0, 30)):
        loss, sums = dn.reconstruction_loss(logits, labels, example_weight)
        assert float(sums["tokens"]) == 10 and float(sums["accuracy"]) == accuracy
        assert float(loss) / 10 == pytest.approx(per_token, abs=1e-3)
    assert float(dn.reconstruction_loss(right, labels)[1]["tokens"]) == 15


@pytest.fixture(scope="module")
def infiller(tokenizer, tmp_path_factory):
    """The demo's predictor of a tiny random BART saved as a run of the script (max_seq_length 32)."""
    import json

    from transformers import BartConfig, FlaxBartForConditionalGeneration

    out = tmp_path_factory.mktemp("bart_dlm_demo")
    config = BartConfig(vocab_size=len(tokenizer), d_model=16, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16,
                        max_position_embeddings=32, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                        decoder_start_token_id=tokenizer.eos_token_id, forced_eos_token_id=None)
    FlaxBartForConditionalGeneration(config, seed=0).save_pretrained(out)
    tokenizer.save_pretrained(out)
    run_args = {"max_seq_length": 32, "sentence_separator": None, "poisson_lambda": 3.0}
    (out / "run_args.json").write_text(json.dumps(run_args))
    return dn.MaskInfiller(str(out), run_args)


def test_the_demo_encodes_a_text_as_the_script_does(tokenizer, infiller):
    """The demo's ids of a text are the script's example of it without noise: BOS, each sentence
    followed by the separator (EOS), EOS."""
    text = "Anna met Bob<mask> in Rome. They sang a song.\nThen it rained"
    body = dn.SentenceBlocks(tokenizer, 1, tokenizer.eos_token_id)([text])["input_ids"].reshape(1, -1)
    plan = dn.plan_denoising(tokenizer, bart_config(), data_args(mlm_probability=0.0, permute_sentence_ratio=0.0))
    plan = dn.DenoisingPlan(**{**plan.__dict__, "body_length": body.shape[1], "seq_length": body.shape[1] + 2})
    script = dn.denoising(plan, tokenizer.eos_token_id, seed=0, stream=0)({"input_ids": body}, 0, np.arange(1))
    assert infiller.encode(text) == script["input_ids"][0].tolist()
    ids = infiller.encode(text)
    assert ids.count(tokenizer.eos_token_id) == 4 and ids[0] == tokenizer.bos_token_id  # 3 sentences, then EOS
    assert tokenizer.mask_token_id in ids


def test_the_demo_cuts_the_reconstruction_after_the_inputs_sentences(tokenizer, infiller, monkeypatch):
    """The model writes each sentence then the separator (EOS): the answer is the generated text
    up to the input's last separator, the rest dropped; generation itself runs past EOS."""
    eos, bos, pad = tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.pad_token_id
    one, two, three = (tokenizer(f" {word}.", add_special_tokens=False)["input_ids"] for word in ("Ann", "Bo", "Cy"))
    fed = []

    def generate(params, ids, mask):
        fed.append(ids[0, :int(mask.sum())].tolist())
        return np.array([[eos, bos, *one, eos, *two, eos, *three, eos, eos]])

    ids = np.array([infiller.encode("Ann<mask>.")])
    raw = np.asarray(infiller._generate(infiller.params, ids, np.ones_like(ids)))
    assert eos in raw[0, 1:] and pad not in raw[0]  # this random model writes EOS; generation went on after it
    monkeypatch.setattr(infiller, "_generate", generate)
    assert infiller("Ann<mask>. Bo.").text == "Ann. Bo."
    assert fed == [infiller.encode("Ann<mask>. Bo.")]
    # Fewer separators written than the input has: up to the last.
    assert infiller("Ann sang<mask>. Then Bob came. Then it rained. Then we left.").text == "Ann. Bo. Cy."
    assert dn.reconstruction([5, 2, 6, 2, 7], 2, 1) == [5, 2] and dn.reconstruction([5, 6], 2, 1) == [5, 6]
