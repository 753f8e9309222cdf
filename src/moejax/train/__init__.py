"""Training: experiment config, optimizer, train step, checkpointing, metrics, the loop."""
