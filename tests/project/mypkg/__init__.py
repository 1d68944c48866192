"""The project's package: the training script imports it from beside it."""
