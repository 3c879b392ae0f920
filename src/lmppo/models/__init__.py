"""Models: loading policy, value and reward models, their files, precision, attention, the reference, the optimizer."""
