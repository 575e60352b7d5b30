"""Masked language modelling (`run_mlm_flax.py`): masked-token loss, accuracy and perplexity."""

from tasks import Task

TASK = Task("masked-lm", "fill-mask", widget="mask")
