"""The reference engine (a small torch model server) and the checkpoint writer behind it."""
