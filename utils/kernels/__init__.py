"""What runs inside a model's call on a TPU: hooks into a transformers Flax model's calls and layer stacks
(`hooks`), the flash attention kernel with its dropout drawn inside it (`flash_attention`), dropout masks
drawn by the chip (`chip_dropout`), a model's self-attention routed through the kernels
(`model_attention`), and the LM head's loss without full-vocabulary logits (`lm_head`). Each has a CPU
fallback (Pallas' interpreter or the stock computation).

Imports only `utils.base`.
"""
