"""Causal language modelling (`run_clm_flax.py`): next-token loss and perplexity."""

from tasks import Task

TASK = Task("causal-lm", "text-generation", widget="prompt")
