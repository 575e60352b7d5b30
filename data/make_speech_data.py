"""Build the toy speech data set and its Whisper-style tokenizer and feature extractor (deterministic
for one espeak-ng version; the shipped files were made once, so nothing else needs espeak-ng).

Each clip is a short spoken sentence from a small grammar, "<number> <colour> <animal> <verb>":

    "three red cats jump"

spoken by Debian's `espeak-ng` speech synthesiser in one of several English voices, at a random
speed and pitch, saved as 8 kHz 16-bit mono WAV (small files; the scripts resample them to the
feature extractor's 16 kHz). Validation and test sentences are word combinations never heard in
training, so a model must recognise the words, not remember the sentences. Writes
`speech/{train,validation,test}.csv` (columns `audio`, a path relative to the csv, and `text`),
`speech/clips/*.wav`, and `speech/tokenizer/`: a byte-level BPE learnt on the training transcripts
wrapped as a `WhisperTokenizerFast` with Whisper's special tokens (so `set_prefix_tokens(language,
task)` works as with a real Whisper checkpoint), plus a `WhisperFeatureExtractor` whose 2-second
chunk the tiny configs' encoder is sized to; `speech/wav2vec2/`: a tiny wav2vec2 encoder's config and its
feature extractor (raw waveform), for the speech encoder-decoder; and `speech/wav2vec2_tiny/`, the config
and feature extractor of the tiny wav2vec2 `configs/wav2vec2_pretrain_tiny.json` pretrains.

    python data/make_speech_data.py [--train_size 240] [--validation_size 40] [--test_size 24] [--seed 42]
"""

import argparse
import csv
import itertools
import os
import random
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run as a plain script from anywhere

from tasks import audio  # noqa: E402

NUMBERS = "one two three four five six seven eight nine".split()
COLOURS = "red green blue yellow white black brown".split()
ANIMALS = "cats dogs birds fish horses mice frogs".split()
VERBS = "run jump sleep swim sing eat".split()
# espeak-ng's own English voices (no MBROLA voices: they are a separate package).
VOICES = ["en-us", "en-gb", "en-gb-x-rp", "en-us-nyc"]
SAMPLE_RATE = 8000  # stored; the feature extractor's rate is 16 kHz
CHUNK_SECONDS = 2  # the feature extractor's chunk (Whisper pads or cuts every clip to it)


def sentences(sizes, seed):
    """{split: sentences} of `sizes` ({split: how many}): every split's word combinations distinct from the others'."""
    combos = list(itertools.product(NUMBERS, COLOURS, ANIMALS, VERBS))
    random.Random(seed).shuffle(combos)
    out, start = {}, 0
    for split, size in sizes.items():
        out[split] = [" ".join(words) for words in combos[start:start + size]]
        start += size
    return out


def speak(text, voice, speed, pitch, path):
    """`text` spoken by espeak-ng into `path`, resampled to `SAMPLE_RATE` 16-bit mono."""
    with tempfile.NamedTemporaryFile(suffix=".wav") as raw:
        subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-p", str(pitch), "-w", raw.name, text],
                       check=True, capture_output=True)
        samples, rate = audio.read_wav(raw.name)
    samples = audio.resample(samples, rate, SAMPLE_RATE)
    audio.write_wav(path, samples, SAMPLE_RATE)
    return len(samples) / SAMPLE_RATE


def train_tokenizer(texts, output_dir):
    """A `WhisperTokenizerFast` over a byte-level BPE learnt on `texts`, with Whisper's special tokens
    in Whisper's order (language tokens right after <|startoftranscript|>, as `prefix_tokens` expects)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import WhisperFeatureExtractor, WhisperTokenizer, WhisperTokenizerFast
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    specials = (["<|startoftranscript|>"] + [f"<|{code}|>" for code in LANGUAGES]
                + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>",
                   "<|notimestamps|>"])
    with tempfile.TemporaryDirectory() as tmp:
        tok.model.save(tmp)
        slow = WhisperTokenizer(os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"),
                                unk_token="<|endoftext|>", bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                pad_token="<|endoftext|>")
        slow.add_special_tokens({"additional_special_tokens": specials})
        slow.save_pretrained(os.path.join(tmp, "slow"))
        fast = WhisperTokenizerFast.from_pretrained(os.path.join(tmp, "slow"))
    fast.set_prefix_tokens(language="english", task="transcribe", predict_timestamps=False)
    fast.save_pretrained(output_dir)
    WhisperFeatureExtractor(feature_size=80, sampling_rate=16000, hop_length=160, chunk_length=CHUNK_SECONDS,
                            n_fft=400).save_pretrained(output_dir)


def pretraining_config():
    """The tiny wav2vec2 that `configs/wav2vec2_pretrain_tiny.json` pretrains: a convolutional encoder of
    4 layers (320 samples a frame, wav2vec2's rate: a 2-second clip makes 99 frames), 2 transformer
    layers of 64, 2 codebooks of 32 codevectors (the stable-layer-norm layout, the only one Flax implements)."""
    from transformers import Wav2Vec2Config

    return Wav2Vec2Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        conv_dim=(32, 32, 32, 32), conv_stride=(5, 4, 4, 4), conv_kernel=(10, 4, 4, 4), conv_bias=True,
        feat_extract_norm="layer", do_stable_layer_norm=True, num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, num_codevector_groups=2, num_codevectors_per_group=32, codevector_dim=64,
        proj_codevector_dim=64, mask_time_prob=0.5, mask_time_length=5, num_negatives=20, diversity_loss_weight=0.1,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        feat_quantizer_dropout=0.0, final_dropout=0.0, layerdrop=0.0, vocab_size=32)


def encoder_config():
    """The tiny wav2vec2 encoder configs/speech_encoder_decoder_tiny.json joins to a tiny decoder. Its front
    end is a learnt filterbank (64 filters of 25 ms every 10 ms, as a log-mel's frames) and one convolution
    of stride 2, 50 frames a second; then 2 layers of 64. wav2vec2's own seven narrow convolutions learnt
    nothing from 240 clips (the loss stayed at the transcripts' entropy)."""
    from transformers import Wav2Vec2Config

    return Wav2Vec2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                          conv_dim=(64, 64), conv_kernel=(400, 3), conv_stride=(160, 2), num_feat_extract_layers=2,
                          num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                          feat_extract_norm="layer", do_stable_layer_norm=True, hidden_dropout=0.0,
                          activation_dropout=0.0, attention_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                          layerdrop=0.0, mask_time_prob=0.0)


def save_wav2vec2(output_dir, config):
    """`config` and wav2vec2's feature extractor (raw samples normalised per clip, with an attention mask)."""
    from transformers import Wav2Vec2FeatureExtractor

    config.save_pretrained(output_dir)
    Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                             return_attention_mask=True).save_pretrained(output_dir)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train_size", type=int, default=240)
    parser.add_argument("--validation_size", type=int, default=40)
    parser.add_argument("--test_size", type=int, default=24)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output_dir", default=os.path.join(ROOT, "data", "speech"))
    args = parser.parse_args(argv)
    if shutil.which("espeak-ng") is None:
        sys.exit("error: espeak-ng is not installed: apt-get install espeak-ng")
    rng = random.Random(args.seed)
    clips = os.path.join(args.output_dir, "clips")
    shutil.rmtree(clips, ignore_errors=True)
    os.makedirs(clips)
    for split, texts in sentences(
            {"train": args.train_size, "validation": args.validation_size, "test": args.test_size}, args.seed).items():
        rows = []
        for i, text in enumerate(texts):
            name = f"{split}_{i:04d}.wav"
            speak(text, rng.choice(VOICES), rng.randint(160, 200), rng.randint(35, 65), os.path.join(clips, name))
            rows.append({"audio": f"clips/{name}", "text": text})
        with open(os.path.join(args.output_dir, f"{split}.csv"), "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=["audio", "text"])
            writer.writeheader()
            writer.writerows(rows)
        if split == "train":
            train_tokenizer(texts, os.path.join(args.output_dir, "tokenizer"))
            save_wav2vec2(os.path.join(args.output_dir, "wav2vec2"), encoder_config())
        print(f"{split}: {len(rows)} clips")
    save_wav2vec2(os.path.join(args.output_dir, "wav2vec2_tiny"), pretraining_config())


if __name__ == "__main__":
    main()
