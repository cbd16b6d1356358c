"""DeepSpeed strategy plugin."""
