"""The models and their weights: configs, tokenizers and models loaded or made from a config (`loading`),
pretrained weights in every checkpoint format (`weights`), a Flax export written leaf by leaf
(`flax_msgpack`), low-rank adapters (`lora`), gradient checkpointing and scanned layer stacks (`remat`,
`layer_scan`), rotary angles (`rotary`), transformers' Flax rotary decoders' positions (`decoder_positions`), the
project's own decoder family (`decoders`) and its PyTorch-named safetensors checkpoints (`hub_checkpoint`), and
the version shims (`compat`).

Imports `utils.base`, `utils.kernels` and `utils.layout` (where fresh weights are placed).
"""
