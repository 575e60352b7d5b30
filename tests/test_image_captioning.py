"""Image captioning: BLEU and multi-reference ROUGE against reference packages, captions as tokens,
images grouped with all their captions, the model joined from pretrained parts; and end-to-end runs
of run_image_captioning_flax.py on the shipped image-text data (8 virtual CPU devices)."""

import json
import os
import random
import shutil

import numpy as np
import pytest
from flax.traverse_util import flatten_dict

from script_runner import ROOT, directory_state, read_json, run_script
from tasks import image_captioning as captioning
from utils.errors import UsageError
from utils.metrics import bleu, rouge

SCRIPT = "run_image_captioning_flax.py"
DATA = os.path.join(ROOT, "data", "image_text")
TOKENIZER = os.path.join(DATA, "tokenizer")
WORDS = "a red blue square circle on the left right of above below , . 3.5 12-3 & (x)".split()


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------
def test_bleu_is_sacrebleus_corpus_bleu():
    """Random corpora (empty and one-word predictions, punctuation, numbers, three references each)
    score as sacrebleu's `corpus_bleu` with its defaults; the score is no constant."""
    sacrebleu = pytest.importorskip("sacrebleu")
    rng = random.Random(0)
    scores = set()
    for _ in range(150):
        size = rng.randint(1, 6)
        predictions = [" ".join(rng.choices(WORDS, k=rng.randint(0, 10))) for _ in range(size)]
        references = [[" ".join(rng.choices(WORDS, k=rng.randint(1, 10))) for _ in range(3)] for _ in range(size)]
        expected = sacrebleu.corpus_bleu(predictions, [list(stream) for stream in zip(*references)]).score
        assert bleu(predictions, references) == pytest.approx(expected, abs=1e-9), (predictions, references)
        scores.add(round(expected, 6))
    assert len(scores) > 20
    assert bleu(["a red square on the left"], ["a red square on the left"]) == pytest.approx(100.0)


def test_rouge_of_several_references_takes_the_best_one():
    """With several references a prediction scores against its best one, per ROUGE type (as
    `evaluate`'s rouge does); one reference in a list scores as that reference alone."""
    prediction = "a red square on the left of a blue circle"
    references = ["a blue circle to the right of a red square", "a red square on the left and a blue circle",
                  "two shapes"]
    alone = [rouge([prediction], [reference]) for reference in references]
    together = rouge([prediction], [references])
    for key in together:
        assert together[key] == pytest.approx(max(scores[key] for scores in alone))
    assert rouge([prediction], [[references[2]]]) == alone[2]


# ----------------------------------------------------------------------------------------------
# Captions as tokens
# ----------------------------------------------------------------------------------------------
class DecoderConfig:
    """What `utils.models.decoder_input_ids` reads of a captioning config."""
    model_type = "vision-encoder-decoder"


def test_captions_end_with_the_end_token_and_start_the_decoder_from_the_start_token():
    tokenizer = _tokenizer()
    tokens = captioning.special_tokens(tokenizer)
    assert (tokens.start, tokens.end, tokens.pad) == (tokenizer.cls_token_id, tokenizer.sep_token_id,
                                                      tokenizer.pad_token_id)
    config = _config_for(tokenizer)
    texts = ["a red square on the left", "a blue circle at the top and a red cross at the bottom"]
    encoded = captioning.encode_captions(tokenizer, texts, 8, config)
    for row, text in enumerate(texts):
        words = tokenizer(text, add_special_tokens=False)["input_ids"][:7]  # at most 7, then the end token
        expected = words + [tokens.end] + [tokens.pad] * (7 - len(words))
        assert encoded["labels"][row].tolist() == expected
        assert encoded["decoder_attention_mask"][row].tolist() == [1] * (len(words) + 1) + [0] * (7 - len(words))
        assert encoded["decoder_input_ids"][row].tolist() == [tokens.start] + expected[:-1]


# ----------------------------------------------------------------------------------------------
# Images and their captions
# ----------------------------------------------------------------------------------------------
def _dataset(rows):
    import datasets

    return datasets.Dataset.from_list(rows)


def test_rows_of_one_image_are_one_image_with_all_their_captions():
    """One row per caption (csv) and one row with a list (the classic json lines) give the same images."""
    file = os.path.join(DATA, "train_dataset.json")
    per_caption = _dataset([{"image_path": "images/train/00001.png", "caption": "b"},
                            {"image_path": "images/train/00000.png", "caption": "a"},
                            {"image_path": "images/train/00001.png", "caption": " c "}])
    found = captioning.captioned_images(per_caption, ("image_path", "caption"), "train", file)
    assert found.captions == [["b", "c"], ["a"]]
    assert found.shown == ["images/train/00001.png", "images/train/00000.png"]
    assert found.sources[0] == os.path.join(DATA, "images/train/00001.png")  # relative to the data file
    listed = _dataset([{"image_path": "images/train/00001.png", "captions": ["b", "c"]},
                       {"image_path": "images/train/00000.png", "captions": ["a"]}])
    assert captioning.captioned_images(listed, ("image_path", "captions"), "train", file).captions == found.captions
    pairs = captioning.caption_pairs(found, _tokenizer(), 6, _config_for(_tokenizer()))
    assert pairs.image_of.tolist() == [0, 0, 1]


def test_a_row_without_a_caption_or_an_image_is_named():
    file = os.path.join(DATA, "train_dataset.json")
    with pytest.raises(UsageError, match=r"row 1 of the train data has no caption in column 'captions'"):
        captioning.captioned_images(_dataset([{"image_path": "x.png", "captions": ["a"]},
                                              {"image_path": "y.png", "captions": [" "]}]),
                                    ("image_path", "captions"), "train", file)
    with pytest.raises(UsageError, match=r"row 1 of the validation data has no image in column 'image_path'"):
        captioning.captioned_images(_dataset([{"image_path": "x.png", "captions": ["a"]},
                                              {"image_path": None, "captions": ["b"]}]),
                                    ("image_path", "captions"), "validation", file)


def test_columns_default_to_usual_names_then_the_first_two():
    class Args:
        image_column = caption_column = None

    assert captioning.resolve_columns(Args, {"train": ["label", "captions", "image_path"]}) == ("image_path",
                                                                                                 "captions")
    assert captioning.resolve_columns(Args, {"train": ["picture", "words"]}) == ("picture", "words")
    with pytest.raises(UsageError, match=r"the train data has no caption column \(its columns: image_path, label, "
                                         r"split\): name it with --caption_column"):
        captioning.resolve_columns(Args, {"train": ["image_path", "label", "split"]})
    Args.caption_column = "sentence"
    with pytest.raises(UsageError, match="--caption_column 'sentence' is not a column of the train data"):
        captioning.resolve_columns(Args, {"train": ["image_path", "captions"]})


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER)


def _config_for(tokenizer):
    config = DecoderConfig()
    tokens = captioning.special_tokens(tokenizer)
    config.pad_token_id, config.decoder_start_token_id = tokens.pad, tokens.start
    return config


# ----------------------------------------------------------------------------------------------
# The model joined from pretrained parts
# ----------------------------------------------------------------------------------------------
def test_pretrained_parts_keep_their_weights_and_the_cross_attention_is_new(tmp_path):
    """An image classifier's ViT (msgpack, under its `vit` prefix) and a GPT-2 (Flax safetensors)
    become the encoder and decoder: their weights as saved, the cross-attention the GPT-2 lacks fresh."""
    from transformers import (FlaxAutoModel, FlaxAutoModelForCausalLM, FlaxGPT2LMHeadModel,
                              FlaxViTForImageClassification, FlaxVisionEncoderDecoderModel, GPT2Config, ViTConfig)

    from utils.args import ModelArguments
    from utils.layout import make_layout
    from utils.models import load_composed_model

    vit = FlaxViTForImageClassification(ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1,
                                                  num_attention_heads=2, intermediate_size=32, num_labels=3), seed=1)
    gpt2 = FlaxGPT2LMHeadModel(GPT2Config(n_embd=24, n_layer=1, n_head=2, n_positions=16, vocab_size=50), seed=2)
    vit.save_pretrained(tmp_path / "vit")
    gpt2.save_pretrained(tmp_path / "gpt2", safe_serialization=True)
    assert (tmp_path / "gpt2" / "model.safetensors").exists()
    encoder_args = ModelArguments(model_name_or_path=str(tmp_path / "vit"))
    decoder_args = ModelArguments(model_name_or_path=str(tmp_path / "gpt2"))
    from transformers import VisionEncoderDecoderConfig

    decoder_config = GPT2Config.from_pretrained(tmp_path / "gpt2", is_decoder=True, add_cross_attention=True)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig.from_pretrained(tmp_path / "vit"),
                                                                     decoder_config)
    _, params = load_composed_model(FlaxVisionEncoderDecoderModel, config, ModelArguments(),
                                    {"encoder": (FlaxAutoModel, encoder_args),
                                     "decoder": (FlaxAutoModelForCausalLM, decoder_args)}, 0, make_layout("dp"))
    loaded = flatten_dict(params)
    for key, value in flatten_dict(vit.params["vit"]).items():
        np.testing.assert_array_equal(loaded[("encoder",) + key], value)
    for key, value in flatten_dict(gpt2.params).items():
        np.testing.assert_array_equal(loaded[("decoder",) + key], value)
    cross = [key for key in loaded if "crossattention" in key]
    assert cross and ("enc_to_dec_proj", "kernel") in loaded  # 16 -> 24: the encoder's states projected
