"""Audio for the speech tasks, without torch, torchaudio, torchcodec or FFmpeg: read clips, resample
them, find them in data files and datasets, measure and check them.

- read: `read_wav` parses RIFF/WAVE with the standard library and NumPy: 8-bit unsigned, 16-, 24-
  and 32-bit signed PCM, 32- and 64-bit float, WAVE_FORMAT_EXTENSIBLE too; channels are averaged
  to mono, samples scaled to [-1, 1]. FLAC, OGG and the rest are read only where the optional
  `soundfile` package is installed (`read_audio`).
- resample: `resample` is SciPy's polyphase filter (`scipy.signal.resample_poly`, a Kaiser-windowed
  FIR), from the clip's rate to the feature extractor's.
- find: `AudioSources` are the clips of a `datasets` column: paths (relative to the data file's
  folder) or the project's own decoding of an `Audio` feature's bytes (cast to `decode=False`:
  `datasets` itself decodes audio only through torchcodec).
- measure and check: `clip_seconds` reads a WAV's duration from its header alone; `check_clips`
  reads every clip's duration once (and a float WAV's samples, which may be NaN), before any work, so
  a file that is not audio, is empty or holds no numbers stops the run at its start with its name.
"""

import io
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from math import gcd

import numpy as np

from utils.base.errors import UsageError
from utils.data import file_formats, loaders
from utils.run.preflight import needed_splits
from utils.run.threaded_feed import default_workers

WAVE_PCM, WAVE_FLOAT, WAVE_EXTENSIBLE = 1, 3, 0xFFFE
PCM_SCALE = {1: 128.0, 2: 32768.0, 3: 8388608.0, 4: 2147483648.0}  # 2 ** (bits - 1) per sample width
FLOAT_TYPES = {4: "<f4", 8: "<f8"}
FILE_FORMATS = ("json", "csv")  # the data files that name the clips


class AudioError(ValueError):
    """A clip that cannot be read: not audio, a format without a reader here, or a broken file."""


# ---------------------------------------------------------------------------------------------
# Columns
# ---------------------------------------------------------------------------------------------
def resolve_columns(data_args, columns, transcribed=True):
    """(audio column, text column); both must be in every split ({split: column names}). Not
    `transcribed` (wav2vec2 pretraining): the audio column alone, the text column None."""
    needed = [("audio_column_name", data_args.audio_column_name)]
    if transcribed:
        needed.append(("text_column_name", data_args.text_column_name))
    file_formats.require_columns(columns, needed)
    return data_args.audio_column_name, data_args.text_column_name if transcribed else None


def check_columns(columns, model_args, data_args, training_args, transcribed=True):
    """A missing audio column (or transcript column, when `transcribed`) in a local file a phase reads fails
    before any work (a hub dataset's once loaded)."""
    phases = needed_splits(training_args)
    resolve_columns(data_args, {split: names for split, names in columns.items() if split in phases}, transcribed)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _opened(source):
    """`source` (a path or the bytes of an encoded clip) as a binary file object."""
    return io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else open(source, "rb")


class WavHeader:
    """The format of a WAV file and where its samples are: `encoding` ("pcm" or "float"),
    `channels`, `rate`, `width` (bytes per sample), `data_offset`, `frames`."""

    def __init__(self, f):
        riff = f.read(12)
        if len(riff) < 12 or riff[:4] != b"RIFF" or riff[8:12] != b"WAVE":
            raise AudioError("not a WAV file (no RIFF/WAVE header)")
        fmt, data = None, None
        while data is None:
            chunk = f.read(8)
            if len(chunk) < 8:
                break
            name, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if name == b"fmt ":
                fmt = f.read(size)
                if size % 2:
                    f.read(1)
            elif name == b"data":
                data = (f.tell(), size)
            else:
                f.seek(size + size % 2, io.SEEK_CUR)  # chunks are padded to an even size
        if fmt is None or len(fmt) < 16:
            raise AudioError("a WAV file without a format chunk")
        if data is None:
            raise AudioError("a WAV file without a data chunk")
        tag, self.channels, self.rate, _, block, bits = struct.unpack("<HHIIHH", fmt[:16])
        if tag == WAVE_EXTENSIBLE and len(fmt) >= 26:
            tag = struct.unpack("<H", fmt[24:26])[0]  # the sub-format GUID starts with the format tag
        self.width = (bits + 7) // 8
        if tag == WAVE_PCM and self.width in PCM_SCALE:
            self.encoding = "pcm"
        elif tag == WAVE_FLOAT and self.width in FLOAT_TYPES:
            self.encoding = "float"
        else:
            raise AudioError(f"a WAV file of format {tag} with {bits}-bit samples: only PCM (8, 16, 24, 32 bits) "
                             "and float (32, 64 bits) WAV are read")
        if self.channels < 1 or self.rate < 1 or block != self.channels * self.width:
            raise AudioError(f"a WAV file with a broken format chunk ({self.channels} channels, {self.rate} Hz, "
                             f"{block}-byte frames)")
        self.data_offset = data[0]
        # A streamed WAV may leave the data size unset (0xFFFFFFFF): what the file holds counts.
        end = f.seek(0, io.SEEK_END)
        self.frames = min(data[1], end - data[0]) // block

    @property
    def seconds(self):
        return self.frames / self.rate


def _decode_samples(raw, header):
    """float32 [frames, channels] in [-1, 1] from the data chunk's bytes."""
    width = header.width
    if header.encoding == "float":
        values = np.frombuffer(raw, FLOAT_TYPES[width]).astype(np.float32)
    elif width == 1:
        values = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / PCM_SCALE[1]
    elif width == 3:
        # Little-endian 24-bit: put each sample in the top three bytes of an int32, then shift back (sign kept).
        triples = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        padded = np.zeros((len(triples), 4), np.uint8)
        padded[:, 1:] = triples
        values = (padded.view("<i4").reshape(-1) >> 8).astype(np.float32) / PCM_SCALE[3]
    else:
        values = np.frombuffer(raw, f"<i{width}").astype(np.float32) / PCM_SCALE[width]
    return values.reshape(-1, header.channels)


def read_wav(source):
    """(float32 mono samples in [-1, 1], sample rate) of the WAV file at `source` (a path or bytes)."""
    with _opened(source) as f:
        header = WavHeader(f)
        f.seek(header.data_offset)
        raw = f.read(header.frames * header.channels * header.width)
    return _decode_samples(raw, header).mean(axis=1), header.rate


def _is_wav(source):
    with _opened(source) as f:
        start = f.read(12)
    return start[:4] == b"RIFF" and start[8:12] == b"WAVE"


def _soundfile():
    try:
        import soundfile
    except ImportError:  # optional: FLAC / OGG / ... need it, WAV does not
        return None
    return soundfile


def read_audio(source):
    """(float32 mono samples, sample rate) of a clip: WAV here; FLAC, OGG, ... through the optional
    `soundfile` package. AudioError when it cannot be read."""
    if _is_wav(source):
        return read_wav(source)
    with _opened(source) as f:
        if not f.read(1):
            raise AudioError("an empty file (0 bytes)")
    soundfile = _soundfile()
    if soundfile is None:
        raise AudioError("not a WAV file; FLAC, OGG and other formats are read only with the optional soundfile "
                         "package (pip install soundfile)")
    try:
        with _opened(source) as f:
            samples, rate = soundfile.read(f, dtype="float32", always_2d=True)
    except (RuntimeError, soundfile.LibsndfileError) as e:
        raise AudioError(f"not audio soundfile can read ({e})") from e
    return samples.mean(axis=1), rate


def clip_seconds(source):
    """The duration of a clip in seconds: read from a WAV's header alone; other formats are decoded."""
    if _is_wav(source):
        with _opened(source) as f:
            return WavHeader(f).seconds
    samples, rate = read_audio(source)
    return len(samples) / rate


def non_finite_float_wav(source):
    """Whether `source` is a float WAV holding NaN or infinite samples (a PCM clip cannot): its samples
    are read, so only float clips pay for the check."""
    if not _is_wav(source):
        return False
    with _opened(source) as f:
        if WavHeader(f).encoding != "float":
            return False
    return not np.isfinite(read_wav(source)[0]).all()


def write_wav(path, samples, rate):
    """`samples` (float, mono, in [-1, 1]) as a 16-bit PCM WAV file (the data generator's)."""
    pcm = np.clip(np.round(np.asarray(samples, np.float64) * 32767), -32768, 32767).astype("<i2")
    fmt = struct.pack("<HHIIHH", WAVE_PCM, 1, rate, rate * 2, 2, 16)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", pcm.nbytes)
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", len(body) + pcm.nbytes) + body + pcm.tobytes())


# ---------------------------------------------------------------------------------------------
# Resampling
# ---------------------------------------------------------------------------------------------


def resample(samples, rate, target_rate):
    """`samples` at `rate` Hz resampled to `target_rate` Hz (float32): SciPy's polyphase filter with
    the smallest up / down factors. A clip already at the target rate is returned as it is."""
    if rate == target_rate:
        return np.asarray(samples, np.float32)
    from scipy.signal import resample_poly

    common = gcd(int(rate), int(target_rate))
    return resample_poly(samples, target_rate // common, rate // common).astype(np.float32)


def load(source, target_rate):
    """The clip at `source` as float32 mono samples at `target_rate` Hz."""
    samples, rate = read_audio(source)
    return resample(samples, rate, target_rate)


# ---------------------------------------------------------------------------------------------
# Clips of a dataset column
# ---------------------------------------------------------------------------------------------


class AudioSources:
    """The clips of a `datasets` column as `read_audio` sources, without decoding them up front:
    `sources[i]` is the encoded bytes of row i, or its file's path (a string column of paths is read
    relative to `base`, the data file's folder; `split` names the data in errors). `select(rows)` keeps
    those rows."""

    def __init__(self, dataset, column, base=None, split="train"):
        import datasets

        feature = dataset.features[column]
        if isinstance(feature, datasets.Audio):
            dataset = dataset.cast_column(column, datasets.Audio(decode=False))
        elif loaders.holds_mixed_values(feature):  # paths mixed with other values: name the first non-path
            row, value = next((row, value) for row, value in enumerate(dataset[column])
                              if not isinstance(value, (str, type(None))))
            raise UsageError(f"row {row} of the {split} data holds {str(value)[:60]} in column {column!r}, not a path "
                             "to an audio file: fix the row")
        elif not (isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")):
            raise UsageError(f"column {column!r} holds {feature}, neither audio nor paths to audio files: name the "
                             "audio column with --audio_column_name")
        self.dataset, self.column, self.base, self.split = dataset, column, base, split

    def __len__(self):
        return len(self.dataset)

    def select(self, rows):
        return AudioSources(self.dataset.select(rows), self.column, self.base, self.split)

    def __getitem__(self, key):
        value = self.dataset[int(key)][self.column]
        if isinstance(value, dict):  # an Audio feature: {"bytes", "path"}
            if value.get("bytes") is not None:
                return value["bytes"]
            value = value.get("path")
        if not value:
            raise UsageError(f"row {key} of the {self.split} data has no audio in column {self.column!r}: give it a "
                             "file, or drop the row")
        return value if self.base is None or os.path.isabs(value) else os.path.join(self.base, value)

    def name(self, i):
        """How predictions and errors name row i: its file's path where it has one, else its row number."""
        value = self.dataset[int(i)][self.column]
        path = value.get("path") if isinstance(value, dict) else value
        return path or f"row {i}"


def check_clips(sources, split, workers=None):
    """The duration in seconds of every clip of `sources` (an `AudioSources`), each read once on
    `workers` threads; a UsageError names the first that is missing or cannot be read."""
    def seconds(i):
        source = sources[i]
        try:
            duration = clip_seconds(source)
        except (OSError, AudioError, EOFError, struct.error) as e:
            return None, e
        # No sample to hear, or samples that are no numbers: the loss would be nan
        if duration <= 0:
            return None, AudioError("it holds no samples (0 s)")
        if non_finite_float_wav(source):
            return None, AudioError("it holds samples that are not finite numbers (NaN or infinity)")
        return duration, None

    with ThreadPoolExecutor(workers or default_workers()) as pool:
        found = list(pool.map(seconds, range(len(sources))))
    for i, (_, error) in enumerate(found):
        if error is None:
            continue
        name = sources.name(i)
        if isinstance(error, FileNotFoundError):
            raise UsageError(f"audio file {sources[i]} of the {split} data (row {i}) not found: check the path "
                             "(relative paths are read from the data file's folder)")
        raise UsageError(f"audio {name} of the {split} data (row {i}) cannot be read: {error}: replace or remove it")
    return np.array([duration for duration, _ in found], np.float64)


# ---------------------------------------------------------------------------------------------
# Whisper's log-mel features
# ---------------------------------------------------------------------------------------------


def whisper_log_mel(samples, extractor):
    """float32 [mel bins, frames]: what `WhisperFeatureExtractor` computes for one clip (padded or
    cut to its chunk, a centred STFT with a periodic Hann window, power, its mel filters, log10
    floored 8 below the peak, scaled), with every frame at once: its NumPy path loops over frames in
    Python, ten times slower, and the features of each training batch are computed on the fly."""
    from transformers.audio_utils import window_function

    chunk = np.zeros(extractor.n_samples, np.float64)
    clip = np.asarray(samples, np.float64)[:extractor.n_samples]
    chunk[:len(clip)] = clip
    n_fft, hop = extractor.n_fft, extractor.hop_length
    padded = np.pad(chunk, n_fft // 2, mode="reflect")
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop]
    power = np.abs(np.fft.rfft(frames * window_function(n_fft, "hann"), axis=-1)) ** 2
    log_mel = np.log10(np.maximum(power @ extractor.mel_filters, 1e-10)).T[:, :-1]  # the last frame is dropped
    log_mel = np.maximum(log_mel, log_mel.max() - 8.0)
    return ((log_mel + 4.0) / 4.0).astype(np.float32)
