"""Test settings of toolkit-rl: no hub access; DeepSpeed imported once in the fork server."""

import importlib.util
import os

from toolkit import forkserver

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# test_strategies.py's ZeRO runs start six ranks that would each import DeepSpeed (3-4 CPU-s): toolkit.testing.run_python
# forks them from a server that imported it once
if importlib.util.find_spec("deepspeed") is not None:
    os.environ.setdefault("TOOLKIT_TEST_PRELOAD", ",".join((*forkserver.PRELOAD, "deepspeed")))
