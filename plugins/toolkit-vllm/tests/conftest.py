"""Test settings of toolkit-vllm: no hub access, one thread, the ``vllm`` mark, vLLM imported once in the fork server."""

import importlib.util
import os

from toolkit import forkserver

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The engine processes of the e2e tests (python -m toolkit_vllm.worker, toolkit infer/eval --backend vllm) start
# forked from toolkit.testing.run_python's server: with vLLM's engine modules imported there once, an engine process
# costs ~5 CPU-s instead of ~20 (import vllm, then the ~700 modules LLM() imports as it starts).
VLLM_PRELOAD = ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.engine.core",
                "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
                "vllm.v1.core.sched.scheduler", "vllm.v1.attention.backends.cpu_attn", "vllm.lora.request",
                "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen2")
if importlib.util.find_spec("vllm") is not None:
    os.environ.setdefault("TOOLKIT_TEST_PRELOAD", ",".join((*forkserver.PRELOAD, *VLLM_PRELOAD)))


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs vLLM installed (run tests/run_vllm_e2e.sh)")
