"""The tiny rotary decoders whose PyTorch logits `make_decoder_logits.py` stores in `decoder_logits.json`,
and their weights: drawn from a seeded numpy generator by parameter name and shape, so the test
rebuilds exactly the weights PyTorch computed with (no weights stored, no torch needed)."""

import numpy as np

VOCAB = 32
_TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_GELU_TANH = dict(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh")

# name: (model type, config settings beyond _TINY, input lengths, greedy continuation checked too)
CASES = {
    "llama_theta": ("llama", dict(rope_theta=500000.0, max_position_embeddings=64), (12,), True),
    "llama_head_dim": ("llama", dict(head_dim=16, max_position_embeddings=64), (12,), True),
    "llama_linear": ("llama", dict(rope_theta=20000.0, max_position_embeddings=64,
                                   rope_scaling={"rope_type": "linear", "factor": 4.0}), (12,), False),
    # within max_position_embeddings, as far as the Flax model runs: the base is rope_theta's
    "llama_dynamic": ("llama", dict(rope_theta=20000.0, max_position_embeddings=16,
                                    rope_scaling={"rope_type": "dynamic", "factor": 2.0}), (12,), False),
    "llama_yarn": ("llama", dict(rope_theta=20000.0, max_position_embeddings=64,
                                 rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 16}), (12,), False),
    "llama_yarn_mscale": ("llama", dict(rope_theta=20000.0, max_position_embeddings=64,
                                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0,
                                                      "beta_slow": 2.0, "mscale": 2.0, "mscale_all_dim": 1.0,
                                                      "truncate": False}), (12,), False),
    # heads of 8: wavelengths 6.3, 167, 4440, 118000 against 64 (high) and 256 (low): kept, blended, divided
    "llama_llama3": ("llama", dict(rope_theta=500000.0, max_position_embeddings=512,
                                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 256}),
                     (12,), True),
    # 12 positions pass the pretrained 8 (long factors), 6 do not (short ones)
    "llama_longrope": ("llama", dict(rope_theta=30000.0, max_position_embeddings=32, original_max_position_embeddings=8,
                                     rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0],
                                                   "long_factor": [1.0, 2.0, 4.0, 8.0]}), (12, 6), False),
    "mistral_no_window": ("mistral", dict(rope_theta=1000000.0, sliding_window=None, max_position_embeddings=64),
                          (12,), True),
    "mistral_window": ("mistral", dict(sliding_window=4, max_position_embeddings=64), (12,), True),
    "mistral_head_dim_yarn": ("mistral", dict(head_dim=16, rope_theta=1000000.0, sliding_window=None,
                                              max_position_embeddings=64,
                                              rope_scaling={"rope_type": "yarn", "factor": 2.0}), (12,), False),
    "gemma_theta": ("gemma", dict(head_dim=16, rope_theta=100000.0, max_position_embeddings=64, **_GELU_TANH),
                    (12,), True),
    "gemma_linear": ("gemma", dict(head_dim=8, rope_theta=20000.0, max_position_embeddings=64, **_GELU_TANH,
                                   rope_scaling={"rope_type": "linear", "factor": 2.0}), (12,), False),
}


def config_settings(name):
    model_type, settings, _, _ = CASES[name]
    return model_type, {**_TINY, **settings}


def numpy_weights(parameters, seed):
    """{PyTorch name: float32 array} for [(name, shape)]: matrices with large enough entries that
    attention is sharp (positions then move the logits visibly), norm weights near 1."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in sorted(parameters):
        if len(shape) == 1:
            weights[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            weights[name] = (rng.standard_normal(shape) * 2.0 / np.sqrt(shape[-1])).astype(np.float32)
    return weights


def input_ids(seed, lengths):
    """Two rows of each length in `lengths`, and the prompt a greedy continuation starts from."""
    rng = np.random.default_rng(seed + 1)
    return [rng.integers(3, VOCAB, size=(2, length)).tolist() for length in lengths], rng.integers(3, VOCAB, 5).tolist()
