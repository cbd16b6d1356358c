"""Core built-in plugin: callbacks (filled in by the engine work)."""
