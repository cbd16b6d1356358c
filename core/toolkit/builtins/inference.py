"""Core built-in plugin: the ``hf`` inference backend (transformers ``generate``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

from toolkit import hookimpl
from toolkit.config import option
from toolkit.inference import GenerationOptions, format_prompt


@dataclasses.dataclass(kw_only=True)
class GenerateConfig(GenerationOptions):
    dtype: str = option("float32", help="Weights dtype for generation.")
    trust_remote_code: bool = option(False, help="Run the model directory's own Python code (only from this command's flag).")
    batch_size: int = option(1, help="Prompts generated together (left-padded); 1 generates each prompt on its own.")


class HFBackend:
    """Generation with transformers on CPU or one GPU; greedy by default."""

    name: ClassVar[str] = "hf"
    Config: ClassVar[type] = GenerateConfig

    def __init__(self, config: GenerateConfig | None = None):
        self.config = config or GenerateConfig()

    def generate_ids(self, model_dir: Path, prompts: list[str], options: GenerateConfig) -> list[list[int]]:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        from toolkit.models import attention_kwargs

        trust = options.trust_remote_code  # always passed: left out, transformers asks on a terminal
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust)
        model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=getattr(torch, options.dtype),
                                                     trust_remote_code=trust, use_safetensors=True,
                                                     **attention_kwargs(config)).to(device).eval()
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        texts = [tokenizer(format_prompt(tokenizer, p, options.chat_template, options.system), add_special_tokens=False).input_ids
                 for p in prompts]
        eos = model.generation_config.eos_token_id
        ends = set(eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id])
        results: list[list[int]] = []
        step = max(options.batch_size, 1)
        for start in range(0, len(texts), step):
            batch = texts[start:start + step]
            width = max(len(ids) for ids in batch)
            # left padding: every prompt ends where generation starts; the mask keeps the pads out of attention
            ids = torch.tensor([[pad_id] * (width - len(t)) + t for t in batch], device=device)
            mask = torch.tensor([[0] * (width - len(t)) + [1] * len(t) for t in batch], device=device)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=mask, max_new_tokens=options.max_new_tokens, pad_token_id=pad_id,
                                     **options.transformers_sampling())
            results += [_until_end(row[width:].tolist(), ends) for row in out]
        return results

    def generate(self, model_dir: Path, prompts: list[str], options: GenerateConfig) -> list[str]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=options.trust_remote_code)
        return [tokenizer.decode(ids, skip_special_tokens=True) for ids in self.generate_ids(model_dir, prompts, options)]


def _until_end(ids: list[int], ends: set[int]) -> list[int]:
    """A batched row's completion without the pads ``generate`` appends after its end-of-sequence token to match
    the longest completion of the batch; the end token itself is kept, as a prompt generated on its own keeps it."""
    for index, token in enumerate(ids):
        if token in ends:
            return ids[:index + 1]
    return ids


@hookimpl
def toolkit_register_inference_backends(register):
    register(HFBackend)
