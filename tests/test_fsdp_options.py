"""FSDP2 options against one ``local`` process: clipping over sharded gradients, activation checkpointing, CPU offload.

Every run clips at a small max-norm so clipping is active on every step, and AdamW's epsilon is
large enough that its update depends on the gradient's scale: a norm taken over one rank's shards
would clip by another factor and change the losses from the second step on (and the logged norm).
"""

from __future__ import annotations

import json

import pytest

from toolkit.testing import run_distributed

COMMON = ["sft", "--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--lr", "1e-3", "--max-steps", "3",
          "--micro-batch-size", "2", "--global-batch-size", "4", "--max-grad-norm", "0.05",
          "--adam-eps", "1e-4"]


def toolkit(*args, nproc=1):
    return run_distributed(["-m", "toolkit", *map(str, args)], nproc=nproc, timeout=300)


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("local") / "run"
    toolkit(*COMMON, "--output", run)
    found = metrics(run)
    assert all(m["grad_norm"] > 20 * 0.05 for m in found), "the test needs clipping active on every step"
    return found


@pytest.mark.slow
@pytest.mark.parametrize("flags", [[], ["--gradient-checkpointing"], ["--fsdp-cpu-offload"]],
                         ids=["clipped", "activation-checkpointing", "cpu-offload"])
def test_fsdp_equals_local(tmp_path, local_run, flags):
    toolkit(*COMMON, "--strategy", "fsdp", *flags, "--output", tmp_path / "run", nproc=2)
    for a, b in zip(local_run, metrics(tmp_path / "run"), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)


def sharded_layout(offload: bool) -> dict:
    """What the fsdp engine built on this rank (bf16 policy), and the gradients of one step."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from toolkit.builtins.fsdp import FSDPConfig, FSDPStrategy
    from toolkit.builtins.losses import SFTLoss
    from toolkit.builtins.tuners import FullTuner
    from toolkit.data.pipeline import Batches, load_examples
    from toolkit.models import resolve_model
    from toolkit.recipe import resolve_recipe
    from toolkit.train.logps import decoder_layers

    recipe = resolve_recipe({"model": "tiny-llama", "precision": "bf16", "seq_len": 64, "micro_batch_size": 2, "output": "unused"})
    source = resolve_model("tiny-llama")
    engine = FSDPStrategy(FSDPConfig(cpu_offload=offload)).build(source, FullTuner(), SFTLoss(), recipe)
    layers = decoder_layers(engine.model)
    policy = layers[0]._get_fsdp_state()._mp_policy
    examples, _ = load_examples(["demo"], source.tokenizer, seq_len=64, max_samples=8)
    batches = Batches(examples, seed=0, seq_len=64, packing=False, micro_batch_size=2, global_batch_size=4,
                      dp_rank=engine.dp_rank, dp_world_size=2, pad_id=source.tokenizer.pad_token_id)
    grads = {}

    def keep(name):
        def hook(param):  # after FSDP's reduce-scatter: the sharded fp32 gradient this rank steps with
            grads[name] = (str(param.grad.dtype), tuple(param.grad.to_local().shape), tuple(param.grad.shape))
        return hook

    for name, param in engine.model.named_parameters():
        param.register_post_accumulate_grad_hook(keep(name))
    engine.set_total_steps(1)
    engine.train_step(batches.micro_batches(0), SFTLoss(), batches.context(0))
    q = layers[0].self_attn.q_proj.weight
    return {"all_layers_sharded": all(isinstance(layer, FSDPModule) for layer in layers) and isinstance(engine.module, FSDPModule),
            "placement": str(q.placements), "local": tuple(q.to_local().shape), "global": tuple(q.shape),
            "param_dtype": str(q.dtype), "policy": (str(policy.param_dtype), str(policy.reduce_dtype)),
            "offload": isinstance(layers[0]._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy),
            "q_grad": grads.get("model.layers.0.self_attn.q_proj.weight"),
            "every_trainable_got_a_grad": len(grads) == sum(p.requires_grad for p in engine.model.parameters()),
            "state_bytes": engine.training_state_bytes()}


@pytest.mark.slow
def test_layers_are_sharded_with_the_bf16_policy_and_offload(tmp_path):
    ranks = run_distributed(sharded_layout, nproc=2, args=(True,), timeout=300)
    for rank in ranks:
        assert rank["all_layers_sharded"] and rank["placement"] == "(Shard(dim=0),)"
        assert rank["local"][0] * 2 == rank["global"][0], "each rank holds half of each weight's rows"
        assert rank["param_dtype"] == "torch.float32", "sharded master weights stay fp32"
        assert rank["policy"] == ("torch.bfloat16", "torch.float32"), "bf16 compute, fp32 gradient reduction"
        assert rank["offload"]
        assert rank["q_grad"] == ("torch.float32", rank["local"], rank["global"]), "sharded fp32 gradients"
        assert rank["every_trainable_got_a_grad"]
    # Between steps (gradients freed) a rank holds its shards of the fp32 weights and of AdamW's two moments: the ranks
    # together hold each number once (the planner's measurement harness reads this; the local engine's is checked
    # against the CPU allocator in test_plan_measure.py).
    from transformers import AutoModelForCausalLM

    from toolkit.models import preset_config

    parameters = sum(p.numel() for p in AutoModelForCausalLM.from_config(preset_config("tiny-llama")).parameters())
    assert sum(rank["state_bytes"] for rank in ranks) == 3 * 4 * parameters
