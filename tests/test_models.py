"""utils/models/loading.py: configs from model_type (+ overrides), task checks, vocab fitting, offline failures."""

import importlib
import inspect
import logging
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (BertConfig, EncoderDecoderConfig, FlaxAutoModelForSeq2SeqLM, GPT2Config,
                          PreTrainedTokenizerFast, T5Config)

from tests.jaxprs import equations
from utils.base.arguments import ModelArguments
from utils.base.errors import UsageError
from utils.layout.layouts import DataParallel, FullySharded, finished
from utils.models import compat
from utils.models.loading import (DECODER_START_TOKENS, TASK_MODEL_TYPES, decoder_input_ids, fit_config_to_tokenizer,
                                  fit_length, load_config, load_model, load_tokenizer, max_positions)

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran"]


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def test_load_config_from_model_type_with_overrides():
    args = ModelArguments(model_type="t5", config_overrides="d_model=16, num_layers=1,dropout_rate=0.25,"
                                                            "tie_word_embeddings=false,feed_forward_proj=gated-gelu")
    config = load_config(args, task="seq2seq")
    assert config.model_type == "t5"
    assert config.d_model == 16 and config.num_layers == 1 and isinstance(config.num_layers, int)
    assert config.dropout_rate == 0.25 and config.tie_word_embeddings is False
    assert config.feed_forward_proj == "gated-gelu"
    assert load_config(ModelArguments(model_type="gpt2"), task="causal-lm").model_type == "gpt2"


@pytest.mark.parametrize("overrides, message", [
    ("d_model=16,no_such_key=3", "t5 config has no attribute 'no_such_key'"),
    ("d_model=big", r"d_model='big' is not a int"),
    ("d_model", r"item 'd_model' is not key=value"),
])
def test_bad_overrides(overrides, message):
    with pytest.raises(UsageError, match=message):
        load_config(ModelArguments(model_type="t5", config_overrides=overrides), task="seq2seq")


def test_unknown_model_type_lists_valid_ones():
    with pytest.raises(UsageError, match=r"unknown --model_type 't6': use one of .*\bt5\b") as info:
        load_config(ModelArguments(model_type="t6"), task="seq2seq")
    assert "bart" in str(info.value) and "gpt2" not in str(info.value)


@pytest.mark.parametrize("model_type, task", [("bert", "seq2seq"), ("t5", "causal-lm"), ("gpt2", "masked-lm")])
def test_model_type_the_task_cannot_train(model_type, task):
    with pytest.raises(UsageError, match=rf"model type '{model_type}' cannot be trained by this script \({task}\)"):
        load_config(ModelArguments(model_type=model_type), task=task)


def test_no_model_at_all():
    with pytest.raises(UsageError, match="no model"):
        load_config(ModelArguments(), task="seq2seq")


def test_local_config_dir_and_overrides(tmp_path):
    T5Config(d_model=24, num_layers=2).save_pretrained(tmp_path)
    config = load_config(ModelArguments(config_name=str(tmp_path), config_overrides="num_layers=1"), "seq2seq")
    assert config.d_model == 24 and config.num_layers == 1
    with pytest.raises(UsageError, match=r"--config_overrides would change num_layers from 2 to 1 in the config of "
                                         r".*: overrides apply only when training from scratch"):
        load_config(ModelArguments(model_name_or_path=str(tmp_path), config_overrides="num_layers=1"), "seq2seq")


def test_overrides_a_pretrained_config_already_has_are_accepted(tmp_path):
    """A config file shared by training and evaluation keeps its overrides when it loads the trained model."""
    T5Config(d_model=24, num_layers=2).save_pretrained(tmp_path)
    config = load_config(ModelArguments(model_name_or_path=str(tmp_path), config_overrides="d_model=24,num_layers=2"),
                         "seq2seq")
    assert config.d_model == 24 and config.num_layers == 2


def test_nonexistent_local_model_path_fails_fast(tmp_path):
    start = time.monotonic()
    with pytest.raises(UsageError, match=r"could not load model config .*nope"):
        load_config(ModelArguments(model_name_or_path=str(tmp_path / "nope")), task="seq2seq")
    with pytest.raises(UsageError, match=r"could not load tokenizer .*nope"):
        load_tokenizer(ModelArguments(model_name_or_path=str(tmp_path / "nope")))
    assert time.monotonic() - start < 10


def test_fit_config_from_scratch(tokenizer):
    args = ModelArguments(model_type="t5", config_overrides="d_model=16")
    config = fit_config_to_tokenizer(load_config(args, "seq2seq"), tokenizer, args)
    assert config.vocab_size == len(tokenizer) == 11
    assert config.pad_token_id == 1 and config.eos_token_id == 2


def test_fit_config_keeps_explicit_overrides(tokenizer):
    args = ModelArguments(model_type="t5", config_overrides="vocab_size=64,pad_token_id=0")
    config = fit_config_to_tokenizer(load_config(args, "seq2seq"), tokenizer, args)
    assert config.vocab_size == 64 and config.pad_token_id == 0 and config.eos_token_id == 2


def test_fit_config_pretrained_vocab_must_cover_tokenizer(tokenizer, tmp_path):
    args = ModelArguments(model_name_or_path=str(tmp_path))
    small = T5Config(vocab_size=5, pad_token_id=0)
    with pytest.raises(UsageError, match="the tokenizer has 11 tokens but the model only 5"):
        fit_config_to_tokenizer(small, tokenizer, args)
    big = fit_config_to_tokenizer(T5Config(vocab_size=32, pad_token_id=0), tokenizer, args)
    assert big.vocab_size == 32 and big.pad_token_id == 0  # a pretrained model keeps its own


def test_load_tokenizer_from_local_dir(tokenizer, tmp_path):
    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(ModelArguments(tokenizer_name=str(tmp_path)))
    assert len(loaded) == 11 and loaded("the cat ran")["input_ids"] == [3, 4, 10]
    with pytest.raises(UsageError, match="no tokenizer"):
        load_tokenizer(ModelArguments(model_type="t5"))


@pytest.mark.parametrize("model_type, overrides, limit", [
    ("bart", "max_position_embeddings=128", 128),
    ("gpt2", "n_positions=64", 64),  # gpt2 calls it n_positions
    ("roberta", "max_position_embeddings=514,pad_token_id=1", 512),  # positions start after the padding id
    ("t5", "", None),  # relative positions
    ("bloom", "", None),  # ALiBi
])
def test_max_positions(model_type, overrides, limit):
    task = "seq2seq" if model_type in ("bart", "t5") else "masked-lm" if model_type == "roberta" else "causal-lm"
    config = load_config(ModelArguments(model_type=model_type, config_overrides=overrides or None), task)
    assert max_positions(config) == limit


def test_fit_length(caplog):
    logger = logging.getLogger("flaxtune.test")
    with caplog.at_level(logging.WARNING):
        assert fit_length(1024, 128, "max_source_length", logger) == 128
        assert fit_length(64, 128, "max_target_length", logger) == 64
        assert fit_length(1024, None, "block_size", logger) == 1024  # no limit
    assert caplog.messages == ["--max_source_length 1024 is more than the model's 128 positions: using 128"]


@pytest.mark.parametrize("layout", [DataParallel(), FullySharded(8)], ids=["dp", "fsdp"])
@pytest.mark.parametrize("dtype, param_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                                ("bfloat16", "bfloat16")])
def test_load_model_compute_and_parameter_dtypes(tokenizer, dtype, param_dtype, layout):
    compat.apply()  # the T5 clip shim
    args = ModelArguments(model_type="t5", config_overrides="d_model=64,d_ff=256,num_layers=1,num_heads=2,d_kv=8",
                          dtype=dtype, param_dtype=param_dtype)
    config = fit_config_to_tokenizer(load_config(args, "seq2seq"), tokenizer, args)
    model, params = load_model(FlaxAutoModelForSeq2SeqLM, args, config, 0, layout)
    params = finished(params)  # dp's fresh weights are made on a background thread
    assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {jnp.dtype(param_dtype)}
    ffn = params["encoder"]["block"]["0"]["layer"]["1"]["DenseReluDense"]["wi"]["kernel"]  # 64 x 256
    assert {shard.data.shape for shard in ffn.addressable_shards} == {(64, 256 // layout.batch_shards)}
    ids = np.ones((1, 4), np.int32)
    logits = model(ids, decoder_input_ids=ids, params=layout.params_to_host(params)).logits
    assert logits.dtype == jnp.dtype(dtype) and bool(jnp.isfinite(logits).all())


def test_fresh_weights_come_from_one_program_whatever_the_seed(tokenizer, monkeypatch):
    """dp's fresh weights: the seed's key is their program's argument (the compilation cache serves it to a run
    with another seed), and the weights are still the seed's, those transformers draws for it op by op."""
    compat.apply()  # the T5 clip shim
    programs = []
    on_host = DataParallel._on_host

    class Recorded:  # `_on_host`'s jitted init, the text of each program it lowers recorded
        def __init__(self, init):
            self.jitted = on_host(init)

        def lower(self, *args):
            lowered = self.jitted.lower(*args)
            programs.append(lowered.as_text())
            return lowered

    monkeypatch.setattr(DataParallel, "_on_host", staticmethod(Recorded))
    args = ModelArguments(model_type="t5", config_overrides="d_model=16,d_ff=32,num_layers=1,num_heads=2,d_kv=8")
    config = fit_config_to_tokenizer(load_config(args, "seq2seq"), tokenizer, args)
    params = {seed: finished(load_model(FlaxAutoModelForSeq2SeqLM, args, config, seed, DataParallel())[1])
              for seed in (0, 1)}
    assert len(programs) == 2 and programs[0] == programs[1]
    drawn = FlaxAutoModelForSeq2SeqLM.from_config(config, seed=1).params
    jax.tree_util.tree_map(lambda ours, theirs: np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7),
                           params[1], drawn)
    assert not np.allclose(params[0]["shared"]["embedding"], params[1]["shared"]["embedding"])


def test_pretrained_weights_load_through_the_host_and_missing_ones_are_made(tokenizer, tmp_path):
    """A saved model loads into host memory then its layout; a head the checkpoint lacks is
    initialised fresh instead of left out."""
    compat.apply()
    args = ModelArguments(model_type="t5", config_overrides="d_model=64,d_ff=256,num_layers=1,num_heads=2,d_kv=8")
    config = fit_config_to_tokenizer(load_config(args, "seq2seq"), tokenizer, args)
    model, params = load_model(FlaxAutoModelForSeq2SeqLM, args, config, 0, DataParallel())
    params = finished(params)
    saved = {key: value for key, value in params.items() if key != "lm_head"} if "lm_head" in params else params
    config.tie_word_embeddings = False  # T5 v1.1 style: a separate head the checkpoint does not hold
    model.save_pretrained(tmp_path, params=saved)
    loaded_args = ModelArguments(model_name_or_path=str(tmp_path))
    model, loaded = load_model(FlaxAutoModelForSeq2SeqLM, loaded_args, config, 0, FullySharded(8))
    assert "lm_head" in loaded
    np.testing.assert_array_equal(np.asarray(loaded["shared"]["embedding"]), np.asarray(params["shared"]["embedding"]))


# ----------------------------------------------------------------------------------------------
# Every sequence-to-sequence family from scratch: ids fitted to the tokenizer, decoder inputs
# ----------------------------------------------------------------------------------------------
SEQ2SEQ_FAMILIES = list(TASK_MODEL_TYPES["seq2seq"])


def summary_tokenizer(with_bos):
    """Targets end with </s>; BPE-style (<s> 0, <pad> 1, </s> 2, <s> also cls) or SentencePiece-style
    (<pad> 0, </s> 1, no bos)."""
    specials = ["<s>", "<pad>", "</s>", "<unk>"] if with_bos else ["<pad>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "<s> $A </s>" if with_bos else "$A </s>"
    tok.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[(t, vocab[t]) for t in ("<s>", "</s>") if t in vocab])
    extra = dict(bos_token="<s>", cls_token="<s>") if with_bos else {}
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>",
                                   **extra)


def from_scratch_config(family, tokenizer, overrides=None):
    if family == "encoder-decoder":  # bert2gpt2: GPT-2's default ids (50256) lie far outside a tiny vocabulary
        config = EncoderDecoderConfig.from_encoder_decoder_configs(BertConfig(), GPT2Config())
        args = ModelArguments(config_name="tiny-encoder-decoder", config_overrides=overrides)
    else:
        args = ModelArguments(model_type=family, config_overrides=overrides)
        config = load_config(args, "seq2seq")
    return fit_config_to_tokenizer(config, tokenizer, args)


def config_parts(config):
    return [config, config.encoder, config.decoder] if config.model_type == "encoder-decoder" else [config]


# The token each family starts decoding from with a tokenizer that has bos, and with one that has not.
DECODER_START_ROLE = {
    "t5": ("pad", "pad"), "mt5": ("pad", "pad"), "longt5": ("pad", "pad"), "pegasus": ("pad", "pad"),
    "marian": ("pad", "pad"), "bart": ("eos", "eos"), "mbart": ("eos", "eos"),  # the summaries' last token
    "blenderbot": ("bos", "pad"), "blenderbot-small": ("bos", "pad"), "encoder-decoder": ("bos", "pad"),
}


@pytest.mark.parametrize("with_bos", [True, False], ids=["bpe-style", "sentencepiece-style"])
@pytest.mark.parametrize("family", SEQ2SEQ_FAMILIES)
def test_from_scratch_ids_follow_the_tokenizer(family, with_bos):
    tokenizer = summary_tokenizer(with_bos)
    config = from_scratch_config(family, tokenizer)
    role = DECODER_START_ROLE[family][0 if with_bos else 1]
    assert config.decoder_start_token_id == getattr(tokenizer, f"{role}_token_id")
    for part in config_parts(config):
        assert (part.pad_token_id, part.eos_token_id, part.bos_token_id) == (
            tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id)
        for name in ("decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id"):
            assert getattr(part, name) is None or 0 <= getattr(part, name) < len(tokenizer), name
        if part.forced_eos_token_id is not None:  # bart, mbart, marian, pegasus, blenderbot: end on eos
            assert part.forced_eos_token_id == tokenizer.eos_token_id
    vocabularies = [config.encoder, config.decoder] if family == "encoder-decoder" else [config]
    assert [part.vocab_size for part in vocabularies] == [len(tokenizer)] * len(vocabularies)


def test_decoder_start_conventions_match_transformers_defaults():
    """Where a family's own default config names a decoder start id, it is that family's token by
    `DECODER_START_TOKENS` (t5 and longt5 have none, mbart none by design, encoder-decoder no defaults)."""
    checked = []
    for family in SEQ2SEQ_FAMILIES:
        if family == "encoder-decoder":
            continue
        default = load_config(ModelArguments(model_type=family), "seq2seq")
        if default.decoder_start_token_id is not None:
            role = DECODER_START_TOKENS[family][0]
            assert default.decoder_start_token_id == getattr(default, f"{role}_token_id"), family
            checked.append(family)
    assert sorted(checked) == ["bart", "blenderbot", "blenderbot-small", "marian", "mt5", "pegasus"]


def test_mbart_starts_from_the_token_every_summary_ends_with():
    """mBART's decoder inputs begin with the summary's last token: a tokenizer that ends summaries with a
    language code starts decoding from it."""
    tokenizer = summary_tokenizer(with_bos=False)
    language = tokenizer.convert_tokens_to_ids("cat")  # stands in for a code like en_XX
    tokenizer._tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s> cat", special_tokens=[("</s>", tokenizer.eos_token_id), ("cat", language)])
    assert from_scratch_config("mbart", tokenizer).decoder_start_token_id == language


def test_from_scratch_overrides_stay():
    config = from_scratch_config("bart", summary_tokenizer(True), "decoder_start_token_id=5,forced_eos_token_id=4")
    assert config.decoder_start_token_id == 5 and config.forced_eos_token_id == 4


def test_an_id_the_tokenizer_lacks_and_the_vocabulary_cannot_hold(tokenizer):
    no_pad = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, unk_token="<unk>",
                                     eos_token="</s>")
    with pytest.raises(UsageError, match=r"the marian config names ids outside the tokenizer's 11 tokens "
                                         r"\(pad_token_id=58100, decoder_start_token_id=58100\)"):
        from_scratch_config("marian", no_pad)
    assert from_scratch_config("bart", tokenizer).bos_token_id is None  # not bart's default 0, <unk> here


def test_pretrained_encoder_decoder_vocabularies_must_cover_the_tokenizer(tokenizer):
    config = EncoderDecoderConfig.from_encoder_decoder_configs(BertConfig(vocab_size=32), GPT2Config(vocab_size=8))
    with pytest.raises(UsageError, match="the tokenizer has 11 tokens but the model only 8"):
        fit_config_to_tokenizer(config, tokenizer, ModelArguments(model_name_or_path="some/model"))


def family_shift(family):
    module = importlib.import_module(f"transformers.models.{family.replace('-', '_')}."
                                     f"modeling_flax_{family.replace('-', '_')}")
    return module.shift_tokens_right


@pytest.mark.parametrize("family", [f for f in SEQ2SEQ_FAMILIES if f != "encoder-decoder"])
def test_decoder_inputs_are_the_familys_own(family):
    tokenizer = summary_tokenizer(with_bos=True)
    config = from_scratch_config(family, tokenizer)
    pad, eos, cat = config.pad_token_id, config.eos_token_id, tokenizer.convert_tokens_to_ids("cat")
    # Ended by eos, by a language code (mBART's tokenizers: "... </s> en_XX"), unended (truncated).
    labels = np.array([[0, 5, 6, eos, pad, pad], [0, 7, eos, cat, -100, -100], [0, 5, 6, 7, 8, 9]])
    shift = family_shift(family)
    takes_start = "decoder_start_token_id" in inspect.signature(shift).parameters
    theirs = shift(labels, pad, config.decoder_start_token_id) if takes_start else shift(labels, pad)
    np.testing.assert_array_equal(decoder_input_ids(labels, config), np.asarray(theirs))


def test_encoder_decoder_decoder_inputs_start_from_its_start_id():
    config = from_scratch_config("encoder-decoder", summary_tokenizer(with_bos=True))  # bos 0, pad 1, eos 2
    labels = np.array([[0, 5, 6, 2, -100], [0, 7, 8, 9, 2]])
    np.testing.assert_array_equal(decoder_input_ids(labels, config), [[0, 0, 5, 6, 2], [0, 0, 7, 8, 9]])


def test_fresh_encoder_decoder(tokenizer):
    """FlaxEncoderDecoderModel refuses to be built uninitialized: it still gets fresh weights, from the seed."""
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32),
        GPT2Config(n_embd=16, n_layer=1, n_head=2, n_inner=32))
    args = ModelArguments(config_name="tiny-encoder-decoder")
    config = fit_config_to_tokenizer(config, tokenizer, args)
    model, params = load_model(FlaxAutoModelForSeq2SeqLM, args, config, 0, DataParallel())
    _, again = load_model(FlaxAutoModelForSeq2SeqLM, args, config, 0, DataParallel())
    _, other = load_model(FlaxAutoModelForSeq2SeqLM, args, config, 1, DataParallel())
    params, again, other = finished(params), finished(again), finished(other)
    embedding = ("decoder", "transformer", "wte", "embedding")

    def leaf(params):
        for key in embedding:
            params = params[key]
        return np.asarray(params)

    assert leaf(params).shape == (len(tokenizer), 16)
    np.testing.assert_array_equal(leaf(params), leaf(again))
    assert not np.array_equal(leaf(params), leaf(other))
    ids = np.full((1, 4), 3, np.int32)
    logits = model(ids, decoder_input_ids=ids, params=params).logits
    assert logits.shape == (1, 4, len(tokenizer)) and bool(jnp.isfinite(logits).all())


def test_gradient_checkpointing_where_the_family_has_it(tokenizer):
    from transformers import T5Config

    from utils.models.loading import enable_gradient_checkpointing

    compat.apply()  # the T5 clip shim
    t5 = FlaxAutoModelForSeq2SeqLM.from_config(T5Config(d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8),
                                               _do_init=False)
    enable_gradient_checkpointing(t5)
    assert t5.module.gradient_checkpointing


def test_every_policy_the_flag_accepts_is_one_utils_remat_knows():
    """utils.base.arguments checks --gradient_checkpointing_policy's names (it may not import utils.models.remat, a
    wing above it)."""
    from utils.models import remat
    from utils.base.arguments import CHECKPOINTING_POLICIES

    assert set(CHECKPOINTING_POLICIES) == set(remat.POLICIES)


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_gradient_checkpointing_recomputes_each_layer_but_what_its_policy_keeps(family):
    """GPT-2 and Llama checkpoint each layer through `utils.models.remat` (transformers lacks it for them), BERT
    through transformers' own checkpointing, and every family through `utils.models.remat` under the `kernels`
    policy; the attention through the kernels (Pallas' interpreter), as on TPUs. The gradients (dropout on)
    are the plain model's. The backward pass runs the layers' products again under both policies (more than
    the plain model's); `nothing` runs each layer's forward kernel again too, `kernels` keeps its outputs (as
    many kernel calls as the plain model's)."""
    from transformers import (BertConfig, FlaxBertForMaskedLM, FlaxGPT2LMHeadModel, FlaxLlamaForCausalLM,
                              GPT2Config, LlamaConfig)

    from utils.kernels import model_attention
    from utils.models.loading import enable_gradient_checkpointing

    def calls(jaxpr):  # of every primitive, inside checkpoints and other nested programs too
        return Counter(name for _, name in equations(jaxpr.jaxpr))

    layers, length = 2, model_attention.BLOCK  # one kernel tile
    config, model_class = {
        "gpt2": (GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=64, n_positions=length),
                 FlaxGPT2LMHeadModel),
        "llama": (LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                              num_key_value_heads=2, vocab_size=64), FlaxLlamaForCausalLM),
        "bert": (BertConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                            vocab_size=64, max_position_embeddings=length), FlaxBertForMaskedLM)}[family]
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, length)))
    rng = jax.random.PRNGKey(1)  # dropout on: the recomputed layers draw the same masks

    def model_with(policy):
        model = model_class(config, _do_init=False)
        if policy:
            enable_gradient_checkpointing(model, policy)
        model_attention.use_attention_kernels(model, interpret=True)  # after checkpointing, as the spine does
        return model

    def grad_fn(model):
        return jax.grad(lambda params, rng: model(ids, params=params, dropout_rng=rng, train=True).logits.mean())

    plain = model_with(None)
    # Without their own init (op by op, slow): one compiled init gives every model the same weights.
    params = jax.jit(plain.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, 8))
    expected = jax.jit(grad_fn(plain))(params, rng)
    counted = {None: calls(jax.make_jaxpr(grad_fn(plain))(params, rng))}
    for policy in ("nothing", "kernels"):
        checkpointed = model_with(policy)
        got = jax.jit(grad_fn(checkpointed))(params, rng)
        for a, b in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
            # Recomputing the same float32 ops in the backward pass may reassociate a sum: last-bit differences.
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
        jaxpr = jax.make_jaxpr(grad_fn(checkpointed))(params, rng)
        counted[policy] = calls(jaxpr)
        if family != "bert" or policy == "kernels":  # utils.models.remat: one checkpointed region per layer
            assert str(jaxpr).count("remat") == layers
        if policy == "kernels":  # the flash or splash kernel's: each row's logsumexp as one float, not 128 lanes
            kept = [tuple(var.aval.shape) for eqn in jaxpr.jaxpr.eqns if eqn.primitive.name == "remat2"
                    for var in eqn.invars]
            heads = config.num_attention_heads
            assert (2, heads, length) in kept and (2, heads, length, 128) not in kept
    products, kernels = "dot_general", "pallas_call"
    assert counted[None][kernels] >= 2 * layers  # a forward and a backward kernel per layer at least
    assert counted["nothing"][products] > counted[None][products] < counted["kernels"][products]
    assert counted["nothing"][kernels] == counted[None][kernels] + layers == counted["kernels"][kernels] + layers


def test_an_encoder_decoder_refusing_to_be_built_without_weights_draws_them_in_one_program():
    """FlaxEncoderDecoderModel refuses `_do_init=False`: built from its config it draws its weights, which
    `load_model` then replaces, so they are drawn in one compiled program rather than op by op."""
    from transformers import BertConfig, EncoderDecoderConfig, FlaxAutoModelForSeq2SeqLM, FlaxEncoderDecoderModel

    from fresh_draws import assert_drawn_in_one_program
    from utils.models import loading as model_loading

    part = dict(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    config = EncoderDecoderConfig.from_encoder_decoder_configs(
        BertConfig(**part), BertConfig(**part, is_decoder=True, add_cross_attention=True))

    def build():
        model = model_loading._from_config(FlaxAutoModelForSeq2SeqLM, config, dict(seed=0))
        assert isinstance(model, FlaxEncoderDecoderModel)
        return model.params

    assert_drawn_in_one_program(FlaxEncoderDecoderModel, config, 0, build)
