"""toolkit: a plugin-based toolkit for training large language models.

Importing this package is cheap: no torch, no plugin discovery. Use
``toolkit.plugins.get_plugin_manager()`` for the registries.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

hookimpl = pluggy.HookimplMarker("toolkit")
"""Decorator for plugin hook implementations: ``@toolkit.hookimpl``."""

__all__ = ["__version__", "hookimpl"]
