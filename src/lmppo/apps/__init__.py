"""Applications: the `lmppo` command and its sub-commands (train, eval, plot, push, merge, warp)."""
