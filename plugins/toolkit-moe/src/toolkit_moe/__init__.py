"""toolkit-moe."""
