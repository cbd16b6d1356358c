"""toolkit-vllm: the ``vllm`` exporter (HF directory + LoRA adapter vLLM loads as is) and the
``vllm`` inference backend (offline generation and the OpenAI-compatible server)."""

from __future__ import annotations

from toolkit import hookimpl

__version__ = "0.1.0"


@hookimpl
def toolkit_register_exporters(register):
    from toolkit_vllm.exporter import VLLMExporter

    register(VLLMExporter)


@hookimpl
def toolkit_register_inference_backends(register):
    from toolkit_vllm.backend import VLLMBackend

    register(VLLMBackend)
