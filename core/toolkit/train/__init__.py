"""The training engine: distributed setup, label log-probs, optimizer/schedule, checkpoints, the run loop."""
