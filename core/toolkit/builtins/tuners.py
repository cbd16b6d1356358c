"""Core built-in plugin: tuners (filled in by the engine work)."""
