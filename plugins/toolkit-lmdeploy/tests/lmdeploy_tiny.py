"""A tiny model of any family with a chat tokenizer built offline, for the LMDeploy plugin's tests."""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["deploy the model with lmdeploy and serve it"] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHATML
    return fast


def export_model(family: str = "qwen2", *, head_dim: int = 64, **overrides):
    """An ``ExportModel`` over a random 1-layer model of ``family``; returns (export_model, hf_model)."""
    import torch
    from toolkit.contracts import ExportModel, ModelSource
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tokenizer()
    config = AutoConfig.for_model(family, vocab_size=len(tok), hidden_size=2 * head_dim, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=head_dim, intermediate_size=64, num_hidden_layers=1,
                                  max_position_embeddings=128, eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
                                  **overrides)
    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = ModelSource(reference="tiny", directory=Path("."), config=net.config, tokenizer=tok, weight_files=[])
    return ExportModel(source=source, tensors=lambda: iter(net.state_dict().items())), net
