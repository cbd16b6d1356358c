"""toolkit-dpo: preference alignment (DPO, IPO, hinge, KTO, SimPO, ORPO, CPO), reward modeling and preference data.

Registered through the core's hooks only; importing this module is cheap (no torch).
"""

from __future__ import annotations

from toolkit import hookimpl

__version__ = "0.1.0"


@hookimpl
def toolkit_register_losses(register):
    from toolkit_dpo.losses import LOSSES

    for cls in LOSSES:
        register(cls)


@hookimpl
def toolkit_register_dataset_formats(register):
    from toolkit_dpo.formats import FORMATS

    for cls in FORMATS:
        register(cls)


@hookimpl
def toolkit_register_exporters(register):
    from toolkit_dpo.exporters import RewardModelExporter

    register(RewardModelExporter)
