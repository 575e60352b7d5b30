"""The models and their weights: configs, tokenizers and models loaded or made from a config (`loading`),
pretrained weights in every checkpoint format (`weights`), a Flax export written leaf by leaf
(`flax_msgpack`), low-rank adapters (`lora`), gradient checkpointing and scanned layer stacks (`remat`,
`layer_scan`), the rotary decoders' positions (`decoder_positions`) and the version shims (`compat`).

Imports `utils.base`, `utils.kernels` and `utils.layout` (where fresh weights are placed).
"""
