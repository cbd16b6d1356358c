"""Preference accuracy of a causal LM on held-out pairs: how often it gives the chosen response more probability.

``toolkit-dpo``'s tests and benchmarks use it to check that alignment moved a model; it runs the
core's data pipeline and label log-prob code, so it sees the data exactly as training does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pair_logps(model: Any, tokenizer: Any, dataset: str, *, batch_pairs: int = 32, seq_len: int = 512,
               max_samples: int = 0, raw_text: bool = False) -> tuple[Any, Any]:
    """Summed label log-probs ``(chosen [pairs], rejected [pairs])`` of a preference dataset under ``model``."""
    import torch

    from toolkit.data.pipeline import collate, load_examples
    from toolkit.train.logps import CausalLMLogps, token_logps
    from toolkit_dpo.functional import pair_indices

    examples, _ = load_examples([dataset], tokenizer, dataset_format="preference", seq_len=seq_len,
                                max_samples=max_samples, example_kinds=("preference",),
                                options={"preference": {"raw_text": raw_text}})
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    module = CausalLMLogps(model).eval()
    device = next(model.parameters()).device
    chosen, rejected = [], []
    with torch.no_grad():
        for start in range(0, len(examples), batch_pairs):
            units = [[i] for i in range(start, min(start + batch_pairs, len(examples)))]
            batch = collate(examples, units, pad_id, packing=False)
            out = token_logps(module, batch, device)
            c, r = pair_indices(out.sequence_meta)
            sums = out.sequence_sums()
            chosen.append(sums[c])
            rejected.append(sums[r])
    return torch.cat(chosen), torch.cat(rejected)


def preference_accuracy(model_dir: str | Path, dataset: str, reference_dir: str | Path | None = None, **kwargs: Any) -> float:
    """Fraction of pairs where the model prefers chosen: ``logp(chosen) > logp(rejected)``.

    With ``reference_dir`` it is DPO's implicit-reward accuracy instead (log-ratios against the reference).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from toolkit.models import attention_kwargs

    def load(directory: Any) -> Any:  # never the model's own code, never pickled weights
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
        return AutoModelForCausalLM.from_pretrained(directory, config=config, trust_remote_code=False, use_safetensors=True,
                                                    **attention_kwargs(config))

    tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    model = load(model_dir)
    chosen, rejected = pair_logps(model, tokenizer, dataset, **kwargs)
    if reference_dir is not None:
        reference = load(reference_dir)
        ref_chosen, ref_rejected = pair_logps(reference, tokenizer, dataset, **kwargs)
        chosen, rejected = chosen - ref_chosen, rejected - ref_rejected
    return float((chosen > rejected).float().mean())
