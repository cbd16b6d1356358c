"""Shared fixtures: tiny HF checkpoints built from configs, and a 2-process torchrun helper."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def tiny_config(arch: str):
    from transformers import LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if arch == "mixtral":
        return MixtralConfig(vocab_size=301, hidden_size=128, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, max_position_embeddings=256, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=None)
    if arch == "qwen3_moe_mixed":  # dense MLPs at layers 0 and 3: each PP2 stage holds one dense and one MoE layer
        return Qwen3MoeConfig(vocab_size=301, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0, 3])
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    if arch == "deepseek_v3":  # MLA with a query latent, sigmoid grouped top-k, 1 shared expert, 1 dense layer first
        from transformers import DeepseekV3Config

        return DeepseekV3Config(vocab_size=301, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                                n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
                                q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                routed_scaling_factor=2.5, max_position_embeddings=256)
    if arch == "deepseek_v2":  # V2-Lite's shape: no query latent; softmax group-limited top-k, 2 shared experts
        from transformers import DeepseekV2Config

        return DeepseekV2Config(vocab_size=301, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                                n_shared_experts=2, num_experts_per_tok=2, topk_method="group_limited_greedy", n_group=4,
                                topk_group=2, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16,
                                qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1,
                                                 "mscale": 0.707, "mscale_all_dim": 0.707})
    if arch == "qwen2_moe":
        from transformers import Qwen2MoeConfig

        return Qwen2MoeConfig(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, max_position_embeddings=256, num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=64, shared_expert_intermediate_size=96)
    if arch == "llama3":  # Llama 3.1's rope scaling; original context 8 so the 16-token test spans both bands
        return LlamaConfig(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    if arch == "qwen2_yarn":  # Qwen2.5 long-context YaRN (attention scaling != 1)
        return Qwen2Config(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                            "original_max_position_embeddings": 64})
    if arch == "phi3":  # Phi-4-mini's shape: fused qkv/gate_up, partial rotary 0.75, longrope (long factors past 4), window 8
        from transformers import Phi3Config

        return Phi3Config(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=4, pad_token_id=0,
                          sliding_window=8,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                                           "original_max_position_embeddings": 4,
                                           "short_factor": [1.0 + i / 8 for i in range(12)],
                                           "long_factor": [1.5 + i for i in range(12)]})
    if arch == "glm4":  # QKV bias, fused gate_up, half-rotary interleaved RoPE, post-sublayer norms
        from transformers import Glm4Config

        return Glm4Config(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=32, max_position_embeddings=256, pad_token_id=0)
    if arch == "gemma":  # Gemma (v1): GeGLU, (1 + w) norms, the sqrt(hidden) embedding scale; untied here
        from transformers import GemmaConfig

        return GemmaConfig(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, max_position_embeddings=256, pad_token_id=0,
                           tie_word_embeddings=False)
    if arch in ("gemma2", "gemma3_text"):  # window 4 < the tests' 16 tokens, layers alternate window/full, capped logits
        from transformers import Gemma2Config, Gemma3TextConfig

        shape = dict(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, max_position_embeddings=256, pad_token_id=0, sliding_window=4,
                     query_pre_attn_scalar=24, initializer_range=0.1, final_logit_softcapping=2.0,
                     layer_types=["sliding_attention", "full_attention"] * 2)
        if arch == "gemma2":
            return Gemma2Config(**shape, attn_logit_softcapping=3.0)
        return Gemma3TextConfig(**shape, rope_parameters={  # a linear-scaled global RoPE, as Gemma 3 4B+ ship
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})
    if arch == "internlm3":  # transformers' own InternLM3 (a Llama config, LlamaForCausalLM)
        from transformers import AutoConfig

        return AutoConfig.for_model("internlm3", vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                                    pad_token_id=0)
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    return cls(vocab_size=301, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=256, tie_word_embeddings=arch == "qwen3",
               **({"sliding_window": None} if arch == "mistral" else {}))


EXTRA_FAMILIES = ("llama3", "qwen2_yarn", "phi3", "glm4", "internlm3", "gemma", "gemma2", "gemma3_text")
"""Fixtures beyond the tiny presets: rope scaling and the families added for issue 27."""


def transformers_knows(model_type: str) -> bool:
    """Whether the installed transformers has ``model_type`` (InternLM3 came after 5.17, the GPU image's)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def needs_transformers_family(model_type: str):
    """A pytest param mark: skip where the installed transformers does not know ``model_type``."""
    import transformers

    return pytest.mark.skipif(not transformers_knows(model_type),
                              reason=f"transformers {transformers.__version__} has no {model_type!r}")


def save_tiny_model(arch: str, directory: Path) -> Path:
    """A randomly initialised tiny HF model with non-trivial norms and biases, saved with save_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(arch))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "bias" in name:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias: make it matter
                buffer.add_(torch.randn_like(buffer) * 0.1)
    model.save_pretrained(directory)
    return directory


def cli_model_dir(arch: str, directory: Path) -> Path:
    """A tiny model of ``arch`` with the vocabulary of the bundled tokenizer, and that tokenizer: an HF directory
    ``toolkit sft --model`` trains like a downloaded one."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    from toolkit.models import TOKENIZER_DIR

    config = tiny_config(arch)
    config.vocab_size, config.eos_token_id, config.pad_token_id, config.bos_token_id = 768, 2, 3, None
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    for path in TOKENIZER_DIR.iterdir():
        shutil.copy(path, directory / path.name)
    return directory


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    archs = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "qwen2_moe", "qwen3_moe_mixed", "deepseek_v3",
             "deepseek_v2", *EXTRA_FAMILIES)
    return {arch: save_tiny_model(arch, root / arch) for arch in archs if arch != "internlm3" or transformers_knows(arch)}


@pytest.fixture(scope="module")
def tp1():
    """Megatron's process groups for one process (TP=PP=CP=1) over an in-process store (no port to take)."""
    import torch.distributed as dist

    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.model import destroy_parallel, initialize_parallel

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    initialize_parallel(ParallelLayout())
    yield
    destroy_parallel()
    if created:
        dist.destroy_process_group()


def torchrun(script: str, *args: str, nproc: int = 2, timeout: int = 240) -> None:
    """``script`` on ``nproc`` ranks with torchrun's environment (one rank too): the workers join the process group
    themselves. A failing rank raises with its output."""
    from toolkit.testing import run_distributed

    run_distributed(HERE / script, nproc=nproc, args=args, timeout=timeout,
                    env={"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"})


def run_worker(script: str, tmp_path: Path, *args: str) -> dict:
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "result.json"
    torchrun(script, *args[:1], str(out), *args[1:])
    return json.loads(out.read_text())


def finish_worker(results: dict, out_path: str) -> None:
    """A torchrun worker's end: rank 0 writes ``results`` as JSON, every rank tears the group down and
    leaves without interpreter shutdown (gloo's exit-abort trap, notes/cpu-stack.md)."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)
