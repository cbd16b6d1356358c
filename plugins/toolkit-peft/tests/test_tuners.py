"""LoRA/DoRA tuners against PEFT itself: trainable parameters, forward, exports reloaded by transformers and PEFT."""

from __future__ import annotations

import types

import pytest
import torch

from toolkit.errors import ConfigError
from toolkit_peft.tuners import DoRATuner, LoRAConfig, LoRATuner


def _peft_reference(load_base, **lora_kwargs):
    import peft

    return peft.get_peft_model(load_base(), peft.LoraConfig(task_type="CAUSAL_LM", **lora_kwargs))


def _trainable(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("options", "peft_kwargs"),
    [
        ({}, dict(r=16, lora_alpha=32, target_modules="all-linear")),
        ({"rank": 4, "target_modules": ["q_proj", "v_proj"]}, dict(r=4, target_modules=["q_proj", "v_proj"])),
        ({"rank": 4, "target_modules": ["q_proj,self_attn.v_proj"]}, dict(r=4, target_modules=["q_proj", "v_proj"])),
        ({"rank": 4, "target_modules": [r"re:.*layers\.[0-1]{1,2}\.mlp\..*_proj"]}, dict(r=4, target_modules=r".*layers\.[0-1]{1,2}\.mlp\..*_proj")),
        ({"rank": 8, "target_modules": [r".*layers\.1\..*_proj"]}, dict(r=8, target_modules=r".*layers\.1\..*_proj")),
        ({"rank": 2, "modules_to_save": ["lm_head", "embed_tokens"]},
         dict(r=2, target_modules="all-linear", modules_to_save=["lm_head", "embed_tokens"])),
        ({"rank": 4, "exclude_modules": ["down_proj"]}, dict(r=4, target_modules="all-linear", exclude_modules=["down_proj"])),
    ],
)
def test_trainable_parameters_equal_peft(load_base, source, options, peft_kwargs):
    model = LoRATuner(LoRAConfig(**options)).apply(load_base(), source)
    reference = _peft_reference(load_base, **peft_kwargs)
    assert _trainable(model) == reference.get_nb_trainable_parameters()[0] > 0
    ours = {n.replace("base_model.model.", "") for n, p in reference.named_parameters() if p.requires_grad}
    assert {n for n, p in model.named_parameters() if p.requires_grad} == ours


def test_dora_trainable_parameters_equal_peft(load_base, source):
    model = DoRATuner(DoRATuner.Config(rank=4)).apply(load_base(), source)
    reference = _peft_reference(load_base, r=4, target_modules="all-linear", use_dora=True)
    assert _trainable(model) == reference.get_nb_trainable_parameters()[0]


def _randomise_lora_b(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


@pytest.mark.parametrize("options", [{"rslora": True, "dropout": 0.0}, {"init": "gaussian"}, {"init": "pissa"}, {"init": "olora"}])
def test_forward_equals_peft(load_base, source, batch, options):
    """Same seed, same options, same trained B: our adapted model (fast forward) computes PEFT's logits."""
    cfg = LoRAConfig(rank=4, alpha=16, **options)
    torch.manual_seed(3)
    model = LoRATuner(cfg).apply(load_base(), source)
    torch.manual_seed(3)
    init = {"default": True, "random": False}.get(cfg.init, cfg.init)
    reference = _peft_reference(load_base, r=4, lora_alpha=16, target_modules="all-linear", use_rslora=cfg.rslora,
                                init_lora_weights=init)
    torch.testing.assert_close(model(batch).logits, load_base()(batch).logits, atol=1e-4, rtol=1e-4)
    _randomise_lora_b(model, 0)
    _randomise_lora_b(reference, 0)
    ours, theirs = model(batch).logits, reference(batch).logits
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(ours, load_base()(batch).logits, atol=1e-3), "a trained adapter must change the output"


def test_fast_forward_grads_equal_peft_forward(load_base, source, batch):
    cfg = LoRAConfig(rank=4, init="random", dropout=0.0)
    torch.manual_seed(5)
    fast = LoRATuner(cfg).apply(load_base(), source)
    torch.manual_seed(5)
    slow = LoRATuner(LoRAConfig(rank=4, init="random", fast_forward=False)).apply(load_base(), source)
    for model in (fast, slow):
        model(batch).logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in slow.named_parameters() if p.requires_grad}
    for name, param in fast.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, grads[name], atol=1e-5, rtol=1e-4)


def test_fast_forward_bf16_base_keeps_activations_in_bf16(load_base, source, batch):
    """On a bf16 base with fp32 adapters the fast path computes in bf16 and stays close to PEFT's upcast path."""
    torch.manual_seed(5)
    fast = LoRATuner(LoRAConfig(rank=4, init="random")).apply(load_base(dtype=torch.bfloat16), source)
    torch.manual_seed(5)
    slow = LoRATuner(LoRAConfig(rank=4, init="random", fast_forward=False)).apply(load_base(dtype=torch.bfloat16), source)
    assert next(p for p in fast.parameters() if p.requires_grad).dtype == torch.float32
    logits_fast, logits_slow = fast(batch).logits, slow(batch).logits
    assert logits_fast.dtype == torch.bfloat16
    torch.testing.assert_close(logits_fast.float(), logits_slow.float(), atol=0.05, rtol=0.02)


def test_merged_export_reloads_with_same_logits(load_base, source, batch, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    for tuner in (LoRATuner(LoRAConfig(rank=4, init="random", modules_to_save=["lm_head"])),
                  DoRATuner(DoRATuner.Config(rank=4, init="random"))):
        torch.manual_seed(7)
        model = tuner.apply(load_base(), source)
        with torch.no_grad():  # give DoRA magnitudes and the saved head a trained-looking value
            for name, param in model.named_parameters():
                if param.requires_grad and ("magnitude" in name or "modules_to_save" in name):
                    param.mul_(1.1)
        expected = model(batch).logits
        tensors = dict(tuner.export_tensors(model))
        assert not any("lora" in n or "base_layer" in n or "modules_to_save" in n for n in tensors)
        assert set(tensors) == set(load_base().state_dict())
        out = tmp_path / tuner.name
        out.mkdir()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        source.config.save_pretrained(out)
        reloaded = AutoModelForCausalLM.from_pretrained(out)
        torch.testing.assert_close(reloaded(batch).logits, expected, atol=1e-5, rtol=1e-5)
        assert model(batch).logits.equal(expected), "exporting must not change the adapted model"


def test_adapter_only_export_reloads_with_peft(load_base, source, batch, tmp_path):
    import json

    from peft import PeftModel

    for tuner in (LoRATuner(LoRAConfig(rank=4, init="random", modules_to_save=["lm_head"])),
                  DoRATuner(DoRATuner.Config(rank=4, init="random"))):
        torch.manual_seed(11)
        model = tuner.apply(load_base(), source)
        expected = model(batch).logits
        out = tuner.save_adapter(model, tmp_path / tuner.name)
        config = json.loads((out / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["peft_type"] == "LORA" and config["use_dora"] == (tuner.name == "dora")
        in_memory, _ = tuner.adapter_export(model)()
        assert in_memory == config and type(in_memory["peft_type"]) is str  # plain JSON values, as other exporters expect
        reloaded = PeftModel.from_pretrained(load_base(), out)
        torch.testing.assert_close(reloaded(batch).logits, expected, atol=1e-6, rtol=1e-6)


def test_checkpoint_state_holds_only_what_trains_and_round_trips(load_base, source, batch):
    tuner = LoRATuner(LoRAConfig(rank=4, init="random"))
    torch.manual_seed(1)
    model = tuner.apply(load_base(), source)
    state = {k: v.clone() for k, v in tuner.checkpoint_state(model).items()}
    assert state and all("lora_" in name for name in state)
    assert sum(v.numel() for v in state.values()) == _trainable(model)
    torch.manual_seed(2)
    other = tuner.apply(load_base(), source)
    assert not other(batch).logits.equal(model(batch).logits)
    tuner.load_checkpoint_state(other, state)
    assert other(batch).logits.equal(model(batch).logits)
    del state[next(iter(state))]
    with pytest.raises(Exception, match="missing"):
        tuner.load_checkpoint_state(other, state)


def test_disabled_adapters_gives_the_base_model(load_base, source, batch):
    tuner = LoRATuner(LoRAConfig(rank=4, init="random", modules_to_save=["lm_head"]))
    model = tuner.apply(load_base(), source)
    adapted = model(batch).logits
    with tuner.disabled_adapters(model) as reference:
        base = reference(batch).logits
    torch.testing.assert_close(base, load_base()(batch).logits, atol=1e-6, rtol=1e-6)
    assert model(batch).logits.equal(adapted)


def test_target_matching_nothing_lists_the_linear_layers(source, load_base):
    tuner = LoRATuner(LoRAConfig(target_modules=["q_prj", "v_proj"]))
    problems = tuner.validate(None, source)
    assert len(problems) == 1 and "'q_prj'" in problems[0] and "q_proj" in problems[0] and "down_proj" in problems[0]
    assert "lm_head" in problems[0]
    with pytest.raises(ConfigError, match="q_prj.*matches no linear layer"):
        tuner.apply(load_base(), source)
    regex = LoRATuner(LoRAConfig(target_modules=[r".*\.attention\.wq"])).validate(None, source)
    assert len(regex) == 1 and "matches no module path" in regex[0] and "o_proj" in regex[0]
    too_wide = LoRATuner(LoRAConfig(target_modules=[r".*mlp\..*"])).validate(None, source)
    assert len(too_wide) == 1 and "model.layers.0.mlp.act_fn" in too_wide[0] and "cannot take an adapter" in too_wide[0]


@pytest.mark.parametrize(("preset", "overrides", "targets", "dense"), [
    ("tiny-qwen3-moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}, ["all-linear"], "layers.1.mlp.gate_proj"),
    ("tiny-qwen3-moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}, ["q_proj", "gate_proj", "up_proj", "down_proj"],
     "layers.1.mlp.down_proj"),
    ("tiny-deepseek-v3", {}, ["all-linear"], "layers.1.mlp.shared_experts.up_proj"),
])
def test_dense_mlps_and_shared_experts_beside_fused_experts_get_adapters(preset, overrides, targets, dense):
    """MLP targets on a MoE family whose experts transformers 5 fuses reach both the fused experts (through PEFT's
    target_parameters) and the linear MLPs beside them: a dense layer's MLP (Qwen3-MoE's mlp_only_layers, DeepSeek's
    first_k_dense_replace) and DeepSeek's shared experts. PEFT before 0.22 moved those targets onto the experts
    only, training a model whose dense MLPs never moved; toolkit-peft requires 0.22, and this fails on an older one."""
    from transformers import AutoModelForCausalLM

    from toolkit.contracts import ModelSource
    from toolkit.models import preset_config
    from toolkit_peft.adapters import inject

    config = preset_config(preset, **overrides)
    lora = LoRAConfig(rank=2, target_modules=targets)
    source = ModelSource(reference=preset, directory=None, config=config, tokenizer=None, weight_files=[])
    assert LoRATuner(lora).validate(None, source) == []
    model = inject(AutoModelForCausalLM.from_config(config), lora, use_dora=False)
    adapted = {name.split(".lora_")[0] for name, _ in model.named_parameters() if "lora_" in name}
    assert f"model.{dense}" in adapted
    experts = {name for name in adapted if ".mlp.experts" in name}
    assert experts and {name.split(".mlp.")[0] for name in experts} == {f"model.layers.{i}" for i in range(config.num_hidden_layers)
                                                            if f"model.layers.{i}.mlp.experts" in dict(model.named_modules())}


def test_bad_options_are_reported_together(source):
    config = LoRAConfig(rank=0, dropout=1.5, init="eva", target_modules=["re:(["])
    problems = LoRATuner(config).validate(None, source)
    text = "\n".join(problems)
    assert "rank must be at least 1" in text and "dropout" in text and "eva" in text and "does not compile" in text


@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "paged_adamw"])
def test_optimizer_factory_builds_the_chosen_optimizer(load_base, source, batch, name):
    from toolkit.recipe import Recipe

    recipe = Recipe(lr=1e-2, weight_decay=0.1)
    tuner = DoRATuner(DoRATuner.Config(rank=4, init="random", optimizer=name))
    model = tuner.apply(load_base(), source)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = tuner.optimizer_factory(params, recipe)
    expected = {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "paged_adamw": "PagedAdamW"}[name]
    assert type(optimizer).__name__ == expected and optimizer.defaults["lr"] == 1e-2
    decays = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert all(decays[id(p)] == (0.1 if p.ndim >= 2 else 0.0) for p in params)  # no decay on DoRA magnitudes
    before = [p.detach().clone() for p in params]
    model(batch).logits.float().logsumexp(-1).mean().backward()
    optimizer.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, params) if p.ndim >= 2)


def test_fast_forward_on_a_4bit_base_equals_peft(tiny_dir, source, batch):
    """QLoRA layers get the fast path too; same logits and adapter gradients as PEFT's 4-bit forward."""
    from transformers import AutoModelForCausalLM

    from toolkit_peft.tuners import QLoRATuner

    results = []
    for fast in (True, False):
        tuner = QLoRATuner(QLoRATuner.Config(rank=4, init="random", compute_dtype="fp32", fast_forward=fast))
        torch.manual_seed(9)
        model = tuner.apply(AutoModelForCausalLM.from_pretrained(tiny_dir, **tuner.model_load_kwargs()), source)
        kinds = {type(m).__name__ for m in model.modules()}
        assert ("FastLora4bit" in kinds) == fast and "Params4bit" in {type(p).__name__ for p in model.parameters()}
        logits = model(batch).logits
        logits.logsumexp(-1).mean().backward()
        results.append((logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (fast_logits, fast_grads), (peft_logits, peft_grads) = results
    torch.testing.assert_close(fast_logits, peft_logits, atol=1e-5, rtol=1e-5)
    for name, grad in peft_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("tuner_cls", "options", "precision"), [
    (LoRATuner, {"rank": 4}, "fp32"),
    (LoRATuner, {"rank": 4, "init": "gaussian", "rslora": True}, "bf16"),
    (LoRATuner, {"rank": 2, "init": "orthogonal", "target_modules": ["q_proj,down_proj"]}, "fp32"),
    (DoRATuner, {"rank": 4}, "fp32"),
    (DoRATuner, {"rank": 4}, "bf16"),
    (DoRATuner, {"rank": 4, "init": "random"}, "fp32"),
], ids=["lora", "lora-gaussian-bf16", "lora-orthogonal-some", "dora", "dora-bf16", "dora-random"])
def test_initial_adapters_equal_those_of_the_loaded_model(source, tuner_cls, options, precision, tmp_path):
    """``initial_adapters`` (what Megatron-Core LoRA starts from) is ``checkpoint_state`` of load_hf_model's model,
    bit for bit, and LoRA's needs no weight file at all (the base weights are never read)."""
    import shutil

    from toolkit.models import load_hf_model
    from toolkit.recipe import Recipe

    recipe = Recipe(seed=7, loss="sft", precision=precision, strategy="megatron")
    tuner = tuner_cls(tuner_cls.Config(**options))
    assert tuner.validate(recipe, source) == []
    expected = tuner.checkpoint_state(load_hf_model(source, tuner, recipe, torch.device("cpu")))
    fresh = tuner_cls(tuner_cls.Config(**options))
    fresh.validate(recipe, source)  # records --precision: the base dtype the adapters are rounded through
    if tuner.use_dora:
        got = fresh.initial_adapters(source, recipe)
    else:
        bare = tmp_path / "config-only"
        bare.mkdir()
        shutil.copy(source.directory / "config.json", bare / "config.json")
        got = fresh.initial_adapters(type(source)(reference=str(bare), directory=bare, config=source.config,
                                                  tokenizer=None, weight_files=[]), recipe)
    assert sorted(got) == sorted(expected) and got
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name
    if tuner.use_dora:
        assert all(got[name].abs().sum() > 0 for name in got if "magnitude" in name)


def test_initial_adapters_refuse_inits_that_read_the_base(source):
    import types

    recipe = types.SimpleNamespace(seed=0, precision="fp32")
    with pytest.raises(ConfigError, match="--lora-init pissa"):
        LoRATuner(LoRAConfig(init="pissa")).initial_adapters(source, recipe)
    megatron = types.SimpleNamespace(precision="fp32", strategy="megatron", optimizer="adamw")
    assert any("--lora-init olora" in p for p in LoRATuner(LoRAConfig(init="olora")).validate(megatron, source))
    assert LoRATuner(LoRAConfig(init="gaussian")).validate(megatron, source) == []


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "phimoe"])
def test_moe_experts_left_without_adapters_are_named(family, capsys):
    """PEFT moves all-linear targets onto the fused experts of Qwen2-MoE and Qwen3-MoE but gives PhiMoE's none: the
    run says so (one line naming the experts and what trains) instead of training a model whose experts never move."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit_peft.adapters import inject

    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                  shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
                                  head_dim=8)
    model = inject(AutoModelForCausalLM.from_config(config), LoRAConfig(rank=2), use_dora=False)
    adapted = [name for name, _ in model.named_parameters() if "lora_" in name]
    experts_adapted = any(".mlp.experts." in name for name in adapted)
    notice = capsys.readouterr().err
    assert experts_adapted == (family != "phimoe")
    if experts_adapted:
        assert "routed experts" not in notice
    else:
        assert f"LoRA gives the routed experts of {family} no adapter (model.layers.0.mlp.experts and 1 more)" in notice
        assert "--tuner full" in notice
    capsys.readouterr()
    inject(AutoModelForCausalLM.from_config(config), LoRAConfig(rank=2, target_modules=["q_proj", "v_proj"]), use_dora=False)
    assert "routed experts" not in capsys.readouterr().err  # attention only: nothing was asked of the experts


@pytest.mark.parametrize(("family", "targets"), [("qwen3_moe", ["gate_proj", "up_proj", "down_proj", "q_proj"]),
                                                  ("mixtral", ["w1", "w2", "w3"])])
def test_targets_on_fused_experts_are_accepted_and_merge_as_peft_does(family, targets):
    """Transformers 5 keeps a MoE layer's experts as 3-d tensors, so no linear layer is called gate_proj or w1; PEFT
    adapts those tensors instead, and the targets are accepted. The merged export (random B: the update is not
    zero) gives PEFT's merge_and_unload weights, so it loads into transformers with the adapted model's logits."""
    import copy

    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit_peft.adapters import inject, peft_model_of
    from toolkit_peft.merge import merged_tensors

    config = AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                                  num_local_experts=4, num_experts_per_tok=2, head_dim=8)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config)
    options = LoRAConfig(rank=2, target_modules=targets, init="random")
    assert LoRATuner(options).validate(types.SimpleNamespace(precision="fp32", strategy="local", optimizer="adamw"),
                                       types.SimpleNamespace(config=config, trust_remote_code=False)) == []
    model = inject(copy.deepcopy(base), options, use_dora=False)
    assert any(".mlp.experts." in name for name, _ in model.named_parameters() if "lora_" in name)
    ids = torch.arange(3, 20)[None]
    with torch.no_grad():
        expected = model(ids).logits
        merged = dict(merged_tensors(model))
        reference = dict(peft_model_of(model).merge_and_unload().state_dict())
    assert sorted(merged) == sorted(base.state_dict())
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-6, atol=1e-6)
    base.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(base(ids).logits, expected, rtol=1e-5, atol=1e-5)
