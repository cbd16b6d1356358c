"""Tiny trained models and a chat tokenizer built offline, for the vLLM plugin's tests.

The tokenizer's EOS (``<|endoftext|>``) differs from the chat's end-of-turn (``<|im_end|>``) on
purpose: an export must put both into generation_config.json.
"""

from __future__ import annotations

import functools
from pathlib import Path

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a language model predicts the next token from the previous tokens",
    "vllm serves models through an openai compatible server",
    "greedy decoding picks the most likely token at every step",
    "export the trained model and compare the tokens one by one",
] * 4


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    return fast


def model(family: str = "llama", *, head_dim: int = 32, train_steps: int = 30, seed: int = 0, intermediate_size: int = 128):
    """A 2-layer model of ``family`` trained for a few steps on the corpus; returns (model, tokenizer).

    The training runs once per set of arguments in a test process (it is deterministic); each call gets a model of
    its own with those weights."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM

    tok = tokenizer()
    config, state = _trained(family, head_dim, train_steps, seed, intermediate_size)
    net = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32)
    net.load_state_dict(state)
    net.eval()
    return net, tok


@functools.cache
def _trained(family: str, head_dim: int, train_steps: int, seed: int, intermediate_size: int):
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tok = tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=4 * head_dim, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=head_dim, intermediate_size=intermediate_size, num_hidden_layers=2, max_position_embeddings=256,
                  bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False)
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config}[family](**common)
    torch.manual_seed(seed)
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if train_steps:
        texts = [tok.apply_chat_template([{"role": "user", "content": t[:20]}, {"role": "assistant", "content": t}],
                                         tokenize=False) for t in CORPUS[:5]]
        batch = tok(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        optimizer = torch.optim.AdamW(net.parameters(), lr=3e-3)
        # one thread: these matrices are too small to share, and on a busy machine the second OpenMP thread
        # spin-waits (30 steps: ~4 CPU-s on one thread, 16-20 on two beside another test lane)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for _ in range(train_steps):
                loss = net(**batch, labels=labels).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        finally:
            torch.set_num_threads(threads)
    return net.config, {name: tensor.detach().clone() for name, tensor in net.state_dict().items()}


def export_model(net, tok, directory: Path | None = None, adapter=None):
    """An ``ExportModel`` over an in-memory HF model (what a strategy hands an exporter)."""
    from toolkit.contracts import ExportModel, ModelSource

    source = ModelSource(reference="tiny", directory=directory or Path("."), config=net.config, tokenizer=tok,
                         weight_files=[])
    return ExportModel(source=source, tensors=lambda: iter(net.state_dict().items()), adapter=adapter)


def lora_adapter(net, *, rank: int = 4, alpha: int = 8, targets=("q_proj", "v_proj"), seed: int = 1, **extra):
    """Random nonzero LoRA weights for ``targets`` as (peft_config, tensors) plus the merged state dict."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    tensors, merged = {}, {k: v.clone() for k, v in net.state_dict().items()}
    for name, module in net.named_modules():
        if name.split(".")[-1] in targets and isinstance(module, torch.nn.Linear):
            a = torch.randn(rank, module.in_features, generator=generator) * 0.2
            b = torch.randn(module.out_features, rank, generator=generator) * 0.2
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = b
            merged[f"{name}.weight"] += (alpha / rank) * (b @ a)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
              "bias": "none", "task_type": "CAUSAL_LM", **extra}
    return (config, lambda: iter(tensors.items())), merged


def lora_export(directory: Path, family: str = "llama", *, rank: int = 8, alpha: int = 16):
    """What ``toolkit export --to vllm`` gets from a LoRA run: the base model on disk, merged
    tensors and the adapter. Returns (export_dir, base_model, merged_model, tokenizer)."""
    from toolkit.hfdir import write_hf_directory
    from toolkit_vllm.exporter import VLLMExporter

    base, tok = model(family, train_steps=30)
    adapter, merged_state = lora_adapter(base, rank=rank, alpha=alpha)
    base_dir = write_hf_directory(export_model(base, tok), directory / "base")
    merged, _ = model(family, train_steps=0)
    merged.load_state_dict(merged_state)
    merged.eval()
    out = VLLMExporter().export(export_model(merged, tok, directory=base_dir, adapter=adapter), directory / "export")
    return out, base, merged, tok
