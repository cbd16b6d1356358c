"""toolkit-peft: the ``lora``, ``dora`` and ``qlora`` tuners (PEFT + bitsandbytes) and their exports."""

from __future__ import annotations

from toolkit import hookimpl


@hookimpl
def toolkit_register_tuners(register):
    from toolkit_peft.tuners import DoRATuner, LoRATuner, QLoRATuner

    register(LoRATuner)
    register(DoRATuner)
    register(QLoRATuner)
