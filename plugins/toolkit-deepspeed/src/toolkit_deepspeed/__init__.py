"""toolkit-deepspeed: registers ``--strategy deepspeed`` (ZeRO-1/2/3, CPU offload) with the toolkit."""

from toolkit import hookimpl


@hookimpl
def toolkit_register_strategies(register):
    from toolkit_deepspeed.strategy import DeepSpeedStrategy  # no torch or deepspeed at import

    register(DeepSpeedStrategy)
