"""toolkit-quantize: the ``bnb4``, ``bnb8``, ``gptq``, ``awq`` and ``fp8`` quantizers of ``toolkit export --quantize``
and the ``gguf`` exporter (llama.cpp / Ollama)."""

from __future__ import annotations

from toolkit import hookimpl


@hookimpl
def toolkit_register_quantizers(register):
    from toolkit_quantize.bnb import BnB4, BnB8
    from toolkit_quantize.compressor import AWQ, FP8, GPTQ

    for quantizer in (BnB4, BnB8, GPTQ, AWQ, FP8):
        register(quantizer)


@hookimpl
def toolkit_register_exporters(register):
    from toolkit_quantize.gguf_export import GGUFExporter

    register(GGUFExporter)
