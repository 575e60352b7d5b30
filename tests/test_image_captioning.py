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
from utils.base.errors import UsageError
from utils.scoring.metrics import bleu, rouge

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
    """What `utils.models.loading.decoder_input_ids` reads of a captioning config."""
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

    from utils.base.arguments import ModelArguments
    from utils.layout.layouts import make_layout
    from utils.models.loading import load_composed_model

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


def test_fresh_composed_weights_are_transformers_own_draws_from_one_program():
    """load_composed_model's fresh weights: transformers' own init for the seed, drawn in one compiled
    program instead of ~180 (float32 rounding apart), and the class left as it was."""
    from transformers import FlaxVisionEncoderDecoderModel, GPT2Config, VisionEncoderDecoderConfig, ViTConfig

    from fresh_draws import assert_drawn_in_one_program
    from utils.base.arguments import ModelArguments
    from utils.layout.layouts import make_layout
    from utils.models.loading import load_composed_model

    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(
        ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=32),
        GPT2Config(n_embd=24, n_layer=1, n_head=2, n_positions=16, vocab_size=50, is_decoder=True,
                   add_cross_attention=True))
    assert_drawn_in_one_program(FlaxVisionEncoderDecoderModel, config, 3, lambda: load_composed_model(
        FlaxVisionEncoderDecoderModel, config, ModelArguments(), {}, 3, make_layout("dp"))[1])


# ----------------------------------------------------------------------------------------------
# End to end: one training run, then what is done with its output dir
# ----------------------------------------------------------------------------------------------
TINY_VIT = ("image_size=32,patch_size=8,hidden_size=32,num_hidden_layers=1,num_attention_heads=2,"
            "intermediate_size=64,hidden_dropout_prob=0,attention_probs_dropout_prob=0")
TINY_GPT2 = "n_embd=32,n_layer=1,n_head=2,n_positions=24,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"
# 480 training images, 1440 (image, caption) pairs / (8 per device x 8 devices) = 22 steps per epoch.
RUN = ["--encoder_model_type", "vit", "--encoder_config_overrides", TINY_VIT,
       "--decoder_model_type", "gpt2", "--decoder_config_overrides", TINY_GPT2, "--tokenizer_name", TOKENIZER,
       "--train_file", os.path.join(DATA, "train_dataset.json"), "--max_train_samples", 480,
       "--max_target_length", 20, "--do_train", "--max_steps", 60, "--save_steps", 30, "--eval_steps", 60,
       "--logging_steps", 10, "--learning_rate", 1e-2, "--warmup_steps", 10, "--per_device_train_batch_size", 8]
EVALUATION = ["--validation_file", os.path.join(DATA, "valid_dataset.json"), "--max_eval_samples", 40,
              "--test_file", os.path.join(DATA, "test_dataset.json"), "--max_predict_samples", 24, "--do_eval",
              "--do_predict", "--predict_with_generate", "--num_beams", 2, "--per_device_eval_batch_size", 4]


def run_ok(args):
    result = run_script(SCRIPT, args)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("captioning") / "out"
    run_ok([*RUN, *EVALUATION, "--output_dir", out])
    return out


@pytest.mark.slow
def test_it_learns_to_say_what_is_where(trained):
    """Untrained, the model's loss is about ln(vocabulary) and its BLEU 0 (the README's untrained row);
    60 steps take it far above that. Every key of the summarization script, plus BLEU."""
    results = read_json(trained / "all_results.json")
    for split in ("eval", "test"):
        assert {f"{split}_{key}" for key in ("loss", "rouge1", "rouge2", "rougeL", "rougeLsum", "bleu", "gen_len",
                                             "samples")} <= set(results)
    vocabulary = len(_tokenizer())
    assert results["eval_loss"] < 0.5 * np.log(vocabulary), results
    assert results["eval_bleu"] > 10 and results["test_rougeL"] > 40, results
    lines = (trained / "generated_predictions.txt").read_text().splitlines()
    assert len(lines) == results["test_samples"] == 24



@pytest.mark.slow
def test_the_export_captions_in_transformers_own_classes_as_the_script_did(trained):
    """`FlaxVisionEncoderDecoderModel`, `AutoImageProcessor` and `AutoTokenizer` read the output dir and
    caption the test images as generated_predictions.txt says (the saved generation config: 2 beams)."""
    import jax
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, FlaxVisionEncoderDecoderModel

    model = FlaxVisionEncoderDecoderModel.from_pretrained(trained)
    processor, tokenizer = AutoImageProcessor.from_pretrained(trained), AutoTokenizer.from_pretrained(trained)
    assert model.generation_config.num_beams == 2
    rows = [json.loads(line) for line in open(os.path.join(DATA, "test_dataset.json"))][:8]
    pictures = [Image.open(os.path.join(DATA, row["image_path"])).convert("RGB") for row in rows]
    pixels = processor(pictures, return_tensors="np")["pixel_values"]
    generate = jax.jit(lambda params, pixels: model.generate(pixels, params=params,
                                                            generation_config=model.generation_config).sequences)
    ids = generate(model.params, pixels)
    captions = [" ".join(text.split()) for text in tokenizer.batch_decode(np.asarray(ids), skip_special_tokens=True)]
    assert captions == (trained / "generated_predictions.txt").read_text().splitlines()[:8]


@pytest.mark.slow
def test_eval_and_predict_alone_from_the_saved_model_give_the_same_results(trained, tmp_path):
    out = tmp_path / "again"
    run_ok(["--model_name_or_path", trained, *EVALUATION, "--output_dir", out])
    again, first = read_json(out / "all_results.json"), read_json(trained / "all_results.json")
    assert again == {key: value for key, value in first.items() if not key.startswith("train_")}
    assert (out / "generated_predictions.txt").read_text() == (trained / "generated_predictions.txt").read_text()


@pytest.mark.slow
def test_killed_after_a_checkpoint_then_resumed_ends_bitwise_as_the_run_nothing_stopped(trained, tmp_path):
    """SIGKILL once the checkpoint of step 30 exists; the resumed run ends with the uninterrupted run's
    weights, byte for byte, and its losses at every step after the checkpoint."""
    import signal
    import subprocess
    import sys
    import time

    import script_launcher
    from script_runner import read_metrics, script_env

    out = tmp_path / "killed"
    argv = [sys.executable, os.path.join(ROOT, SCRIPT), *map(str, RUN), "--output_dir", str(out)]
    process = script_launcher.popen(argv, ROOT, script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not (out / "checkpoints" / "30").is_dir():
        assert process.poll() is None, "the run ended before its first checkpoint"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    assert not (out / "all_results.json").exists()
    resumed = run_ok([*RUN, "--output_dir", out, "--resume_from_checkpoint", "latest"])
    assert "resumed from the checkpoint of step 30" in resumed.stderr
    assert (out / "flax_model.msgpack").read_bytes() == (trained / "flax_model.msgpack").read_bytes()
    losses = {row["step"]: row["loss"] for row in read_metrics(out)}
    assert {step: losses[step] for step in (40, 50, 60)} == {
        row["step"]: row["loss"] for row in read_metrics(trained) if row["step"] in (40, 50, 60)}


@pytest.mark.slow
def test_the_demo_captions_an_upload_as_the_script_did(trained):
    from tasks.demo import BadInput, load

    task, predictor = load(str(trained))
    assert task == "image-captioning"
    row = json.loads(open(os.path.join(DATA, "test_dataset.json")).readline())
    with open(os.path.join(DATA, row["image_path"]), "rb") as f:
        answer = predictor(f.read())
    assert answer.text == (trained / "generated_predictions.txt").read_text().splitlines()[0]
    with pytest.raises(BadInput, match="not an image that can be read"):
        predictor(b"GIF89a, or so it says")


def test_a_decoder_transformers_cannot_generate_with_is_refused_up_front():
    """transformers' Flax vision encoder-decoder hands a BERT decoder the encoder's states as token types
    when it generates: such a decoder is refused before any work, a GPT-2 is taken."""
    from run_image_captioning_flax import CaptioningModelArguments

    def arguments(decoder):
        return CaptioningModelArguments(encoder_model_type="vit", decoder_model_type=decoder)

    with pytest.raises(UsageError, match="model type 'bert' cannot be trained by this script: use one of gpt2"):
        captioning.load_captioning_config(arguments("bert"), _tokenizer())
    config = captioning.load_captioning_config(arguments("gpt2"), _tokenizer())
    assert config.decoder.add_cross_attention and config.decoder.is_decoder
    assert config.decoder.vocab_size == len(_tokenizer())
    tokens = captioning.special_tokens(_tokenizer())
    assert (config.decoder_start_token_id, config.eos_token_id, config.pad_token_id) == tokens
