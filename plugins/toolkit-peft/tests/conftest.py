"""Fixtures: a tiny Llama saved as an HF directory and its ModelSource (no hub, no download)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=128, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    directory = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(directory)
    return directory


@pytest.fixture
def source(tiny_dir):
    from transformers import AutoConfig

    from toolkit.contracts import ModelSource

    return ModelSource(reference=str(tiny_dir), directory=tiny_dir, config=AutoConfig.from_pretrained(tiny_dir),
                       tokenizer=None, weight_files=sorted(tiny_dir.glob("*.safetensors")))


@pytest.fixture
def load_base(tiny_dir):
    def load(**kwargs):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(tiny_dir, **kwargs)

    return load


@pytest.fixture
def batch():
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (2, 16), generator=generator)
