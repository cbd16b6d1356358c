"""Core built-in plugin: inference (filled in by the engine work)."""
