"""Core built-in plugin: strategies (filled in by the engine work)."""
