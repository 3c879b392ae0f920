"""Evaluation on held-out prompts: during training, `lmppo eval`, the end-of-run summary and `lmppo plot`."""
