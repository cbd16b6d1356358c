"""Shared settings for the DeepSpeed plugin's tests: offline, one thread, one extension cache."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed compiles C++ ops on first use; every test process shares one cache of them.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.home() / ".cache" / "toolkit" / "torch_extensions"))
