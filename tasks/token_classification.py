"""Token classification: NER, POS, chunking (`run_flax_ner.py`)."""

from tasks import Task

TASK = Task("token-classification", "token-classification", outputs=("predictions.txt",), widget="text")
