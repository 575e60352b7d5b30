"""The ground floor of the engine: error types and the handler every script runs under (`errors`), the
arguments every script shares and their checks (`arguments`), reading them from a JSON config and flags
with a readable --help (`parsing`), and whether the Hugging Face hub answers (`hub_probe`).

Imports no other wing: every other wing may import it.
"""
