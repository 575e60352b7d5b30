"""Every model family run_summarization_flax.py claims, built from scratch with a tiny config, trains,
evaluates, predicts with generate and exports a model that reloads (8 virtual CPU devices)."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import (AutoTokenizer, BertConfig, EncoderDecoderConfig, FlaxAutoModelForSeq2SeqLM,
                          FlaxEncoderDecoderModel, GPT2Config)

from script_runner import ROOT, read_json, read_metrics, run_script
from utils.models import compat
from utils.models.loading import TASK_MODEL_TYPES, init_in_one_program

DATA = os.path.join(ROOT, "data", "summarization")
SENTENCEPIECE_STYLE = os.path.join(DATA, "tokenizer")  # pad 0, eos 1, no bos
BPE = os.path.join(ROOT, "data", "lm", "tokenizer")  # <s> 0, <pad> 1, </s> 2
TINY_BART_LIKE = ("d_model=16,encoder_layers=1,decoder_layers=1,encoder_attention_heads=2,decoder_attention_heads=2,"
                  "encoder_ffn_dim=32,decoder_ffn_dim=32,max_position_embeddings=64,dropout=0.0")
TINY_T5_LIKE = "d_model=16,d_ff=32,num_layers=1,num_decoder_layers=1,num_heads=2,d_kv=8,dropout_rate=0.0"
# family: (overrides, tokenizer, the id decoding starts from by the family's convention with that tokenizer)
FAMILIES = {
    "t5": (TINY_T5_LIKE, SENTENCEPIECE_STYLE, 0),  # pad
    "mt5": (TINY_T5_LIKE, SENTENCEPIECE_STYLE, 0),
    "longt5": (TINY_T5_LIKE, SENTENCEPIECE_STYLE, 0),
    "pegasus": (TINY_BART_LIKE, SENTENCEPIECE_STYLE, 0),
    "marian": (TINY_BART_LIKE, SENTENCEPIECE_STYLE, 0),
    "bart": (TINY_BART_LIKE, BPE, 2),  # eos
    "mbart": (TINY_BART_LIKE, BPE, 2),  # the summaries' last token, eos
    "blenderbot": (TINY_BART_LIKE, BPE, 0),  # bos
    "blenderbot-small": (TINY_BART_LIKE, BPE, 0),
    "encoder-decoder": (None, BPE, 0),  # the decoder's bos
}
BEAMS = {"encoder-decoder": 2}
TEST_EXAMPLES = 12  # with 8 devices x 1: two generate batches, the second padded
RESULT_KEYS = ("loss", "rouge1", "rouge2", "rougeL", "rougeLsum", "gen_len")


def test_every_claimed_family_is_covered():
    assert set(FAMILIES) == set(TASK_MODEL_TYPES["seq2seq"])


def tiny_encoder_decoder_config(path):
    """A tiny BERT encoder and GPT-2 decoder (their vocabularies and ids come from the tokenizer)."""
    encoder = BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    decoder = GPT2Config(n_embd=16, n_layer=1, n_head=2, n_inner=32, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)
    EncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder).save_pretrained(path)
    return path


def train_evaluate_predict(family, tmp):
    overrides, tokenizer, _ = FAMILIES[family]
    model = (["--config_name", tiny_encoder_decoder_config(tmp / "config")] if family == "encoder-decoder"
             else ["--model_type", family, "--config_overrides", overrides])
    # 64 examples / (2 per device x 8 devices) = 4 steps per epoch, 2 epochs; label smoothing in every
    # family's loss.
    return run_script("run_summarization_flax.py", model + [
        "--tokenizer_name", tokenizer, "--train_file", os.path.join(DATA, "train.jsonl"),
        "--validation_file", os.path.join(DATA, "validation.jsonl"), "--test_file", os.path.join(DATA, "test.jsonl"),
        "--max_train_samples", 64, "--max_eval_samples", 8, "--max_predict_samples", TEST_EXAMPLES,
        "--max_source_length", 32, "--max_target_length", 8, "--do_train", "--do_eval", "--do_predict",
        "--predict_with_generate", "--num_beams", BEAMS.get(family, 1), "--per_device_train_batch_size", 2,
        "--per_device_eval_batch_size", 1, "--learning_rate", 1e-2, "--num_train_epochs", 2, "--logging_steps", 1,
        "--label_smoothing_factor", 0.1,
        "--output_dir", tmp / "out", "--compilation_cache_dir", "none"])


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """{family: future (output dir, finished run)} for the families this session selected, two runs at a
    time: a run compiles on about one core."""
    selected = [item.callspec.params["family"] for item in request.session.items  # test_family's cases
                if item.module is request.module and hasattr(item, "callspec")]

    def run(family):
        tmp = tmp_path_factory.mktemp(family)
        return tmp / "out", train_evaluate_predict(family, tmp)

    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {family: pool.submit(run, family) for family in selected}


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family(family, runs):
    """Trains (the loss falls), evaluates and predicts with ROUGE, one summary per test example, and
    exports a model that reloads with the tokenizer's vocabulary and the family's decoder start."""
    out, result = runs[family].result()
    assert result.returncode == 0, result.stderr[-3000:]

    assert all(f"eval_{key}" in read_json(out / "eval_results.json") for key in RESULT_KEYS)
    assert all(f"test_{key}" in read_json(out / "test_results.json") for key in RESULT_KEYS)
    assert len((out / "generated_predictions.txt").read_text().splitlines()) == TEST_EXAMPLES
    train = read_metrics(out, "train")
    assert [row["step"] for row in train] == list(range(1, 9))
    assert train[-1]["loss"] < train[0]["loss"]

    compat.apply()  # the T5 family's clip shim
    # Read with the shapes the config gives (transformers would first draw a fresh model op by op): a composed
    # model is built only with weights, drawn here in one program.
    if family == "encoder-decoder":
        with init_in_one_program(FlaxEncoderDecoderModel):
            reloaded = FlaxAutoModelForSeq2SeqLM.from_pretrained(out)
    else:
        reloaded, _ = FlaxAutoModelForSeq2SeqLM.from_pretrained(out, _do_init=False)
    config = reloaded.config
    assert config.model_type == family
    _, tokenizer, decoder_start = FAMILIES[family]
    parts = [config.encoder, config.decoder] if family == "encoder-decoder" else [config]
    assert [part.vocab_size for part in parts] == [len(AutoTokenizer.from_pretrained(tokenizer))] * len(parts)
    assert config.decoder_start_token_id == decoder_start
    assert reloaded.generation_config.decoder_start_token_id == decoder_start
