"""The tensor engine's worker half: a table of tensors by id, and the commands that fill it."""
