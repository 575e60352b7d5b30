"""tasks/wav2vec2_pretraining.py without a script: the contrastive and diversity losses against plain
NumPy, the Gumbel schedule, masks and negatives as pure functions of (seed, step, row), separate
dropout and Gumbel keys, the waveforms of a clip against the feature extractor's own, and the
perplexity watch."""

import logging
import os

import jax
import numpy as np
import pytest
from transformers import Wav2Vec2Config

from tasks import audio
from tasks import wav2vec2_pretraining as w2v

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "data", "speech", "wav2vec2_tiny")


@pytest.fixture(scope="module")
def config():
    return Wav2Vec2Config.from_pretrained(TINY)


def numpy_contrastive(projected, quantized, mask, negatives, temperature):
    """The wav2vec 2.0 contrastive loss, one masked frame at a time: cosine similarity of the frame's
    output with its quantized target and its negatives, over the temperature; a negative equal to the
    target left out; -log softmax of the target; the mean over the masked frames."""
    losses = []
    for b, t in zip(*np.nonzero(mask)):
        candidates = [quantized[b, t]] + [quantized[b, n] for n in negatives[b, t]
                                          if not np.array_equal(quantized[b, n], quantized[b, t])]
        cosines = [projected[b, t] @ c / max(np.linalg.norm(projected[b, t]) * np.linalg.norm(c), 1e-8)
                   for c in candidates]
        logits = np.array(cosines, np.float64) / temperature
        losses.append(np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[0])
    return np.mean(losses), len(losses)


def batch(seed=0, rows=3, frames=12, dim=8, negatives=5):
    rng = np.random.default_rng(seed)
    projected = rng.standard_normal((rows, frames, dim)).astype(np.float32)
    quantized = rng.standard_normal((rows, frames, dim)).astype(np.float32)
    quantized[1, 4] = quantized[1, 2]  # a negative that is the positive itself: left out of the softmax
    mask = rng.random((rows, frames)) < 0.5
    mask[1, [2, 4]] = True
    index = rng.integers(0, frames, (rows, frames, negatives)).astype(np.int32)
    index[1, 2, 0] = 4
    return projected, quantized, mask, index


def test_the_loss_is_the_numpy_contrastive_mean_plus_the_weighted_diversity(config):
    projected, quantized, mask, negatives = batch()
    perplexity, weight = 40.0, 0.1
    loss, sums = w2v.pretraining_loss(projected, quantized, perplexity, mask, negatives, config, weight)
    contrastive, count = numpy_contrastive(projected, quantized, mask, negatives, config.contrastive_logits_temperature)
    diversity = (64 - perplexity) / 64  # 2 groups x 32 codevectors
    assert sums["tokens"] == count == mask.sum()
    # The spine divides every sum by the masked frames ("tokens") of the global batch.
    np.testing.assert_allclose(loss / sums["tokens"], contrastive + weight * diversity, rtol=1e-5)
    np.testing.assert_allclose(sums["contrastive_loss"] / count, contrastive, rtol=1e-5)
    np.testing.assert_allclose(sums["diversity_loss"] / count, diversity, rtol=1e-6)
    np.testing.assert_allclose(sums["codevector_perplexity"] / count, perplexity, rtol=1e-6)
    # The classic script's loss, a sum never divided, is not that mean: the test tells them apart.
    assert abs(float(sums["contrastive_loss"]) - contrastive) > 1.0


def test_a_negative_equal_to_the_positive_is_left_out(config):
    projected, quantized, mask, negatives = batch()
    only = np.zeros_like(mask)
    only[1, 2] = True
    with_itself, _ = w2v.contrastive_sums(projected, quantized, only, negatives, 0.1)
    without, _ = w2v.contrastive_sums(projected, quantized, only, np.where(negatives == 4, 5, negatives), 0.1)
    expected, _ = numpy_contrastive(projected, quantized, only, negatives, 0.1)
    np.testing.assert_allclose(with_itself, expected, rtol=1e-5)
    assert not np.isclose(with_itself, without)


def test_padded_rows_and_a_batch_of_padding_add_nothing(config):
    projected, quantized, mask, negatives = batch()
    weights = np.array([1, 0, 1], np.float32)
    scored = np.asarray(w2v.scored_mask({"mask_time_indices": mask, "example_weight": weights}))
    assert not scored[1].any() and (scored[[0, 2]] == mask[[0, 2]]).all()
    loss, sums = w2v.pretraining_loss(projected, quantized, np.nan, np.zeros_like(mask), negatives, config, 0.1)
    assert sums["tokens"] == 0 and loss == 0 and sums["codevector_perplexity"] == 0  # the model's 0 / 0 is dropped


def test_diversity_loss_is_zero_for_an_even_codebook_and_near_one_for_a_collapsed_one(config):
    assert w2v.diversity_loss(64.0, config) == 0.0
    np.testing.assert_allclose(w2v.diversity_loss(2.0, config), 62 / 64)


def test_the_gumbel_temperature_decays_to_its_floor():
    steps = np.arange(0, 2000, 7)
    expected = np.maximum(2.0 * 0.999 ** steps, 0.5)
    np.testing.assert_allclose([w2v.gumbel_temperature(int(s), 2.0, 0.5, 0.999) for s in steps], expected)
    assert w2v.gumbel_temperature(0, 2.0, 0.5, 0.999) == 2.0 and w2v.gumbel_temperature(10**6, 2.0, 0.5, 0.999) == 0.5


def masked_batch(config, lengths, seconds=2.0):
    samples = int(seconds * 16000)
    attention = (np.arange(samples)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
    return {"input_values": np.zeros(attention.shape, np.float32), "attention_mask": attention}


def test_masks_and_negatives_are_a_pure_function_of_seed_step_and_row(config):
    masking = w2v.Masking(config, seed=42, temperatures=(2.0, 0.5, 0.995))
    lengths = [32000, 20000, 9000, 32000]
    rows = np.arange(4)
    first = masking(masked_batch(config, lengths), 7, rows)
    again = masking(masked_batch(config, lengths), 7, rows)
    for name in ("mask_time_indices", "negatives", "gumbel_temperature"):
        np.testing.assert_array_equal(first[name], again[name])
    # A row's draw depends on its row of the global batch, not on which process or slice holds it.
    alone = masking(masked_batch(config, lengths[2:3]), 7, rows[2:3])
    np.testing.assert_array_equal(alone["mask_time_indices"][0], first["mask_time_indices"][2])
    later = masking(masked_batch(config, lengths), 8, rows)
    assert (later["mask_time_indices"] != first["mask_time_indices"]).any()
    assert later["gumbel_temperature"][0] == pytest.approx(2.0 * 0.995 ** 8)
    evaluation = w2v.Masking(config, seed=42)(masked_batch(config, lengths), 7, rows)
    assert "gumbel_temperature" not in evaluation
    assert (evaluation["mask_time_indices"] != first["mask_time_indices"]).any()


def test_masks_stay_in_the_real_frames_and_negatives_are_other_masked_frames(config):
    lengths = [32000, 20000, 9000]
    out = w2v.Masking(config, seed=0)(masked_batch(config, lengths), 0, np.arange(3))
    mask, negatives = out["mask_time_indices"], out["negatives"]
    frames = w2v.frame_lengths(config, np.array(lengths))
    assert mask.shape == (3, w2v.frame_lengths(config, 32000)) and negatives.shape == (*mask.shape, config.num_negatives)
    for row, length in enumerate(frames):
        positions = np.flatnonzero(mask[row])
        assert positions.max() < length and len(positions) >= config.mask_time_length
        # about mask_time_prob of the frames are masked (overlapping spans mask fewer)
        assert 0.2 * length <= len(positions) <= config.mask_time_prob * length + 2 * config.mask_time_length
        drawn = negatives[row, positions]
        assert mask[row][drawn].all() and (drawn != positions[:, None]).all()
        assert set(np.unique(drawn)) == set(positions)  # uniform over the others: every one drawn here


def test_dropout_and_gumbel_keys_differ_and_follow_the_step_key():
    key = jax.random.PRNGKey(3)
    dropout, gumbel = w2v.step_keys(key)
    assert not np.array_equal(jax.random.key_data(dropout), jax.random.key_data(gumbel))
    assert not np.array_equal(jax.random.key_data(dropout), jax.random.key_data(key))
    np.testing.assert_array_equal(jax.random.key_data(w2v.step_keys(key)[1]), jax.random.key_data(gumbel))
    other = w2v.step_keys(jax.random.PRNGKey(4))
    assert not np.array_equal(jax.random.key_data(other[1]), jax.random.key_data(gumbel))


def test_waveforms_are_the_extractors_normalised_samples_padded(tmp_path):
    from transformers import AutoFeatureExtractor

    extractor = AutoFeatureExtractor.from_pretrained(TINY)
    rng = np.random.default_rng(1)
    path = str(tmp_path / "clip.wav")
    audio.write_wav(path, np.clip(rng.standard_normal(6000) * 0.2, -1, 1), 8000)
    length = w2v.padded_samples(1.0, 16000, pad_to_multiple_of=320)
    assert length == 16000 and w2v.padded_samples(1.01, 16000, 320) == 16320
    out = w2v.Waveforms(extractor, length)(path)
    samples = audio.resample(audio.read_wav(path)[0], 8000, 16000)
    assert out["attention_mask"].sum() == len(samples) == 12000
    real = out["input_values"][:12000]
    np.testing.assert_allclose(real, (samples - samples.mean()) / np.sqrt(samples.var() + 1e-7), atol=1e-4)
    assert (out["input_values"][12000:] == 0).all()


def test_the_watch_warns_once_when_the_perplexity_collapses(config, caplog):
    watch = w2v.PerplexityWatch(config)
    assert watch.floor == pytest.approx(6.4)  # 10 % of 64 codevectors (2 groups: floor 2)
    with caplog.at_level(logging.WARNING, logger=w2v.__name__):
        assert not watch.check(30.0, "training", 10)
        assert watch.check(3.0, "training", 20) and watch.check(2.5, "training", 30)
    warnings = [r.getMessage() for r in caplog.records if "collapsed" in r.getMessage()]
    assert len(warnings) == 1 and "perplexity 3.00 at step 20" in warnings[0]


def test_the_saved_pretraining_model_is_this_task():
    import tasks

    assert tasks.task_of("FlaxWav2Vec2ForPreTraining", {}) == "wav2vec2-pretraining"
    assert tasks.module_of("wav2vec2-pretraining") is w2v
    assert tasks.task_of("FlaxBertForPreTraining", {}) is None  # no script here pretrains BERT so


def test_eval_columns_of_dict_features_compute_each_batch_once():
    """The samples and the attention mask of an eval batch come from one computation per clip."""
    from tasks import speech_recognition as speech

    calls = []

    class Fake:
        shapes = {"input_values": (3,), "attention_mask": (3,)}

        def __call__(self, source):
            calls.append(source)
            return {"input_values": np.full(3, source, np.float32), "attention_mask": np.ones(3, np.int32)}

    parts = speech.FeatureColumn([5, 6, 7], Fake(), workers=1).parts()
    assert parts["input_values"].shape == (3, 3) and len(parts["attention_mask"]) == 3
    batch = {name: column[np.array([2, 0])] for name, column in parts.items()}
    np.testing.assert_array_equal(batch["input_values"][:, 0], [7, 5])
    assert batch["attention_mask"].shape == (2, 3) and calls == [7, 5]
