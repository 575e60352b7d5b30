"""The tiny decoders whose PyTorch transformers 5 logits `make_family_logits.py` stores in
`family_logits.json`, which tests/test_decoder_family.py compares the project's own family with.
Each case's settings are written the way older hub config.json files are (rope_theta, rope_scaling,
sliding_window_pattern...); the JSON also holds the config.json transformers 5 saves for it
(rope_parameters, layer_types), and the family must read both alike. Weights are drawn from a seeded
numpy generator by PyTorch name and shape (`decoder_cases.numpy_weights`): none are stored."""

import numpy as np

VOCAB = 48
_TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=64)
_GELU_TANH = dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")

# name: (model type, config settings beyond _TINY, input lengths); every case's greedy continuation is checked too
CASES = {
    # biases on q, k, v, o and the MLP; heads of 16 (not hidden / heads); tied embeddings
    "llama_biases_tied": ("llama", dict(head_dim=16, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
                                        rope_theta=500000.0), (12,)),
    "llama3_rope": ("llama", dict(rope_theta=500000.0, max_position_embeddings=512,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
                    (12,)),
    "llama_yarn": ("llama", dict(rope_theta=20000.0, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                   "original_max_position_embeddings": 16}), (12,)),
    # 12 positions past max_position_embeddings 8: the base grows with the call's longest position
    "llama_dynamic": ("llama", dict(rope_theta=20000.0, max_position_embeddings=8,
                                    rope_scaling={"rope_type": "dynamic", "factor": 2.0}), (12, 6)),
    "mistral_window": ("mistral", dict(sliding_window=4, rope_theta=1000000.0), (12,)),
    # three layers, the last two (from max_window_layers 1) with a window of 4
    "qwen2_window_layers": ("qwen2", dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=4,
                                          max_window_layers=1, rope_theta=1000000.0), (12,)),
    "qwen3_qk_norm": ("qwen3", dict(head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True), (12,)),
    "gemma": ("gemma", dict(head_dim=16, rope_theta=10000.0, **_GELU_TANH), (12,)),
    # caps small enough that these weights reach them; alternating sliding (window 4) and global layers
    "gemma2_capped": ("gemma2", dict(num_hidden_layers=4, head_dim=16, sliding_window=4, query_pre_attn_scalar=24,
                                     attn_logit_softcapping=5.0, final_logit_softcapping=3.0, **_GELU_TANH), (12,)),
    # two local layers for one global (pattern 3), local base 1e4, global 1e6 scaled linearly by 8
    "gemma3_local_global": ("gemma3_text", dict(num_hidden_layers=6, head_dim=16, sliding_window=4,
                                                sliding_window_pattern=3, query_pre_attn_scalar=16,
                                                rope_theta=1000000.0, rope_local_base_freq=10000.0,
                                                rope_scaling={"rope_type": "linear", "factor": 8.0}, **_GELU_TANH),
                            (12,)),
    # Phi-4-mini's shape: tied, 3/4 of each head rotated, longrope past the pretrained 8 positions (12) and not (6)
    "phi3_partial_longrope": ("phi3", dict(hidden_size=64, partial_rotary_factor=0.75, tie_word_embeddings=True,
                                           max_position_embeddings=32, original_max_position_embeddings=8,
                                           rope_theta=10000.0,
                                           rope_scaling={"rope_type": "longrope",
                                                         "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
                                                         "long_factor": [1.0, 2.0, 3.0, 4.0, 6.0, 8.0]}), (12, 6)),
    # Phi-3-mini's: untied, whole heads rotated, a window over every layer
    "phi3_window": ("phi3", dict(sliding_window=5, rope_theta=10000.0), (12,)),
}

# The cases written by the project's writer and loaded back by PyTorch transformers (make_family_logits.py).
EXPORTED = ("qwen3_qk_norm", "gemma2_capped", "phi3_partial_longrope")


def config_settings(name):
    model_type, settings, _ = CASES[name]
    return model_type, {**_TINY, **settings}


def hub_config(name):
    """The case's settings as an older hub config.json holds them (model_type included)."""
    model_type, settings = config_settings(name)
    return {"model_type": model_type, **settings}


def input_ids(seed, lengths):
    """Two rows of each length in `lengths`, the prompt a greedy continuation starts from, and a batch of
    two prompts (5 and 3 tokens) left-padded with id 0, with its attention mask."""
    rng = np.random.default_rng(seed + 1)
    rows = [rng.integers(3, VOCAB, size=(2, length)).tolist() for length in lengths]
    prompt = rng.integers(3, VOCAB, 5).tolist()
    short = rng.integers(3, VOCAB, 3).tolist()
    return rows, prompt, ([prompt, [0, 0] + short], [[1] * 5, [0, 0, 1, 1, 1]])
