"""tasks/speech_recognition.py without a script: WER / CER against jiwer, the labels and the prompt
from the shipped Whisper-style tokenizer, the features of a clip against the feature extractor's own,
the clips a run keeps, and generation settings that never touch the model's own."""

import csv
import logging
import os
import wave

import numpy as np
import pytest

from tasks import audio
from tasks import speech_recognition as speech

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "speech", "tokenizer")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def extractor():
    from transformers import AutoFeatureExtractor

    return AutoFeatureExtractor.from_pretrained(TOKENIZER)


def test_wer_and_cer_equal_jiwers_over_the_corpus():
    jiwer = pytest.importorskip("jiwer")
    rng = np.random.default_rng(0)
    words = "one two three red blue cats dogs run jump a the".split()
    references, hypotheses = [], []
    for _ in range(60):
        reference = list(rng.choice(words, size=rng.integers(1, 9)))
        hypothesis = [w if rng.random() > 0.3 else rng.choice(words) for w in reference]
        if rng.random() < 0.3:
            hypothesis.insert(int(rng.integers(0, len(hypothesis) + 1)), "extra")
        if rng.random() < 0.3 and len(hypothesis) > 1:
            hypothesis.pop(0)
        references.append(" ".join(reference))
        hypotheses.append(" ".join(hypothesis) if rng.random() > 0.05 else "")
    ours = speech.recognition_metrics(references, hypotheses)
    assert ours["wer"] == pytest.approx(jiwer.wer(references, hypotheses), abs=1e-12)
    assert ours["cer"] == pytest.approx(jiwer.cer(references, hypotheses), abs=1e-12)
    # The negative control: the mean of each transcript's own rate is another number.
    per_transcript = np.mean([speech.word_error_rate([r], [h]) for r, h in zip(references, hypotheses)])
    assert abs(per_transcript - ours["wer"]) > 1e-3


def test_normalised_eval_drops_case_and_punctuation():
    assert speech.normalize_text("  Three RED cats, jump!  ") == "three red cats jump"
    metrics = speech.recognition_metrics(["Three red cats jump."], ["three red cats jump"], normalize=True)
    assert metrics == {"wer": 0.0, "cer": 0.0}
    assert speech.recognition_metrics(["Three red cats jump."], ["three red cats jump"])["wer"] == 0.5


def test_labels_follow_the_prefix_and_are_cut_to_the_label_length(tokenizer, caplog):
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    texts = ["three red cats jump", "one two three four five six seven eight nine one two three"]
    with caplog.at_level(logging.WARNING):
        encoded = speech.encode_labels(tokenizer, texts, 12, start, "train")
    first = tokenizer(texts[0])["input_ids"]
    assert first[0] == start and tokenizer.convert_ids_to_tokens(first[1:4]) == [
        "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
    length = len(first) - 1
    np.testing.assert_array_equal(encoded["labels"][0, :length], first[1:])
    np.testing.assert_array_equal(encoded["decoder_attention_mask"][0], [1] * length + [0] * (12 - length))
    np.testing.assert_array_equal(encoded["decoder_input_ids"][:, 0], [start, start])
    np.testing.assert_array_equal(encoded["decoder_input_ids"][:, 1:], encoded["labels"][:, :-1])
    np.testing.assert_array_equal(encoded["labels"][1], tokenizer(texts[1])["input_ids"][1:13])
    assert encoded["decoder_attention_mask"][1].all()
    assert "1 of 2 transcripts are longer than --max_label_length 12" in caplog.text


def test_the_prompt_is_the_tokenizers_prefix(tokenizer):
    start = tokenizer.convert_tokens_to_ids("<|startoftranscript|>")
    speech.set_prefix(tokenizer, "english", "transcribe")
    assert tokenizer.convert_ids_to_tokens(speech.prompt_ids(tokenizer, start)) == [
        "<|startoftranscript|>", "<|en|>", "<|transcribe|>", "<|notimestamps|>"]
    speech.set_prefix(tokenizer, "french", "translate")
    try:
        assert tokenizer.convert_ids_to_tokens(speech.prompt_ids(tokenizer, start)) == [
            "<|startoftranscript|>", "<|fr|>", "<|translate|>", "<|notimestamps|>"]
    finally:
        speech.set_prefix(tokenizer, "english", "transcribe")


def test_features_of_a_clip_equal_the_extractors_on_the_resampled_audio(tmp_path, extractor):
    """A 22.05 kHz clip: read, resampled to 16 kHz and run through the extractor itself."""
    rng = np.random.default_rng(1)
    samples = np.clip(rng.standard_normal(30000) * 0.2, -1, 1)
    path = tmp_path / "clip.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(22050)
        w.writeframes(np.round(samples * 32767).astype("<i2").tobytes())
    features = speech.Features(extractor)
    assert features.whisper
    resampled = audio.resample(audio.read_wav(str(path))[0], 22050, 16000)
    expected = extractor(resampled, sampling_rate=16000, return_tensors="np")["input_features"][0]
    np.testing.assert_allclose(features(str(path)), expected, rtol=0, atol=1e-5)
    column = speech.FeatureColumn([str(path)] * 3, features, workers=2)
    assert column.shape == (3, 80, 200) and column[[0, 2]].shape == (2, 80, 200)


def write_clip(path, seconds, rate=8000):
    audio.write_wav(path, 0.1 * np.sin(np.arange(int(seconds * rate)) / 3), rate)


def test_clips_too_long_too_short_or_untranscribed_are_skipped_and_counted(tmp_path, extractor, caplog):
    from utils.args import TrainingArguments

    class DataArgs:
        dataset_name = dataset_config_name = None
        train_file, validation_file, test_file = str(tmp_path / "train.csv"), None, None
        audio_column_name, text_column_name = "audio", "text"
        max_duration_in_seconds, min_duration_in_seconds = 30.0, 0.3
        max_train_samples = max_eval_samples = max_predict_samples = None
        preprocessing_num_workers, overwrite_cache = None, False

    rows = [("ok.wav", 1.0, "one red cat"), ("long.wav", 2.5, "two red cats"), ("short.wav", 0.1, "three"),
            ("silent.wav", 1.0, ""), ("ok2.wav", 1.9, "four blue dogs")]
    with open(tmp_path / "train.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["audio", "text"])
        for name, seconds, text in rows:
            write_clip(tmp_path / name, seconds)
            writer.writerow([name, text])
    training_args = TrainingArguments(output_dir=str(tmp_path / "out"), do_train=True)
    with caplog.at_level(logging.WARNING):
        clips = speech.load_clips(DataArgs(), training_args, extractor, str(tmp_path / "cache"), workers=2)
    assert clips["train"].texts == ["one red cat", "four blue dogs"]
    assert [os.path.basename(name) for name in clips["train"].shown] == ["ok.wav", "ok2.wav"]
    # --max_duration_in_seconds 30 is more than the 2-second chunk the model takes: lowered to it.
    assert "more than the 2 seconds the model takes" in caplog.text
    assert "skipped 3 of 5 clips: 1 longer than 2 s, 1 shorter than 0.3 s, 1 without a transcript" in caplog.text


def test_generation_settings_are_a_copy_the_model_never_sees():
    from transformers import FlaxWhisperForConditionalGeneration, WhisperConfig

    config = WhisperConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                           decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, num_mel_bins=80,
                           max_source_positions=100, max_target_positions=16, decoder_start_token_id=1,
                           pad_token_id=0, eos_token_id=0, bos_token_id=0, suppress_tokens=None,
                           begin_suppress_tokens=None)
    model = FlaxWhisperForConditionalGeneration(config, _do_init=False)
    before = model.generation_config.to_dict()
    settings = speech.generation_settings(model, 10, 3)
    assert (settings.max_length, settings.num_beams, settings.forced_decoder_ids) == (11, 3, None)
    assert model.generation_config.to_dict() == before
