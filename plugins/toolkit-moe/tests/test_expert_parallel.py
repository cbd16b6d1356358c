"""Two gloo processes: EP2 equals EP1 (outputs, gradients, grad norm, export); FSDP2 equals one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from toolkit_moe.testing import tiny_config

WORLD = 2


def _block(family: str):
    import transformers

    from toolkit_moe.families import FAMILIES

    config = tiny_config(family)
    module = transformers.AutoModelForCausalLM.from_config(config).float()
    torch.manual_seed(0)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    block = next(m for m in module.modules() if type(m).__name__ == FAMILIES[family].block_class)
    return block, config


def _run(block, x, probe):
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out = block(x)
    aux, _ = block.collector.pop()
    ((out * probe).sum() + aux).backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


CASES = [("qwen3_moe", 0.0), ("qwen2_moe", 1.0), ("mixtral", 0.75)]


def _check_case(rank: int, family: str, capacity_factor: float, group) -> None:
    from toolkit_moe.block import AuxCollector, BlockOptions, MoeBlock
    from toolkit_moe.families import FAMILIES

    hf_block, config = _block(family)
    options = BlockOptions(capacity_factor=capacity_factor, experts_backend="loop")
    family_facts = FAMILIES[family]
    ep1, ep2 = (MoeBlock(copy.deepcopy(hf_block), family_facts, config, options, expert_group,
                         AuxCollector(aux_loss_coef=0.1, z_loss_coef=0.01)).train() for expert_group in (None, group))
    # Rank r's tokens; rank 1 gets a different number of tokens so the splits are uneven.
    inputs = [torch.randn(2, 6 + 3 * r, config.hidden_size, generator=torch.Generator().manual_seed(10 + r)) for r in range(WORLD)]
    probes = [torch.randn(x.shape, generator=torch.Generator().manual_seed(20 + r)) for r, x in enumerate(inputs)]
    references = [_run(ep1, inputs[r], probes[r]) for r in range(WORLD)]
    out, x_grad, grads = _run(ep2, inputs[rank], probes[rank])

    ref_out, ref_x_grad, ref_grads = references[rank]
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_grad, ref_x_grad, rtol=1e-5, atol=1e-6)
    local = ep2.expert_group.local_slice(ep1.num_experts)
    for name, grad in grads.items():
        if name.startswith("experts."):
            # Expert weights serve every rank's tokens: their gradient is the sum over ranks.
            expected = sum(ref[2][name] for ref in references)[local]
        else:
            expected = ref_grads[name]
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert grads["experts.gate_up_proj"].shape[0] == ep1.num_experts // WORLD


def _check_model(rank: int, group) -> None:
    """Whole model, EP2 + summed replicated grads == EP1 summed over ranks: grad norm and export."""
    import transformers

    from toolkit_moe.parallel import grad_norm
    from toolkit_moe.patch import full_state_tensors, patch_moe_blocks

    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2_moe")).float().train()
    ids = [torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(30 + r)) for r in range(WORLD)]

    def loss_of(model, batch):
        logits = model(input_ids=batch).logits
        return logits.square().mean() + model.toolkit_pop_aux_loss()[0]

    reference = copy.deepcopy(original)
    patch_moe_blocks(reference, experts_backend="loop", capacity_factor=1.0)
    for batch in ids:  # gradients accumulate: the sum over ranks' batches
        loss_of(reference, batch).backward()
    def norm(named, experts_only=False):
        return torch.sqrt(sum(p.grad.square().sum() for n, p in named if p.grad is not None and (".experts." in n or not experts_only)))

    model = copy.deepcopy(original)
    patch_moe_blocks(model, experts_backend="loop", capacity_factor=1.0, expert_group=group)
    assert all(n.startswith("model.layers.") and ".mlp.experts." in n for n in model._ddp_params_and_buffers_to_ignore)
    loss_of(model, ids[rank]).backward()
    for p in model.parameters():  # what data parallelism does for replicated parameters
        if p.grad is not None and not getattr(p, "toolkit_expert_parallel", False):
            dist.all_reduce(p.grad)
    torch.testing.assert_close(grad_norm(list(model.parameters()), group), norm(reference.named_parameters()), rtol=1e-5, atol=1e-6)
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    torch.testing.assert_close(grad_norm(experts, group), norm(reference.named_parameters(), experts_only=True), rtol=1e-5, atol=1e-7)
    exported = dict(full_state_tensors(model))
    for name, tensor in original.state_dict().items():
        assert torch.equal(exported[name], tensor), name
    # a full (HF-shaped) state dict loads into the expert-parallel model: each rank keeps its slice
    fresh = copy.deepcopy(original)
    patch_moe_blocks(fresh, expert_group=group)
    for p in fresh.parameters():
        p.data.zero_()
    fresh.load_state_dict(original.state_dict())
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def _check_fsdp(rank: int) -> None:
    """Patched blocks under FSDP2 (fully_shard per layer): gradients equal the unsharded model's."""
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from toolkit_moe.patch import patch_moe_blocks

    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).float().train()
    patch_moe_blocks(original, experts_backend="loop", z_loss_coef=0.01)
    ids = [torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(40 + r)) for r in range(WORLD)]

    def loss_of(model, batch):
        return model(input_ids=batch).logits.square().mean() + model.toolkit_pop_aux_loss()[0]

    reference = copy.deepcopy(original)
    for batch in ids:
        loss_of(reference, batch).backward()
    sharded = copy.deepcopy(original)
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    loss_of(sharded, ids[rank]).backward()
    expected = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        # FSDP averages over ranks; the reference summed both ranks' batches
        torch.testing.assert_close(p.grad.full_tensor() * WORLD, expected[name].grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"fsdp {n}: {m}")


def two_process_checks() -> str:
    """Run on each of two gloo ranks by :func:`toolkit.testing.run_distributed`."""
    from toolkit_moe.parallel import new_expert_groups

    rank = dist.get_rank()
    group = new_expert_groups(WORLD)
    for family, capacity_factor in CASES:
        try:
            _check_case(rank, family, capacity_factor, group)
        except AssertionError as exc:
            raise AssertionError(f"{family}, capacity_factor={capacity_factor}: {exc}") from exc
    _check_model(rank, group)
    _check_fsdp(rank)
    return "ok"


@pytest.mark.slow
def test_ep2_equals_ep1_and_fsdp2_equals_one_process() -> None:
    """Each family (Qwen3 no drops, Qwen2 with shared expert and drops, Mixtral with drops)."""
    from toolkit.testing import run_distributed

    assert run_distributed(two_process_checks, nproc=WORLD, timeout=240) == ["ok"] * WORLD
