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
    from utils.base.arguments import TrainingArguments

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
    # The shortest clip the model hears (`shortest_heard`) raises the floor, with the same count
    clips = speech.load_clips(DataArgs(), training_args, extractor, str(tmp_path / "cache"), workers=2,
                              shortest_model_clip=1.5)
    assert clips["train"].texts == ["four blue dogs"]
    assert "skipped 4 of 5 clips: 1 longer than 2 s, 3 shorter than 1.5 s, 0 without a transcript" in caplog.text


@pytest.mark.parametrize("name", ["wav2vec2_tiny", "wav2vec2"])
def test_the_shortest_clip_heard_is_one_frame_of_the_encoders_own_count(name):
    """A clip shorter than one frame of a waveform encoder gives it nothing to attend to (a nan loss):
    it is skipped as too short. transformers' own frame count is the reference; Whisper hears any clip."""
    from transformers import AutoConfig, SpeechEncoderDecoderConfig, WhisperConfig
    from transformers.models.wav2vec2.modeling_flax_wav2vec2 import FlaxWav2Vec2Module

    config = AutoConfig.from_pretrained(os.path.join(ROOT, "data", "speech", name))
    samples = round(speech.shortest_heard(config, 16000) * 16000)
    frames = FlaxWav2Vec2Module(config)._get_feat_extract_output_lengths
    assert (frames(samples), frames(samples - 1)) == (1, 0)
    joined = SpeechEncoderDecoderConfig.from_encoder_decoder_configs(config, AutoConfig.for_model("gpt2"))
    assert speech.shortest_heard(joined, 8000) == samples / 8000
    assert speech.shortest_heard(WhisperConfig(), 16000) == 0


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


# ----------------------------------------------------------------------------------------------
# The speech encoder-decoder (wav2vec2 + a decoder with cross-attention)
# ----------------------------------------------------------------------------------------------
WAV2VEC2 = os.path.join(ROOT, "data", "speech", "wav2vec2")


@pytest.fixture(scope="module")
def waveform_extractor():
    from transformers import AutoFeatureExtractor

    return AutoFeatureExtractor.from_pretrained(WAV2VEC2)


def joined_arguments(decoder="gpt2", **flags):
    from run_speech_recognition_seq2seq import SpeechModelArguments

    overrides = {"gpt2": "n_embd=32,n_layer=1,n_head=2,n_positions=16",
                 "bert": "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=64"}
    return SpeechModelArguments(encoder_config_name=WAV2VEC2, decoder_model_type=decoder,
                                decoder_config_overrides=overrides.get(decoder), tokenizer_name=TOKENIZER, **flags)


def test_waveform_features_are_the_extractors_own_padded_with_their_mask(tmp_path, waveform_extractor):
    """Two 22.05 kHz clips: read, resampled to 16 kHz, normalised over their own samples, padded to
    --max_duration_in_seconds; the mask made from the clips' durations alone marks those samples."""
    rng = np.random.default_rng(2)
    paths, resampled = [], []
    for i, frames in enumerate((28665, 11025)):  # 1.3 s and 0.5 s
        path = str(tmp_path / f"clip{i}.wav")
        audio.write_wav(path, np.clip(rng.standard_normal(frames) * 0.2 + 0.05, -1, 1), 22050)
        paths.append(path)
        resampled.append(audio.resample(audio.read_wav(path)[0], 22050, 16000))
    features = speech.Features(waveform_extractor, 2.0)
    assert features.raw and features.shape == (32000,) and features.extra_inputs == ("attention_mask",)
    own = waveform_extractor(resampled, sampling_rate=16000, padding="max_length", max_length=32000,
                             return_attention_mask=True, return_tensors="np")
    column = speech.FeatureColumn(paths, features, workers=2)
    np.testing.assert_allclose(column[[0, 1]], own["input_values"], rtol=0, atol=1e-6)
    for values, clip in zip(column[[0, 1]], resampled):  # the reference computed here
        expected = np.zeros(32000)
        expected[:len(clip)] = (clip - clip.mean()) / np.sqrt(clip.var() + 1e-7)
        np.testing.assert_allclose(values, expected, rtol=0, atol=1e-4)
    clips = speech.Clips(paths, ["a", "b"], paths, np.array([audio.clip_seconds(p) for p in paths]))
    mask = features.mask_columns(clips)["attention_mask"]
    np.testing.assert_array_equal(mask[[0, 1]], own["attention_mask"])
    assert mask[[0, 1]].sum(axis=1).tolist() == [len(clip) for clip in resampled]
    # --feature_extractor_name unset: a speech encoder-decoder's is its encoder's (here the folder of its config)
    from utils.models.loading import arguments_of

    assert speech.Features(speech.load_feature_extractor(arguments_of(joined_arguments(), "encoder")), 2.0).raw


def test_encoder_decoder_labels_carry_no_prefix_and_end_with_the_end_token(tokenizer, waveform_extractor, caplog):
    config = speech.load_speech_config(joined_arguments(), waveform_extractor, tokenizer, True)
    end = speech.end_token(config)
    assert end == tokenizer.eos_token_id and config.decoder_start_token_id == tokenizer.bos_token_id
    texts = ["three red cats jump", "one two three four five six seven eight nine one two three"]
    with caplog.at_level(logging.WARNING):
        encoded = speech.encode_labels(tokenizer, texts, 8, config.decoder_start_token_id, "train", end)
    first = tokenizer(texts[0], add_special_tokens=False)["input_ids"] + [end]
    assert not set(first[:-1]) & set(tokenizer.all_special_ids)  # no <|startoftranscript|><|en|>...
    np.testing.assert_array_equal(encoded["labels"][0, :len(first)], first)
    np.testing.assert_array_equal(encoded["decoder_attention_mask"][0], [1] * len(first) + [0] * (8 - len(first)))
    np.testing.assert_array_equal(encoded["decoder_input_ids"][:, 0], [config.decoder_start_token_id] * 2)
    np.testing.assert_array_equal(encoded["decoder_input_ids"][:, 1:], encoded["labels"][:, :-1])
    np.testing.assert_array_equal(encoded["labels"][1], tokenizer(texts[1], add_special_tokens=False)["input_ids"][:8])
    assert "1 of 2 transcripts are longer than --max_label_length 8" in caplog.text
    assert speech.prompt_of(tokenizer, config).tolist() == [config.decoder_start_token_id]
    assert speech.label_length(40, config) == 15  # the decoder's 16 positions hold the start token and 15 labels


def test_only_the_decoders_it_can_generate_with_are_joined(tokenizer, waveform_extractor):
    from utils.base.errors import UsageError

    config = speech.load_speech_config(joined_arguments("bert"), waveform_extractor, tokenizer, True)
    assert config.decoder.is_decoder and config.decoder.add_cross_attention
    assert config.decoder.vocab_size == len(tokenizer)
    with pytest.raises(UsageError, match="model type 't5' cannot be trained by this script: use one of gpt2, bart, "
                                         "bert, roberta"):
        speech.load_speech_config(joined_arguments("t5"), waveform_extractor, tokenizer, True)
    with pytest.raises(UsageError, match="hears the waveform, but the feature extractor WhisperFeatureExtractor"):
        speech.load_speech_config(joined_arguments(), speech.load_feature_extractor(
            joined_arguments(feature_extractor_name=TOKENIZER)), tokenizer, True)


def test_the_frame_mask_counts_the_frames_the_encoder_makes_of_each_clip(tokenizer, waveform_extractor, monkeypatch):
    """The convolutions' output lengths computed here in plain Python, the encoder's own output length
    for a clip alone, and the mask and the encoder's states handed to generation. The model's weights are
    drawn and its encoder run as compiled programs (`init_in_one_program`, a jit), not op by op."""
    import jax
    from transformers import FlaxSpeechEncoderDecoderModel

    from utils.models.loading import init_in_one_program

    config = speech.load_speech_config(joined_arguments(), waveform_extractor, tokenizer, True)
    # A smaller encoder than the shipped one (3 convolutions, 1 layer): the same code, compiled faster.
    encoder = config.encoder
    encoder.conv_dim, encoder.conv_kernel, encoder.conv_stride = (16, 16, 16), (10, 4, 3), (5, 3, 2)
    encoder.num_feat_extract_layers, encoder.num_hidden_layers = 3, 1
    with init_in_one_program(FlaxSpeechEncoderDecoderModel):
        model = FlaxSpeechEncoderDecoderModel(config, input_shape=((1, 1024), (1, 8)), seed=0)
    lengths = [6000, 4321, 1500]
    mask = np.zeros((3, 6000), np.int32)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1

    def frames(n):
        for kernel, stride in zip(config.encoder.conv_kernel, config.encoder.conv_stride):
            n = (n - kernel) // stride + 1
        return n

    frame_mask = np.asarray(speech.frame_mask(model, mask, frames(6000)))
    assert frame_mask.sum(axis=1).tolist() == [frames(n) for n in lengths] == [199, 143, 49]
    assert (np.diff(frame_mask, axis=1) <= 0).all()  # each clip's frames first
    clip = jax.ShapeDtypeStruct((1, 4321), np.float32)
    assert jax.eval_shape(lambda clip: model.encode(clip).last_hidden_state, clip).shape[1] == frames(4321)
    # Generation: the encoder's states and this frame mask go to `generate` (which would otherwise hand the
    # cross-attention the sample mask: tests/test_run_speech_encoder_decoder.py generates for real).
    from transformers.generation.flax_utils import FlaxGenerationMixin

    def generate(model, inputs, **kwargs):  # hands back what it was given
        given = (kwargs["attention_mask"], kwargs["encoder_outputs"].last_hidden_state, kwargs["decoder_input_ids"])
        return type("Output", (), {"sequences": given})

    monkeypatch.setattr(FlaxGenerationMixin, "generate", generate)
    inputs = np.random.default_rng(3).standard_normal((3, 6000)).astype(np.float32) * mask
    prompt, settings = speech.prompt_of(tokenizer, config), speech.generation_settings(model, 8, 1)
    seen_mask, states, decoder_input_ids = jax.jit(
        lambda params, inputs, mask: speech.generate_ids(model, params, inputs, prompt, settings, mask))(
        model.params, inputs, mask)
    np.testing.assert_array_equal(seen_mask, frame_mask)
    assert states.shape[:2] == (3, frames(6000))
    np.testing.assert_array_equal(decoder_input_ids, [[config.decoder_start_token_id]] * 3)


def test_a_wav2vec2_pretraining_export_is_the_encoder_it_fine_tunes(tmp_path, tokenizer, waveform_extractor, caplog):
    """What run_wav2vec2_pretrain_flax.py saves (a FlaxWav2Vec2ForPreTraining of the shipped filterbank
    encoder, its codebooks beside it) as --encoder_model_name_or_path: the joined model's encoder is the
    export's `wav2vec2` weights, none left fresh; the codebooks stay behind (the README's transfer row)."""
    from flax.traverse_util import flatten_dict
    from transformers import (AutoConfig, FlaxAutoModel, FlaxAutoModelForCausalLM, FlaxSpeechEncoderDecoderModel,
                              FlaxWav2Vec2ForPreTraining)

    from utils.layout.layouts import make_layout
    from utils.models.loading import load_composed_model, pretrained_part

    pretraining = AutoConfig.from_pretrained(WAV2VEC2, codevector_dim=16, proj_codevector_dim=16,
                                             num_codevectors_per_group=8)
    export = FlaxWav2Vec2ForPreTraining(pretraining, input_shape=(1, 4000), seed=5)
    export.save_pretrained(tmp_path / "export")
    args = joined_arguments(encoder_model_name_or_path=str(tmp_path / "export"))
    config = speech.load_speech_config(args, waveform_extractor, tokenizer, True)
    parts = {"encoder": (FlaxAutoModel, pretrained_part(args, "encoder")),
             "decoder": (FlaxAutoModelForCausalLM, pretrained_part(args, "decoder"))}
    with caplog.at_level(logging.WARNING):
        _, params = load_composed_model(FlaxSpeechEncoderDecoderModel, config, args, parts, 0, make_layout("dp"))
    assert "the encoder" not in caplog.text  # no encoder weight initialised fresh
    encoder, saved = flatten_dict(params["encoder"]), flatten_dict(export.params["wav2vec2"])
    assert set(encoder) == set(saved)
    for key, value in saved.items():
        np.testing.assert_array_equal(encoder[key], value)
