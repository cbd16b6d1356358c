"""toolkit-lmdeploy: the ``lmdeploy`` exporter (an HF directory TurboMind or the PyTorch engine
loads as is) and the ``lmdeploy`` inference backend (pipeline generation, api_server)."""

from __future__ import annotations

from toolkit import hookimpl

__version__ = "0.1.0"


@hookimpl
def toolkit_register_exporters(register):
    from toolkit_lmdeploy.exporter import LMDeployExporter

    register(LMDeployExporter)


@hookimpl
def toolkit_register_inference_backends(register):
    from toolkit_lmdeploy.backend import LMDeployBackend

    register(LMDeployBackend)
