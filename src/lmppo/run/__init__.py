"""The run folder: atomic storage, the run lock, file ownership, checkpoints and the exported model."""
