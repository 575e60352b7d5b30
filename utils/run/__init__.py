"""A run from its first check to its last file, the spine every script shares: the checks before any work
(`preflight`), set-up and the training plan (`setup`), the steps built from a script's loss and the run's
bookkeeping (`spine`), the loop's mechanics (`loop`) and a streamed run's data (`stream_feed`), every
file a run writes (`run_directory`, `model_card`, `logs`), the optimizer (`optim`), performance
instruments (`perf`) and pushing to the hub (`hub_push`).

The top wing: it may import every other; none imports it.
"""
