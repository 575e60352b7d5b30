"""Sentence and sentence-pair classification and regression (`run_flax_glue.py`)."""

from tasks import Task

TASK = Task("text-classification", "text-classification", outputs=("predict_results*.txt",), widget="text")
