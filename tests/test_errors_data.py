"""Every script, every kind of bad label, tag, answer, image or data file: one `error:` line naming
the file, a non-zero exit, and the output directory of the previous run byte-for-byte as it was
(the run was asked to replace it: --overwrite_output_dir).

Each case runs the script's `main` in this process with model loading replaced by a tripwire
(`tests/test_errors_cli.py`'s machinery): the data must be refused before any model is built, so
before anything is written.
"""

import csv
import json
import os
import re

import datasets
import numpy as np
import pytest
from PIL import Image

import run_clm_flax as clm
import run_flax_glue as glue
import run_flax_ner as ner
import run_hybrid_clip as clip
import run_image_captioning_flax as captioning
import run_image_classification as image
import run_mlm_flax as mlm
import run_qa
import run_speech_recognition_seq2seq as speech
import run_summarization_flax as summarization
import run_t5_mlm_flax as t5_mlm
import run_wav2vec2_pretrain_flax as wav2vec2
from script_runner import ROOT, directory_state
from test_long_qa import LONG_QA_TOKENIZER, TINY_BIG_BIRD, long_qa_row
from test_errors_cli import (LM_TOKENIZER, QA_TOKENIZER, T5_TOKENIZER, TINY_BERT, TINY_T5, TINY_VIT, TOKENIZER,
                             check_failure, qa_row, run_in_process, write_jsonl)

GLUE_TOKENIZER = os.path.join(ROOT, "data", "glue", "tokenizer")
NER_TOKENIZER = os.path.join(ROOT, "data", "ner", "tokenizer")
SCRIPTS = (summarization, clm, mlm, t5_mlm, glue, ner, run_qa, image, speech, wav2vec2)
IMAGE_TEXT_TOKENIZER = os.path.join(ROOT, "data", "image_text", "tokenizer")


def mixed_row(column, pattern):
    """The error for a JSON row whose value in `column` is of another type than the column's: the row's own
    (`pattern`) where `datasets` keeps such a column (4.7 on, its `Json` feature), else its loader's, naming
    the file, the column and the row."""
    if hasattr(datasets, "Json"):
        return pattern
    return rf"could not read the data files \(.*/train\w*\.jsonl?\): ArrowInvalid: .*Column\(/{column}\) changed .* in row 1"


def write_csv(path, header, rows):
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)
    return str(path)


def write_text(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def png(path, size=(8, 8), value=0):
    Image.fromarray(np.full(size[::-1], value, np.uint8)).save(path)
    return path.name


# Each script's flags, the bad file as its train file ({train}) or validation file ({valid}).
GLUE = ["--model_type", "bert", "--config_overrides", TINY_BERT, "--tokenizer_name", GLUE_TOKENIZER,
        "--max_seq_length", 16, "--do_train", "--train_file", "{train}"]
NER = ["--model_type", "bert", "--config_overrides", TINY_BERT, "--tokenizer_name", NER_TOKENIZER,
       "--max_seq_length", 16, "--do_train", "--train_file", "{train}"]
QA = ["--model_type", "bert", "--config_overrides", TINY_BERT + ",max_position_embeddings=64", "--tokenizer_name",
      QA_TOKENIZER, "--max_seq_length", 32, "--doc_stride", 8, "--do_train", "--train_file", "{train}"]
IMAGE = ["--model_type", "vit", "--config_overrides", TINY_VIT, "--do_train", "--train_file", "{train}"]
CLIP = ["--text_model_type", "bert", "--text_config_overrides", TINY_BERT, "--vision_model_type", "vit",
        "--vision_config_overrides", TINY_VIT, "--tokenizer_name", IMAGE_TEXT_TOKENIZER, "--do_train", "--train_file",
        "{train}"]
SUMMARIZATION = ["--model_type", "t5", "--config_overrides", TINY_T5, "--tokenizer_name", TOKENIZER, "--do_train",
                 "--train_file", "{train}"]
CLM = ["--model_type", "gpt2", "--config_overrides", "n_embd=32,n_layer=1,n_head=2,n_positions=64", "--block_size",
       32, "--tokenizer_name", LM_TOKENIZER, "--do_train", "--train_file", "{train}"]
MLM = ["--model_type", "roberta", "--config_overrides", "hidden_size=32,num_hidden_layers=1,num_attention_heads=2,"
       "intermediate_size=64,max_position_embeddings=34", "--max_seq_length", 32, "--tokenizer_name", LM_TOKENIZER,
       "--do_train", "--train_file", "{train}"]
CAPTIONING = ["--encoder_model_type", "vit", "--encoder_config_overrides", TINY_VIT, "--decoder_model_type", "gpt2",
              "--decoder_config_overrides", "n_embd=16,n_layer=1,n_head=2,n_positions=16", "--tokenizer_name",
              os.path.join(ROOT, "data", "image_text", "tokenizer"), "--do_train", "--train_file", "{train}"]
T5_MLM = ["--model_type", "t5", "--config_overrides", TINY_T5, "--tokenizer_name", T5_TOKENIZER, "--max_seq_length", 32,
          "--do_train", "--train_file", "{train}"]
WITH_VALIDATION = ["--do_eval", "--validation_file", "{valid}"]
LONG_QA = ["--model_type", "big_bird", "--config_overrides", TINY_BIG_BIRD, "--tokenizer_name", LONG_QA_TOKENIZER,
           "--answer_categories", "--attention_type", "original_full", "--max_seq_length", 64, "--doc_stride", 16,
           "--do_train", "--train_file", "{train}"]

CHAT = ["--model_type", "gpt2", "--config_overrides", "n_embd=32,n_layer=1,n_head=2,n_positions=64", "--block_size",
        64, "--tokenizer_name", os.path.join(ROOT, "data", "chat", "tokenizer"), "--do_train", "--train_file", "{train}"]
SPEECH_DATA = os.path.join(ROOT, "data", "speech")
SPEECH = ["--model_type", "whisper", "--config_overrides", "d_model=32,encoder_layers=1,decoder_layers=1,"
          "encoder_attention_heads=2,decoder_attention_heads=2,encoder_ffn_dim=64,decoder_ffn_dim=64,"
          "max_target_positions=32", "--tokenizer_name", os.path.join(SPEECH_DATA, "tokenizer"),
          "--feature_extractor_name", os.path.join(SPEECH_DATA, "tokenizer"), "--do_train", "--train_file", "{train}"]
WAV2VEC2 = ["--config_name", os.path.join(SPEECH_DATA, "wav2vec2_tiny"), "--feature_extractor_name",
            os.path.join(SPEECH_DATA, "wav2vec2_tiny"), "--do_train", "--train_file", "{train}"]

SENTENCES = [f"sentence number {i}" for i in range(10)]
GOOD_QA = [qa_row(i) for i in range(4)]


def glue_train(d, labels):
    return write_csv(d / "train.csv", ["sentence", "label"], zip(SENTENCES, labels))


def ner_train(d, rows):
    return write_jsonl(d / "train.jsonl", rows)


def image_rows(d, rows):
    """A csv of image paths (relative to it) and labels; `rows` are (writer of an image into `d`, label)."""
    return write_csv(d / "train.csv", ["image", "label"], [(make(d), label) for make, label in rows])


def caption_rows(d, rows, column="captions"):
    """Classic json lines of image paths (relative to the file) and captions; `rows` are (writer of an
    image into `d`, captions)."""
    return write_jsonl(d / "train_dataset.json", [{"image_path": make(d), column: captions} for make, captions in rows])


def good_image(i, label):
    return (lambda d: png(d / f"{i}.png", value=20 * i)), label


def corrupt_image(d):
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return "corrupt.png"


def bomb_image(d):
    """A valid PNG of 20000 x 20000 pixels (48 kB compressed): more than Pillow decodes."""
    Image.new("1", (20000, 20000)).save(d / "bomb.png")
    return "bomb.png"


def conversation(answer, question="What is 1 plus 1?"):
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def chat_rows(d, rows):
    return write_jsonl(d / "train.jsonl", [conversation("two")] * 3 + rows)


def template(d, content):
    (d / "chat.jinja").write_bytes(content)
    return str(d / "chat.jinja")


def wav(d, name, samples):
    """A 16 kHz 16-bit mono WAV of `samples` samples (`tasks.audio.write_wav`)."""
    from tasks.audio import write_wav

    write_wav(d / name, np.zeros(samples), 16000)
    return name


def clips_csv(d, rows):
    """A csv of audio paths (relative to it) and transcripts; `rows` are (writer of a clip into `d`, text)."""
    return write_csv(d / "train.csv", ["audio", "text"], [(make(d), text) for make, text in rows])


SECOND = [(lambda d, i=i: wav(d, f"{i}.wav", 16000), "one two") for i in range(3)]


# (case, script, flags, {placeholder: writer of the file into a folder}, the file the error names, pattern)
CASES = [
    # Sequence classification and regression
    ("glue: regression label inf", glue, GLUE, {"train": lambda d: glue_train(d, [0.5, 1.5, float("inf")] + [1.0] * 7)},
     "train", r"row 2 of the train data has the label inf: a score must be a finite number"),
    ("glue: regression label -inf in validation", glue, GLUE + WITH_VALIDATION,
     {"train": lambda d: glue_train(d, [0.5 * i for i in range(10)]),
      "valid": lambda d: write_csv(d / "valid.csv", ["sentence", "label"], [("a", 1.0), ("b", "-inf")])},
     "valid", r"row 1 of the validation data has the label -inf"),
    ("glue: missing label", glue, GLUE, {"train": lambda d: glue_train(d, ["pos", "", "neg"] + ["pos"] * 7)},
     "train", r"row 1 of the train data has no label"),
    ("glue: one class", glue, GLUE, {"train": lambda d: glue_train(d, ["pos"] * 10)},
     "train", r"the train data has one class only in its label column 'label' \('pos'\): classification needs"),
    ("glue: header only", glue, GLUE, {"train": lambda d: write_csv(d / "train.csv", ["sentence", "label"], [])},
     "train", r"has a CSV header \(sentence, label\) but no rows"),
    # Tagging
    ("ner: missing tag", ner, NER, {"train": lambda d: ner_train(d, [{"tokens": ["Ann", "ran"], "ner_tags": ["B-PER", "O"]},
                                                                     {"tokens": ["Bob", "ran"], "ner_tags": ["B-PER", None]}])},
     "train", r"row 1 of the train data has the tag None: a tag must be a name"),
    ("ner: one tag", ner, NER, {"train": lambda d: ner_train(d, [{"tokens": ["a", "b"], "ner_tags": ["O", "O"]}] * 3)},
     "train", r"the train data has one tag only \('O'\): tagging needs two tags or more"),
    ("ner: tags and words differ", ner, NER,
     {"train": lambda d: ner_train(d, [{"tokens": ["Ann", "ran"], "ner_tags": ["B-PER"]}])},
     "train", r"row 0 of the train data has 2 words but 1 tags"),
    ("ner: header only", ner, NER, {"train": lambda d: write_csv(d / "train.csv", ["tokens", "ner_tags"], [])},
     "train", r"but no rows"),
    # Question answering
    ("qa: answer outside its context", run_qa, QA, {"train": lambda d: write_jsonl(d / "t.jsonl", [qa_row(0, start=400)])},
     "train", r"row 0 of the train data: answer_start 400 is outside its context"),
    ("qa: answer not where it says", run_qa, QA,
     {"train": lambda d: write_jsonl(d / "t.jsonl", [qa_row(0), qa_row(1, text="Paris")])},
     "train", r"row 1 of the train data: the answer 'Paris' is not at answer_start 19"),
    ("qa: duplicate ids", run_qa, QA + WITH_VALIDATION,
     {"train": lambda d: write_jsonl(d / "t.jsonl", GOOD_QA),
      "valid": lambda d: write_jsonl(d / "v.jsonl", [qa_row(0), qa_row(1), qa_row(0, question="Who moved?")])},
     "valid", r"rows 0 and 2 of the validation data have the same id 'q0': each question needs an id of its own"),
    ("qa: answers not JSON", run_qa, QA,
     {"train": lambda d: write_csv(d / "t.csv", ["id", "question", "context", "answers"],
                                   [("q0", "Where?", "In Lyon .", "{text: Lyon")])},
     "train", r"row 0 of the train data: the answers .* are not JSON"),
    ("qa: SQuAD document without a context", run_qa, QA,
     {"train": lambda d: write_text(d / "t.json", json.dumps({"version": "1.1", "data": [{"title": "a", "paragraphs": [
         {"qas": [{"id": "q0", "question": "Who?", "answers": []}]}]}]}))},
     "train", r"article 0 \(question 0 of the file\) has no 'context': a SQuAD article holds paragraphs"),
    ("qa: blank lines only", run_qa, QA, {"train": lambda d: write_text(d / "t.jsonl", "\n\n")},
     "train", r"holds no rows, only blank lines"),
    # Long-document question answering (--answer_categories)
    ("long qa: unknown category", run_qa, LONG_QA,
     {"train": lambda d: write_jsonl(d / "t.jsonl", [long_qa_row(0), long_qa_row(1, category="maybe")])},
     "train", r"row 1 of the train data: unknown answer category 'maybe': use one of null, short, long, yes, no"),
    ("long qa: answer outside the document", run_qa, LONG_QA,
     {"train": lambda d: write_jsonl(d / "t.jsonl", [long_qa_row(0, start=9999)])},
     "train", r"row 0 of the train data: answer_start 9999 is outside its document of \d+ characters"),
    # Images
    ("image: corrupt image", image, IMAGE,
     {"train": lambda d: image_rows(d, [good_image(0, "cat"), good_image(1, "dog"), (corrupt_image, "dog")])},
     "corrupt.png", r"image .*corrupt\.png cannot be read \(UnidentifiedImageError"),
    ("image: decompression bomb", image, IMAGE,
     {"train": lambda d: image_rows(d, [good_image(0, "cat"), good_image(1, "dog"), (bomb_image, "dog")])},
     "bomb.png", r"image .*bomb\.png is too large to decode \(.*decompression bomb"),
    ("image: one class", image, IMAGE, {"train": lambda d: image_rows(d, [good_image(i, "cat") for i in range(3)])},
     "train", r"the train data has one class only \('cat'\)"),
    ("image: missing label", image, IMAGE,
     {"train": lambda d: image_rows(d, [good_image(0, "cat"), good_image(1, ""), good_image(2, "dog")])},
     "train", r"row 1 of the train data has no label"),
    ("image: missing image", image, IMAGE,
     {"train": lambda d: image_rows(d, [good_image(0, "cat"), ((lambda d: ""), "dog"), good_image(2, "dog")])},
     "train", r"row 1 of the train data has no image in column 'image'"),
    ("image: header only", image, IMAGE, {"train": lambda d: write_csv(d / "train.csv", ["image", "label"], [])},
     "train", r"but no rows"),
    # Image-text pairs
    ("clip: missing image file", clip, CLIP,
     {"train": lambda d: caption_rows(d, [(good_image(0, "")[0], ["a cat"]), ((lambda d: "nothere.png"), ["a dog"])])},
     "nothere.png", r"image .*nothere\.png cannot be read \(FileNotFoundError"),
    ("clip: not an image", clip, CLIP,
     {"train": lambda d: caption_rows(d, [(good_image(0, "")[0], ["a cat"]), (corrupt_image, ["a dog"])])},
     "corrupt.png", r"image .*corrupt\.png cannot be read \(UnidentifiedImageError"),
    ("clip: no caption column", clip, CLIP,
     {"train": lambda d: caption_rows(d, [(good_image(0, "")[0], ["a cat"])], column="description")},
     "train", r"the train data has no 'captions' / 'caption' / 'text' column \(its columns: image_path, "
              r"description\): name it with --caption_column"),
    ("clip: empty caption", clip, CLIP,
     {"train": lambda d: caption_rows(d, [(good_image(0, "")[0], ["a cat"]), (good_image(1, "")[0], [])])},
     "train", r"row 1 of the train data has no caption in column 'captions'"),
    # Image captioning
    ("captioning: missing image file", captioning, CAPTIONING,
     {"train": lambda d: write_jsonl(d / "train.jsonl", [{"image_path": good_image(0, "")[0](d), "captions": ["a"]},
                                                         {"image_path": "gone.png", "captions": ["b"]}])},
     "gone.png", r"image .*gone\.png cannot be read \(FileNotFoundError"),
    ("captioning: not an image", captioning, CAPTIONING,
     {"train": lambda d: write_jsonl(d / "train.jsonl", [{"image_path": corrupt_image(d), "captions": ["a"]}])},
     "corrupt.png", r"image .*corrupt\.png cannot be read \(UnidentifiedImageError"),
    ("captioning: caption column absent", captioning, CAPTIONING + ["--caption_column", "caption"],
     {"train": lambda d: write_jsonl(d / "train.jsonl", [{"image_path": good_image(0, "")[0](d), "captions": ["a"]}])},
     "train", r"--caption_column 'caption' is not a column of the train data; its columns: image_path, captions"),
    ("captioning: row without a caption", captioning, CAPTIONING,
     {"train": lambda d: write_csv(d / "train.csv", ["image_path", "caption"],
                                   [(good_image(0, "")[0](d), "a"), (good_image(1, "")[0](d), "")])},
     "train", r"row 1 of the train data has no caption in column 'caption'"),
    ("clip: a number among the captions", clip, CLIP,
     {"train": lambda d: caption_rows(d, [(good_image(0, "")[0], ["a cat"]), (good_image(1, "")[0], 7)])},
     "train", mixed_row("captions", r"row 1 of the train data holds 7 in column 'captions', not a caption or a list of "
                        "captions")),
    ("captioning: a number among the image paths", captioning, CAPTIONING,
     {"train": lambda d: caption_rows(d, [(good_image(0, "")[0], ["a cat"]), ((lambda d: 7), ["a dog"])])},
     "train", mixed_row("image_path", r"row 1 of the train data holds 7 in column 'image_path', not a path to an image "
                          "file")),
    ("captioning: a record among the captions", captioning, CAPTIONING,
     {"train": lambda d: caption_rows(d, [(good_image(0, "")[0], ["a cat"]), (good_image(1, "")[0], {"a": "b"})])},
     "train", mixed_row("captions", r"row 1 of the train data holds \{'a': 'b'\} in column 'captions', not a caption")),
    # Chat rows and templates
    ("chat: empty answer", clm, CHAT, {"train": lambda d: chat_rows(d, [conversation("")])},
     "train", r"row 4 of the train data: assistant turn 2 of `messages` is empty"),
    ("chat: a prompt / completion row among conversations", clm, CHAT,
     {"train": lambda d: chat_rows(d, [{"prompt": "a", "completion": "b"}])},
     "train", r"row 4 of the train data has `prompt` / `completion` where the other rows have `messages`"),
    ("chat: template not UTF-8", clm, CHAT + ["--chat_template", "{template}"],
     {"train": lambda d: chat_rows(d, []), "template": lambda d: template(d, b"caf\xe9 {{ messages }}")},
     "template", r"--chat_template .* is not UTF-8 text \(byte 0xe9 at offset 3\)"),
    ("chat: template syntax", clm, CHAT + ["--chat_template", "{template}"],
     {"train": lambda d: chat_rows(d, []), "template": lambda d: template(d, b"{% for m in messages %}{{ m }")},
     "template", r"--chat_template .* is not a valid Jinja template \(line 1: unexpected '}'\)"),
    ("chat: template writes no answer", clm, CHAT + ["--chat_template", "{template}"],
     {"train": lambda d: chat_rows(d, []), "template": lambda d: template(d, b"{% for m in messages %}{{ m.role }}"
                                                                                b"{% endfor %}")},
     "train", r"the chat template does not write the assistant turns' `content` \(tried on row 1 of the train data"),
    # Audio
    ("speech: a clip of no samples", speech, SPEECH,
     {"train": lambda d: clips_csv(d, SECOND + [(lambda d: wav(d, "silent.wav", 0), "three")])},
     "train", r"audio .*silent\.wav of the train data \(row 3\) cannot be read: it holds no samples"),
    ("speech: an empty file", speech, SPEECH,
     {"train": lambda d: clips_csv(d, SECOND + [(lambda d: (d / "empty.wav").write_bytes(b"") * 0 or "empty.wav", "x")])},
     "train", r"audio .*empty\.wav of the train data \(row 3\) cannot be read: an empty file \(0 bytes\)"),
    ("speech: a list for a transcript", speech, SPEECH,
     {"train": lambda d: write_jsonl(d / "train.jsonl", [{"audio": wav(d, "a.wav", 16000), "text": "one"},
                                                         {"audio": wav(d, "b.wav", 16000), "text": ["one", "two"]}])},
     "train", mixed_row("text", r"row 1 of the train data holds \['one', 'two'\] in column 'text', not a transcript")),
    ("wav2vec2: a row without audio", wav2vec2, WAV2VEC2,
     {"train": lambda d: clips_csv(d, SECOND + [(lambda d: "", "")])},
     "train", r"row 3 of the train data has no audio in column 'audio'"),
    ("wav2vec2: a clip of no samples", wav2vec2, WAV2VEC2,
     {"train": lambda d: clips_csv(d, SECOND + [(lambda d: wav(d, "silent.wav", 0), "")])},
     "train", r"silent\.wav of the train data \(row 3\) cannot be read: it holds no samples"),
    # Texts
    ("summarization: header only", summarization, SUMMARIZATION,
     {"train": lambda d: write_csv(d / "train.csv", ["document", "summary"], [])}, "train", r"but no rows"),
    ("clm: header only", clm, CLM, {"train": lambda d: write_csv(d / "train.csv", ["text"], [])}, "train",
     r"but no rows"),
    ("mlm: blank lines only", mlm, MLM, {"train": lambda d: write_text(d / "train.jsonl", "\n \n")}, "train",
     r"holds no rows"),
    ("t5 mlm: header only", t5_mlm, T5_MLM, {"train": lambda d: write_csv(d / "train.csv", ["text"], [])}, "train",
     r"but no rows"),
]


@pytest.fixture
def previous_run(tmp_path):
    """An output dir holding a finished run's files, which a run with --overwrite_output_dir replaces."""
    out = tmp_path / "previous"
    (out / "checkpoints" / "4").mkdir(parents=True)
    (out / "checkpoints" / "4" / "state").write_bytes(b"weights of step 4")
    (out / "metrics.jsonl").write_text('{"step": 4, "split": "train", "time": 0, "loss": 1.5}\n')
    (out / "all_results.json").write_text('{"train_loss": 1.5}')
    return out


@pytest.mark.parametrize("case, script, flags, writers, named, pattern", CASES, ids=[case[0] for case in CASES])
def test_bad_data_is_one_error_naming_the_file(monkeypatch, capsys, tmp_path, previous_run, case, script, flags,
                                               writers, named, pattern):
    def tripwire(*args, **kwargs):
        raise AssertionError("the model was built before the bad data was found")

    for module in SCRIPTS:
        monkeypatch.setattr(module, "load_model", tripwire)
    monkeypatch.setattr(clip.image_text, "load_dual_encoder", tripwire)
    monkeypatch.setattr(captioning, "load_composed_model", tripwire)
    data = tmp_path / "data"
    data.mkdir()
    paths = {placeholder: write(data) for placeholder, write in writers.items()}
    argv = [str(flag).format(**paths) for flag in flags]
    before = directory_state(previous_run)
    code = run_in_process(script, [*argv, "--output_dir", previous_run, "--overwrite_output_dir"], tmp_path)
    err = capsys.readouterr().err
    check_failure(2, code, err, pattern)
    line = err.strip().splitlines()[-1]
    assert (paths[named] if named in paths else str(data / named)) in line, line  # the file is named
    assert directory_state(previous_run) == before


@pytest.mark.parametrize("error", [ValueError('Instruction "train" corresponds to no data!'),
                                   RuntimeError("pyarrow: straddling object straddles two block boundaries")])
def test_any_error_of_a_reader_names_the_files(monkeypatch, tmp_path, error):
    """Whatever `datasets` or the readers under it raise on a file the pre-read let through is one
    UsageError naming the files, never the library's bare exception."""
    import datasets

    from utils.data import loaders
    from utils.base.errors import UsageError

    def load_dataset(*args, **kwargs):
        raise error

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    train = glue_train(tmp_path, ["pos", "neg"] * 5)
    with pytest.raises(UsageError, match=rf"could not read the data files \({train}\): {type(error).__name__}: "
                                         r".*check that each is a valid csv file"):
        loaders.load_splits(glue.DataTrainingArguments(), {"train": train})


def test_a_batch_of_missing_or_blank_texts_encodes_to_nothing():
    """A `datasets.map` batch (or a validation part carved off) holding only null or blank texts: no
    rows, not the fast tokenizer's IndexError on an empty list."""
    from transformers import AutoTokenizer

    from tasks import lm

    tokenizer = AutoTokenizer.from_pretrained(LM_TOKENIZER)
    assert lm.encode_texts(tokenizer, [None, " \n"]) == []
    assert lm.encode_lines(tokenizer, [None, ""], 8) == {"input_ids": [], "attention_mask": []}
    assert lm.encode_texts(tokenizer, [None, "a b"]) == [tokenizer("a b")["input_ids"]]


@pytest.mark.parametrize("name, content, pattern", [
    ("header.csv", "text\n", r"has a CSV header \(text\) but no rows"),
    ("blank.jsonl", "\n\n", r"holds no rows, only blank lines"),
])
def test_train_tokenizer_checks_its_files_first(tmp_path, capsys, name, content, pattern):
    import train_tokenizer

    path = write_text(tmp_path / name, content)
    out = tmp_path / "out"
    assert train_tokenizer.main(["--kind", "bpe", "--train_files", path, "--vocab_size", "100", "--output_dir",
                                 str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(rf"train_tokenizer.py: error: data file {re.escape(path)} {pattern}", err[0])
    assert not out.exists()
