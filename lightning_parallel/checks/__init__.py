"""Checks that run before any process group exists, the same on every rank: the launch (allocation,
layout) and the model (can it be split as asked, can it train that way); and the setup checks that
run the user's step once on the split model, agreeing on the outcome in one collective (the TP
split's values, the sequence split of context parallelism)."""
