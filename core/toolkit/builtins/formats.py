"""Core built-in plugin: formats (filled in by the engine work)."""
