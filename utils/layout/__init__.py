"""Where the train state lives and how a step runs: processes and devices (`devices`), the two layouts
`--sharding dp|fsdp` (`layouts`), token-weighted gradients and their micro-batches (`gradients`), a
step's device memory (`memory`) and the TPU compiler's plan without a TPU (`tpu_plan`).

Imports `utils.base` and `utils.kernels` (the hooks a layout splits a layer's gradients with).
"""
