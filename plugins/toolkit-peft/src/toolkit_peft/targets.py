"""Which modules get adapters: PEFT's matching rules, checked up front with errors that list what exists."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from toolkit_peft.tuners import target_regex

if TYPE_CHECKING:
    import torch

    from toolkit.contracts import ModelSource
    from toolkit_peft.tuners import LoRAConfig


def peft_target_modules(config: LoRAConfig) -> str | list[str]:
    """``target_modules`` as PEFT takes it: ``"all-linear"``, a regex string or a list of names."""
    regex = target_regex(config.target_modules)
    if regex is not None:
        return regex
    if config.target_modules == ["all-linear"]:
        return "all-linear"
    return list(config.target_modules)


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """Full paths of the linear layers (nn.Linear and subclasses such as bitsandbytes', GPT-2's Conv1D)."""
    import torch

    names = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
            names.append(name)
    return names


def _adaptable(module: torch.nn.Module) -> bool:
    """Module types PEFT's LoRA can wrap."""
    import torch

    kinds = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.MultiheadAttention)
    return isinstance(module, kinds) or type(module).__name__ == "Conv1D"


def _matches(name: str, key: str) -> bool:
    return key == name or key.endswith("." + name)


def target_problems(config: LoRAConfig, source: ModelSource | None = None, model: torch.nn.Module | None = None) -> list[str]:
    """Problems with ``target_modules`` / ``modules_to_save`` for this model (built on the meta device if not given)."""
    if model is None:
        model = meta_model(source)
        if model is None:
            return []
    linears = linear_layer_names(model)
    suffixes = sorted({n.rsplit(".", 1)[-1] for n in linears})
    available = f"linear layers of this model: {', '.join(suffixes)} (e.g. {linears[0] if linears else '-'})"
    problems = []
    regex = target_regex(config.target_modules)
    if regex is not None:
        matched = [(key, module) for key, module in model.named_modules() if re.fullmatch(regex, key)]
        if not matched:
            problems.append(f"target_modules regex {regex!r} matches no module path; {available}")
        unsupported = [f"{key} ({type(module).__name__})" for key, module in matched if not _adaptable(module)]
        if unsupported:
            problems.append(f"target_modules regex {regex!r} also matches {', '.join(unsupported[:3])}"
                            f"{' and more' if len(unsupported) > 3 else ''}, which cannot take an adapter; narrow it "
                            f"to linear layers ({available})")
    elif config.target_modules != ["all-linear"]:
        if "all-linear" in config.target_modules:
            problems.append("target_modules: 'all-linear' cannot be combined with names; give it alone")
        try:
            on_experts = moved_to_experts(config, model)
        except ValueError as exc:  # PEFT's own refusal, e.g. up_proj without gate_proj on experts it fuses
            return [f"target_modules: {exc}"]
        for name in config.target_modules:
            if name != "all-linear" and name not in on_experts and not any(_matches(name, key) for key in linears):
                problems.append(f"target_modules: {name!r} matches no linear layer; {available}")
    module_names = [key for key, _ in model.named_modules() if key]
    for name in config.modules_to_save:
        if not any(_matches(name, key) for key in module_names):
            tops = sorted({k.rsplit(".", 1)[-1] for k in module_names if not re.search(r"\.\d+(\.|$)", k)})
            problems.append(f"modules_to_save: {name!r} matches no module; modules outside the layers: {', '.join(tops)}")
    return problems


def moved_to_experts(config: LoRAConfig, model: torch.nn.Module) -> set[str]:
    """Target names PEFT turns into targets of the fused experts' parameters only (transformers 5 keeps a MoE
    layer's experts as 3-d ``gate_up_proj`` / ``down_proj`` tensors, not linear layers): Qwen3-MoE's ``gate_proj``,
    Mixtral's ``w1``. Asked of PEFT's own conversion of the config for transformers 5; a name that also matches
    linear layers (a dense MLP's, a shared expert's) stays a module target there as well (PEFT >= 0.22)."""
    import copy

    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    from toolkit_peft.adapters import peft_lora_config

    wanted = peft_lora_config(config, use_dora=False)
    converted = copy.deepcopy(wanted)
    convert_peft_config_for_transformers(converted, model=model, conversions=None)
    if not converted.target_parameters or not isinstance(wanted.target_modules, (list, set)):
        return set()
    return set(wanted.target_modules) - set(converted.target_modules or ())


def meta_model(source: ModelSource | None) -> Any:
    """The model built from ``source.config`` on the meta device (no memory), or None if that fails."""
    if source is None or getattr(source, "config", None) is None:
        return None
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(source.config, trust_remote_code=source.trust_remote_code)
    except Exception:  # an exotic architecture: apply() checks the real model instead
        return None
