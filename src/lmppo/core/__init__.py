"""Pure-torch math of PPO for language models: tensors in, tensors out, no I/O, no config objects."""
