"""Test settings of toolkit-vllm: no hub access, one thread, the ``vllm`` mark."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM installed (run tests/run_vllm_e2e.sh)")
