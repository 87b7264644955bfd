"""Shared test helpers: fork-started gloo processes, parity records, models used by several areas."""
