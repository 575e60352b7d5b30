"""Checkpoints: the full train state saved, restored and found on disk (`store`), when a run saves and the
save itself (`saving`), resuming (`resume`: which checkpoint, whether this run may continue it), and a
clean stop on SIGTERM or Ctrl-C (`preemption`).

Imports `utils.base`, `utils.layout` and `utils.models` (a LoRA run's adapters are what it saves).
"""
