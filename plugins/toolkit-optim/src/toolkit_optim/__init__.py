"""toolkit-optim: the ``adamw-8bit`` and ``galore`` optimizers and the ``lisa`` tuner."""

from __future__ import annotations

from toolkit import hookimpl


@hookimpl
def toolkit_register_optimizers(register):
    from toolkit_optim.optimizers import AdamW8bit, GaLore

    register(AdamW8bit)
    register(GaLore)


@hookimpl
def toolkit_register_tuners(register):
    from toolkit_optim.lisa import LISATuner

    register(LISATuner)
