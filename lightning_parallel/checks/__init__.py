"""Checks that run before any process group exists, the same on every rank: the launch (allocation,
layout) and the model (can it be split as asked, can it train that way)."""
