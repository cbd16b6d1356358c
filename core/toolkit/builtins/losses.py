"""Core built-in plugin: losses (filled in by the engine work)."""
