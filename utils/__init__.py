"""Shared helpers for the flaxtune scripts. Nothing here imports a script.

Importing the package notes the time: start-up ("first step done N s after start",
`utils.run.perf.seconds_since_start`) counts from here, so every script imports `utils` first, before its
heavy imports, which are part of its start-up.
"""

import time

IMPORTED_AT = time.monotonic()
