"""The tiny models whose PEFT adapters make_lora_peft_listing.py lists, shared with tests/test_lora.py:
(model type, config settings, Auto class suffix, PEFT task type, PEFT target_modules naming the same
layers as flaxtune's default `--lora_target attention`)."""

RANK, ALPHA = 4, 8

CASES = {
    "gpt2": ("gpt2", dict(n_embd=32, n_layer=2, n_head=2, vocab_size=99, n_positions=32), "CausalLM", "CAUSAL_LM",
             ["attn.c_attn", "attn.c_proj"]),
    "bert": ("bert", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
                          vocab_size=99, max_position_embeddings=32, num_labels=3),
             "SequenceClassification", "SEQ_CLS", ["query", "key", "value", "attention.output.dense"]),
    "llama": ("llama", dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=99, max_position_embeddings=32),
              "CausalLM", "CAUSAL_LM", ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "t5": ("t5", dict(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, vocab_size=99), "Seq2SeqLM",
           "SEQ_2_SEQ_LM", ["q", "k", "v", "o"]),
}
