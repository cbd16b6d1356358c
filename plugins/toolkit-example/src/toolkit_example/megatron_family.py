"""A model family taught to the Megatron bridge by a third-party plugin: IQuest-Coder (``model_type``
``iquestcoder``), which transformers runs with its Llama code. Only imported where toolkit-megatron is installed.

A family whose layers are Llama-shaped (RMSNorm, RoPE, SwiGLU, GQA) needs only its ``model_type``, the HF
weight names (``embedding``, ``lm_head``, ``final_norm``, ``layer``: inherited here, they are Llama's) and
what it refuses; ``DenseArchitecture.transformer_options`` turns its HF config into Megatron's settings.
"""

from __future__ import annotations

from typing import Any, ClassVar

from toolkit.errors import ModelError
from toolkit_megatron.architectures import DenseArchitecture


class IQuestCoderArchitecture(DenseArchitecture):
    name: ClassVar[str] = "megatron:iquestcoder"
    families: ClassVar[tuple[str, ...]] = ("iquestcoder",)
    qkv_bias: ClassVar[bool | None] = False

    @classmethod
    def check(cls, hf_config: Any) -> None:
        super().check(hf_config)
        if getattr(hf_config, "attention_bias", False):  # Llama's code would add an o_proj bias the bridge has no slot for
            raise ModelError("iquestcoder with attention_bias=true (biases on q/k/v/o) is not supported by the Megatron bridge")
