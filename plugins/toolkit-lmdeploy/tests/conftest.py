"""Test settings of toolkit-lmdeploy: no hub access, one thread."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
