"""Core built-in plugin: loaders (filled in by the engine work)."""
