"""Training: the PPO loop, its assembly from a config, callbacks, metrics and progress."""
