"""tasks/audio.py: WAV files of every sample format written here (by the standard library's `wave` or
packed by hand) read back as the arrays they hold; resampling against the analytic signal; Whisper's
log-mel features against the feature extractor's own; clips of data files and datasets; bad clips."""

import io
import shutil
import os
import struct
import sys
import wave

import numpy as np
import pytest

from tasks import audio
from utils.base.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(ROOT, "data", "speech")


def pcm_wav(values, width, channels=1, rate=16000):
    """WAV bytes of integer samples `values` [frames, channels], written by the standard library's `wave`."""
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        if width == 1:
            raw = (values + 128).astype(np.uint8).tobytes()
        elif width == 3:
            raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in values.reshape(-1))
        else:
            raw = values.astype(f"<i{width}").tobytes()
        w.writeframes(raw)
    return buffer.getvalue()


def float_wav(values, width, rate=16000, extensible=False, extra_chunk=b""):
    """WAV bytes of float samples, packed by hand (the `wave` module writes PCM only); optionally as
    WAVE_FORMAT_EXTENSIBLE and with an odd-sized chunk (padded to even) before the data."""
    channels = values.shape[1]
    data = values.astype(f"<f{width}").tobytes()
    block = channels * width
    fmt = struct.pack("<HHIIHH", 0xFFFE if extensible else 3, channels, rate, rate * block, block, width * 8)
    if extensible:
        guid = struct.pack("<H", 3) + b"\x00\x00\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
        fmt += struct.pack("<HHI", 22, width * 8, 0) + guid
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if extra_chunk:
        chunks += b"LIST" + struct.pack("<I", len(extra_chunk)) + extra_chunk + b"\x00" * (len(extra_chunk) % 2)
    chunks += b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("channels", [1, 2])
def test_pcm_wav_of_every_width_reads_as_its_samples(width, channels):
    top = 2 ** (8 * width - 1)
    rng = np.random.default_rng(width)
    values = rng.integers(-top, top, size=(50, channels), dtype=np.int64)
    values[0] = -top  # the extremes: sign and scale
    values[1] = top - 1
    samples, rate = audio.read_wav(pcm_wav(values, width, channels, rate=22050))
    assert rate == 22050 and samples.dtype == np.float32 and samples.shape == (50,)
    np.testing.assert_allclose(samples, (values / top).mean(axis=1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("width", [4, 8])
@pytest.mark.parametrize("extensible", [False, True])
def test_float_wav_reads_as_its_samples(width, extensible):
    values = np.random.default_rng(width).uniform(-1, 1, size=(40, 2))
    samples, rate = audio.read_wav(float_wav(values, width, rate=8000, extensible=extensible, extra_chunk=b"odd"))
    assert rate == 8000
    np.testing.assert_allclose(samples, values.astype(f"<f{width}").mean(axis=1), rtol=0, atol=1e-7)


def test_a_file_path_reads_as_its_bytes_and_its_header_gives_the_duration(tmp_path):
    values = np.arange(-8000, 8000, 2, dtype=np.int64).reshape(-1, 1)
    path = tmp_path / "clip.wav"
    path.write_bytes(pcm_wav(values, 2, rate=4000))
    assert audio.clip_seconds(str(path)) == len(values) / 4000
    np.testing.assert_array_equal(audio.read_wav(str(path))[0], audio.read_wav(path.read_bytes())[0])


def test_write_wav_round_trips(tmp_path):
    samples = np.sin(np.linspace(0, 20, 1000)) * 0.9
    audio.write_wav(tmp_path / "w.wav", samples, 8000)
    with wave.open(str(tmp_path / "w.wav")) as w:  # the standard library reads what it writes
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (8000, 1, 2, 1000)
    # Written x 32767 and rounded, read / 32768.
    np.testing.assert_allclose(audio.read_wav(str(tmp_path / "w.wav"))[0], samples, atol=2 / 32768)


@pytest.mark.parametrize("bad, why", [(b"not a wav file at all", "not a WAV file"),
                                      (b"RIFF\x04\x00\x00\x00WAVE", "without a format chunk")])
def test_what_is_not_a_wav_file_is_an_audio_error(bad, why):
    with pytest.raises(audio.AudioError, match=why):
        audio.read_wav(bad)


@pytest.mark.parametrize("rate, target", [(22050, 16000), (8000, 16000), (48000, 16000), (16000, 16000)])
def test_resampling_gives_the_same_sine_at_the_new_rate(rate, target):
    """A 440 Hz sine sampled at `rate`, resampled, equals the sine sampled at `target` (the analytic
    reference), away from the filter's edges."""
    seconds = 0.5
    t = np.arange(int(rate * seconds)) / rate
    resampled = audio.resample(np.sin(2 * np.pi * 440 * t), rate, target)
    assert resampled.dtype == np.float32 and len(resampled) == int(target * seconds)
    expected = np.sin(2 * np.pi * 440 * np.arange(len(resampled)) / target)
    middle = slice(len(resampled) // 10, -len(resampled) // 10)
    np.testing.assert_allclose(resampled[middle], expected[middle], atol=2e-3)


@pytest.mark.parametrize("chunk_length, length", [(2, 8000), (2, 40000), (30, 16000), (30, 600000)])
def test_whisper_log_mel_equals_the_feature_extractors(chunk_length, length):
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor(chunk_length=chunk_length)
    samples = (np.random.default_rng(length).standard_normal(length) * 0.1).astype(np.float32)
    expected = extractor(samples, sampling_rate=16000, return_tensors="np")["input_features"][0]
    np.testing.assert_allclose(audio.whisper_log_mel(samples, extractor), expected, rtol=0, atol=1e-5)


def test_shipped_clips_are_8_khz_wav_with_transcripts():
    import csv

    with open(os.path.join(SHIPPED, "validation.csv"), encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 40 and all(len(row["text"].split()) == 4 for row in rows)
    samples, rate = audio.read_wav(os.path.join(SHIPPED, rows[0]["audio"]))
    assert rate == 8000 and 0.5 < len(samples) / rate < 2 and np.abs(samples).max() > 0.1


# ---------------------------------------------------------------------------------------------
# Clips of data files and datasets
# ---------------------------------------------------------------------------------------------


def test_audio_feature_bytes_and_relative_paths_are_read_without_datasets_decoding(tmp_path):
    import datasets

    clip = pcm_wav(np.arange(-100, 100, dtype=np.int64).reshape(-1, 1) * 100, 2)
    (tmp_path / "a.wav").write_bytes(clip)
    import pyarrow as pa

    # A hub dataset's Audio column as it is stored ({bytes, path}); datasets would decode (and encode) it
    # only through torchcodec, so the table is built in Arrow.
    stored = pa.array([{"bytes": clip, "path": None}], pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    decoded = datasets.Dataset(pa.table({"audio": stored}),
                               info=datasets.DatasetInfo(features=datasets.Features({"audio": datasets.Audio()})))
    sources = audio.AudioSources(decoded, "audio")  # cast to decode=False: read by tasks.audio
    assert sources[0] == clip and sources.name(0) == "row 0"
    paths = audio.AudioSources(datasets.Dataset.from_dict({"audio": ["a.wav"]}), "audio", base=str(tmp_path))
    assert paths[0] == str(tmp_path / "a.wav") and paths.name(0) == "a.wav"
    np.testing.assert_array_equal(audio.check_clips(paths, "train"), [200 / 16000])
    assert "torchcodec" not in sys.modules and "torch" not in sys.modules


def test_a_missing_or_unreadable_clip_is_one_error_naming_it(tmp_path):
    import datasets

    (tmp_path / "text.wav").write_text("hello, I am no audio")
    (tmp_path / "empty.wav").write_bytes(b"")
    (tmp_path / "silent.wav").write_bytes(pcm_wav(np.zeros((0, 1), np.int64), 2))
    (tmp_path / "nan.wav").write_bytes(float_wav(np.array([[0.1], [np.nan], [0.2]]), 4))
    for name, message in (("absent.wav", "absent.wav of the train data \\(row 0\\) not found"),
                          ("text.wav", "audio text.wav of the train data \\(row 0\\) cannot be read: not a WAV"),
                          ("empty.wav", "empty.wav of the train data \\(row 0\\) cannot be read: an empty file"),
                          ("silent.wav", "silent.wav of the train data \\(row 0\\) cannot be read: it holds no samples"),
                          ("nan.wav", "nan.wav of the train data \\(row 0\\) cannot be read: it holds samples that are "
                                      "not finite numbers")):
        sources = audio.AudioSources(datasets.Dataset.from_dict({"audio": [name]}), "audio", base=str(tmp_path))
        with pytest.raises(UsageError, match=message):
            audio.check_clips(sources, "train")


def test_a_column_of_numbers_is_no_audio_column():
    import datasets

    with pytest.raises(UsageError, match="neither audio nor paths"):
        audio.AudioSources(datasets.Dataset.from_dict({"audio": [1, 2]}), "audio")


# ---------------------------------------------------------------------------------------------
# The data generator (Debian's espeak-ng: installed by .ci/run; outside CI the test skips without it)
# ---------------------------------------------------------------------------------------------
ESPEAK = shutil.which("espeak-ng")
if ESPEAK is None and os.environ.get("CI"):
    raise RuntimeError("CI must run the speech data generator's test, but espeak-ng is missing (apt-get install "
                       "espeak-ng)")


@pytest.mark.skipif(ESPEAK is None, reason="the speech data generator needs espeak-ng (apt-get install espeak-ng)")
def test_the_data_generator_speaks_unseen_sentences_with_transcripts(tmp_path):
    import csv

    from transformers import AutoFeatureExtractor, AutoTokenizer

    sys.path.insert(0, os.path.join(ROOT, "data"))
    import make_speech_data

    make_speech_data.main(["--train_size", "6", "--validation_size", "4", "--test_size", "4", "--output_dir",
                           str(tmp_path)])
    texts = {}
    for split, size in (("train", 6), ("validation", 4), ("test", 4)):
        with open(tmp_path / f"{split}.csv", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == size
        texts[split] = {row["text"] for row in rows}
        samples, rate = audio.read_wav(str(tmp_path / rows[0]["audio"]))
        assert rate == 8000 and 0.5 < len(samples) / rate < 2.5 and np.abs(samples).max() > 0.05
    assert not texts["train"] & texts["validation"] and not texts["validation"] & texts["test"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tokenizer")
    assert tokenizer.convert_tokens_to_ids("<|en|>") == tokenizer.convert_tokens_to_ids("<|startoftranscript|>") + 1
    assert AutoFeatureExtractor.from_pretrained(tmp_path / "tokenizer").nb_max_frames == 200
