"""Shared helpers for the flaxtune scripts. Nothing here imports a script."""
