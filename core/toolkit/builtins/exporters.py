"""Core built-in plugin: exporters (filled in by the engine work)."""
