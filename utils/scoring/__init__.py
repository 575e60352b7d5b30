"""What a step sums and an evaluation reports: token-summed losses (`losses`) and the metrics computed
offline, ROUGE, BLEU, perplexity and token-weighted means (`metrics`).

Imports `utils.kernels` (the LM head's chunked loss) and nothing above it.
"""
