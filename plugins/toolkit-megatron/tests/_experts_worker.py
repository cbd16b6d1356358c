"""Worker for test_experts.py, run under torchrun with 2 processes (gloo, CPU).

1. Module level (expert-parallel size 1): GroupedExperts against Megatron's SequentialMLP with the
   same weights, for gated SwiGLU and plain GELU experts, with and without expert biases, with an
   expert that gets no token, fp32 and bf16, through the grouped kernel, the stacking fallback
   (weights no longer packed), the per-expert loop and Megatron's fused weighted SwiGLU
   (``bias_activation_fusion``): outputs and every weight gradient.
2. Model level, per layout (EP1, EP2, TP2+SP+ETP2/ETP1): a Qwen3-MoE GPTModel built with grouped and with
   sequential experts from the same HF weights: logits (also against HF), input and weight gradients.
3. LoRA at ETP2: GroupedExperts against SequentialMLP with the same LoRALinear wrappers on every expert, split over
   the two ranks; each rank weighs its partial output differently, so the replicated factors' gradients (fc1's A,
   fc2's B) are right only when summed over the group: output, input and every weight and adapter gradient.
"""

import sys

import torch
import torch.distributed as dist

from conftest import finish_worker


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def module_checks() -> dict:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.parallel import ParallelLayout
    from toolkit_megatron import experts as grouped_module
    from toolkit_megatron.model import initialize_parallel

    initialize_parallel(ParallelLayout())
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    provider = LocalSpecProvider()
    submodules = MLPSubmodules(linear_fc1=provider.column_parallel_linear(), linear_fc2=provider.row_parallel_linear())
    results = {}
    for gated, bias, dtype, path in [(True, False, torch.float32, "kernel"), (True, True, torch.float32, "kernel"),
                                     (False, True, torch.float32, "kernel"), (True, False, torch.bfloat16, "kernel"),
                                     (True, True, torch.float32, "stack"), (True, True, torch.float32, "loop"),
                                     (True, False, torch.float32, "fused")]:
        config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                                   moe_ffn_hidden_size=24, num_moe_experts=4, moe_router_topk=2, add_bias_linear=bias,
                                   gated_linear_unit=gated, activation_func=torch.nn.functional.silu if gated else torch.nn.functional.gelu,
                                   bias_activation_fusion=path == "fused", params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                   use_cpu_initialization=True, perform_initialization=True,
                                   # as at EP > 1: expert linears without the TP-region identity whose output view
                                   # SequentialMLP's bias path would modify in place (a Megatron limitation at EP1)
                                   expert_model_parallel_size=2)
        torch.manual_seed(1)
        reference = SequentialMLP(4, config, submodules, pg_collection=pgs)
        ours = grouped_module.GroupedExperts(4, config, submodules, pg_collection=pgs)
        ours.load_state_dict(reference.state_dict())
        assert list(ours.state_dict()) == list(reference.state_dict())
        packed = grouped_module._are_slices_of(ours._bases["linear_fc1.weight"], tuple(ours._weights("linear_fc1")))
        if path == "stack":  # a weight re-allocated after packing (as Megatron's distributed optimizer does)
            ours.local_experts[2].linear_fc1.weight.data = ours.local_experts[2].linear_fc1.weight.data.clone()
            assert not grouped_module._are_slices_of(ours._bases["linear_fc1.weight"], tuple(ours._weights("linear_fc1")))
        saved = grouped_module.grouped_mm_function
        if path == "loop":
            grouped_module.grouped_mm_function = lambda: None
        counts = torch.tensor([5, 0, 7, 3])  # expert 1 gets no token
        x = torch.randn(int(counts.sum()), 32, dtype=dtype)
        probs = torch.rand(int(counts.sum()))
        outputs, grads = [], []
        for module in (reference, ours):
            inputs = x.clone().requires_grad_(True)
            out, out_bias = module(inputs, counts, probs)
            assert out_bias is None
            (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
            outputs.append(out)
            grads.append([inputs.grad] + [p.grad for p in module.parameters()])
        grouped_module.grouped_mm_function = saved
        key = f"gated={gated},bias={bias},{str(dtype)[6:]},{path}"
        results[key] = {"packed": packed, "output": max_diff(*outputs),
                        "grads": max(max_diff(a, b) for a, b in zip(*grads, strict=True)),
                        "empty_expert_grad": float(ours.local_experts[1].linear_fc1.weight.grad.abs().max()),
                        "scale": float(outputs[0].float().abs().max())}
    results["kernel_failures"] = sorted(map(str, grouped_module._KERNEL_BROKEN))  # the kernel path ran where asked
    return results


def lora_etp_checks() -> dict:
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from toolkit.parallel import ParallelLayout
    from toolkit_megatron import experts as grouped_module
    from toolkit_megatron.lora import LoRALinear
    from toolkit_megatron.model import initialize_parallel

    initialize_parallel(ParallelLayout(tensor=2, expert_tensor=2))
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    provider = LocalSpecProvider()
    submodules = MLPSubmodules(linear_fc1=provider.column_parallel_linear(), linear_fc2=provider.row_parallel_linear())
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48, moe_ffn_hidden_size=24,
                               num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, gated_linear_unit=True,
                               activation_func=torch.nn.functional.silu, tensor_model_parallel_size=2,
                               expert_tensor_parallel_size=2, use_cpu_initialization=True, perform_initialization=True)
    torch.manual_seed(1)  # the same on both ranks: the same full weights, adapters and tokens, each rank its shards
    reference = SequentialMLP(4, config, submodules, pg_collection=pgs)
    ours = grouped_module.GroupedExperts(4, config, submodules, pg_collection=pgs)
    ours.load_state_dict(reference.state_dict())
    for index in range(4):
        fc1 = {"gate_up": {"A": torch.randn(4, 32) * 0.2, "B": torch.randn(48, 4) * 0.2, "scale": 2.0}}  # [gate; up]
        fc2 = {"row": {"A": torch.randn(3, 24) * 0.2, "B": torch.randn(32, 3) * 0.2, "scale": 0.5}}
        for module in (reference, ours):
            expert = module.local_experts[index]
            expert.linear_fc1 = LoRALinear(expert.linear_fc1, "gate_up", fc1, None, 0.0)
            expert.linear_fc2 = LoRALinear(expert.linear_fc2, "row", fc2, None, 0.0)
    counts = torch.tensor([5, 0, 7, 3])  # expert 1 gets no token
    x = torch.randn(int(counts.sum()), 32)
    probs = torch.rand(int(counts.sum()))
    outputs, grads = [], []
    for module in (reference, ours):
        inputs = x.clone().requires_grad_(True)
        out, _ = module(inputs, counts, probs)
        weight = torch.linspace(-1, 1, out.numel()).reshape(out.shape) * (1 + dist.get_rank())  # partial, per rank
        (out * weight).sum().backward()
        outputs.append(out)
        grads.append({"input": inputs.grad, **{n: p.grad for n, p in module.named_parameters()}})
    entry = {"unsupported": ours._unsupported(), "expert_comm": ours.local_experts[0].linear_fc1.expert_comm,
             "tp": ours.local_experts[0].linear_fc1.tp, "output": max_diff(*outputs),
             "scale": float(outputs[0].abs().max()), "names": sorted(grads[0]) == sorted(grads[1]),
             "missing": [n for n in grads[0] if grads[0][n] is None or grads[1][n] is None],
             "grads": {n: max_diff(grads[0][n], grads[1][n]) / max(1.0, float(grads[0][n].abs().max()))
                       for n in grads[0] if grads[0][n] is not None and grads[1][n] is not None}}
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, entry)
    return gathered


def model_checks(hf_dir: str, layouts: list[str]) -> dict:
    from transformers import AutoModelForCausalLM

    from toolkit.parallel import ParallelLayout
    from toolkit_megatron.bridge import SafetensorsReader, load_hf_weights
    from toolkit_megatron.compat import cpu_compat
    from toolkit_megatron.model import build_model, initialize_parallel

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, hf.config.vocab_size, (2, 16))
    with torch.no_grad():
        reference = hf(ids).logits
    results = {}
    for name in layouts:
        spec = dict(part.split("=") for part in name.split("+"))
        layout = ParallelLayout(tensor=int(spec.get("tp", 1)), sequence_parallel="sp" in spec, expert=int(spec.get("ep", 1)),
                        expert_tensor=int(spec["etp"]) if "etp" in spec else None)
        initialize_parallel(layout)
        runs = {}
        for kind in ("sequential", "grouped"):
            (model,) = build_model(hf.config, layout, experts=kind)
            load_hf_weights([model], hf.config, SafetensorsReader.from_directory(hf_dir))
            with cpu_compat():
                logits = model(ids, None, None)  # [b, s, vocab / tp]
                weight = torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
                (logits * weight).sum().backward()
            runs[kind] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()},
                          type(model.decoder.layers[0].mlp.experts).__name__)
        (seq_logits, seq_grads, seq_type), (our_logits, our_grads, our_type) = runs["sequential"], runs["grouped"]
        rank = dist.get_rank() % layout.tensor
        vocab = seq_logits.shape[-1]
        hf_slice = reference[..., rank * vocab:(rank + 1) * vocab]
        entry = {"types": [seq_type, our_type],
                 "logits": max_diff(seq_logits, our_logits),
                 "hf": max_diff(our_logits[..., :hf_slice.shape[-1]], hf_slice),
                 "grads": max(max_diff(seq_grads[n], our_grads[n]) for n in seq_grads if seq_grads[n] is not None),
                 "expert_grads": sum(1 for n in our_grads if ".local_experts." in n and our_grads[n] is not None),
                 "same_names": sorted(seq_grads) == sorted(our_grads)}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, entry)
        results[name] = gathered
    return results


def main() -> None:
    hf_dir, out_path, layouts = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    dist.init_process_group("gloo")
    results = {"module": module_checks(), "lora_etp2": lora_etp_checks(), "model": model_checks(hf_dir, layouts)}
    finish_worker(results, out_path)


if __name__ == "__main__":
    main()
