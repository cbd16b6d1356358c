"""HF <-> Megatron-Core bridge: logits equal HF at every layout, exact round trips, mcore export."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import needs_transformers_family, torchrun

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
LAYOUTS = "tp=1,tp=2,tp=2+sp=1,pp=2,pp=2+vpp=2,cp=2"
JOBS = {  # name: (tiny model, layouts); "llama-mcore" reads the mcore checkpoint "llama" saves at TP2
    "qwen2": ("qwen2", LAYOUTS),
    "qwen3": ("qwen3", LAYOUTS),
    "llama": ("llama", LAYOUTS + ",tp=2+export=1+save=1,pp=2+export=1"),  # save: the mcore checkpoint "llama-mcore" reads
    "qwen3_moe": ("qwen3_moe", "ep=2,pp=2,tp=2+sp=1"),
    "mixtral": ("mixtral", "ep=2+export=1,tp=2+sp=1+export=1"),
    "qwen2_moe": ("qwen2_moe", "ep=2+export=1"),
    "qwen3_moe_mixed": ("qwen3_moe_mixed", "ep=2+export=1,pp=2+export=1,tp=2+sp=1"),  # mlp_only_layers: dense + MoE layers
    "mistral": ("mistral", "tp=2,pp=2"),
    "deepseek_v3": ("deepseek_v3", "tp=2+sp=1+export=1,pp=2,ep=2+export=1,cp=2"),
    "deepseek_v2": ("deepseek_v2", "tp=2,pp=2+export=1,ep=2,cp=2"),
    # LoRA on the MLA projections vs PEFT: logits, adapter gradients, merged export (no SP: the rotary key's sum)
    "deepseek_v3-lora": ("deepseek_v3", "tp=2+sp=1+lora=1+export=1"),
    "deepseek_v2-lora": ("deepseek_v2", "tp=2+lora=1+export=1"),
    # LoRA on routed experts (PEFT's fused adapters, split per expert and over expert-TP) and on shared experts
    "qwen3_moe-lora": ("qwen3_moe", "tp=2+sp=1+lora=1+export=1"),
    "mixtral-lora": ("mixtral", "tp=2+sp=1+lora=1"),
    "qwen2_moe-lora": ("qwen2_moe", "tp=2+sp=1+lora=1+export=1"),
    "llama-mcore": ("llama", "pp=2+mcore=1,tp=2+sp=1+mcore=1"),
    "llama3": ("llama3", "tp=2,cp=2"),  # rope_type llama3 (Llama 3.1+)
    "qwen2_yarn": ("qwen2_yarn", "pp=2,cp=2"),  # rope_type yarn (Qwen long context)
    "phi3": ("phi3", "tp=2+export=1,pp=2+export=1,cp=2"),  # fused qkv_proj / gate_up_proj, longrope, partial rotary
    "glm4": ("glm4", "tp=2+sp=1+export=1,pp=2+export=1,cp=2"),  # interleaved half rotary, post-sublayer norms
    "internlm3": ("internlm3", "tp=2+export=1"),  # transformers' InternLM3: Llama weights under its own model_type
    # Gemma: (1 + w) norms, GeGLU, embedding scale; Gemma 2/3 add soft-capping, window/full layers, post-sublayer norms
    "gemma": ("gemma", "tp=2+export=1,pp=2,cp=2"),
    "gemma2": ("gemma2", "tp=2+export=1,pp=2+export=1,cp=2"),
    "gemma3_text": ("gemma3_text", "tp=2+sp=1+export=1,pp=2+export=1,cp=2"),  # + QK norm, a RoPE per layer type
}


@pytest.fixture(scope="module")
def bridge(tiny_models, tmp_path_factory):
    """Every model and layout the tests compare, in one 2-rank launch (8 launches before: imports and the
    process group are most of each one's cost); {job: {layout: entry}}, plus the mcore checkpoint that "llama" saved
    at TP2 as the mcore exporter's processes do (which test_cli_export_preset_to_mcore_and_back_is_bit_exact runs)
    and "llama-mcore" read back at PP2 and TP2+SP."""
    work = tmp_path_factory.mktemp("bridge")
    mcore_dir = work / "mcore"
    jobs = [{"name": name, "hf_dir": str(tiny_models[arch]), "layouts": layouts,
             **({"mcore_dir": str(mcore_dir)} if "mcore" in layouts or "save" in layouts else {})}
            for name, (arch, layouts) in JOBS.items() if arch in tiny_models]
    (work / "jobs.json").write_text(json.dumps(jobs))
    torchrun("_bridge_worker.py", str(work / "jobs.json"), str(work / "result.json"), timeout=900)
    return {**json.loads((work / "result.json").read_text()), "mcore_dir": mcore_dir}


def _load(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def _assert_close(results: dict) -> None:
    for layout, entry in results.items():
        assert entry["logits"] <= TOLERANCE, f"{layout}: max |megatron - hf| = {entry['logits']}"
        assert entry["packed"] <= TOLERANCE, f"{layout}: packed rows differ from separate HF calls by {entry['packed']}"


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_logits_match_hf_at_every_layout(arch, bridge):
    results = bridge[arch]
    assert set(results) == set(LAYOUTS.split(","))
    _assert_close(results)


def test_llama_logits_and_round_trip_is_bit_exact(tiny_models, bridge):
    """Untied GQA llama at every layout; HF -> mcore (TP2 / PP2) -> HF gives identical tensors."""
    source = tiny_models["llama"]
    results = bridge["llama"]
    assert set(results) == set(JOBS["llama"][1].split(","))
    _assert_close(results)
    original = _load(source)
    for layout in ("tp=2+export=1+save=1", "pp=2+export=1"):
        exported = Path(results[layout]["export_dir"])
        assert (exported / "model.safetensors.index.json").is_file()
        assert len(list(exported.glob("model-*-of-*.safetensors"))) > 1, "expected a sharded checkpoint"
        tensors = _load(exported)
        assert sorted(tensors) == sorted(original)
        for name, tensor in original.items():
            assert torch.equal(tensors[name], tensor), f"{layout}: {name} changed in the round trip"


def test_moe_logits_and_round_trip_with_expert_parallelism(tiny_models, bridge):
    """Qwen3-MoE, Mixtral, Qwen2-MoE (shared expert): EP2, PP2, TP2+SP (experts split over expert-TP)
    equal HF; exports are bit-exact. Qwen3-MoE with ``mlp_only_layers`` (dense MLPs between MoE layers) at EP2,
    at PP2, where each stage builds its own mix of dense and MoE layers, and at TP2+SP (dense MLPs split over TP)."""
    _assert_close(bridge["qwen3_moe"])
    assert set(bridge["qwen3_moe"]) == {"ep=2", "pp=2", "tp=2+sp=1"}
    for arch in ("mixtral", "qwen2_moe", "qwen3_moe_mixed"):
        source = tiny_models[arch]
        results = bridge[arch]
        assert set(results) == set(JOBS[arch][1].split(","))
        _assert_close(results)
        original = _load(source)
        for layout, entry in results.items():
            if "export" not in layout:
                continue
            tensors = _load(Path(entry["export_dir"]))
            assert sorted(tensors) == sorted(original)
            assert all(torch.equal(tensors[n], t) for n, t in original.items()), arch


@pytest.mark.parametrize("job", ["llama3", "qwen2_yarn"])
def test_scaled_rope_logits_match_hf(job, bridge):
    """Llama 3.x rope scaling and YaRN (attention factor != 1): the bridge's RoPE is HF's, at TP2, PP2, CP2."""
    assert set(bridge[job]) == set(JOBS[job][1].split(","))
    _assert_close(bridge[job])


@pytest.mark.parametrize("job", ["phi3", "glm4", pytest.param("internlm3", marks=needs_transformers_family("internlm3")),
                                 "gemma", "gemma2", "gemma3_text"])
def test_added_dense_family_logits_and_round_trip(job, tiny_models, bridge):
    """Families whose HF weights or layers differ from Llama's: logits equal HF at TP2, PP2, CP2 and
    the TP2 / PP2 exports give back the very tensors of the checkpoint (fused ones re-fused bit for bit).
    Gemma 2 / 3 with soft-capped attention (2) and output logits, a window of 4 on every other layer of the
    16-token rows (both layer types on each PP2 stage), and (3) a linear-scaled RoPE on the full layers only:
    tests/test_families.py checks that each of these changes transformers' logits."""
    results = bridge[job]
    assert set(results) == set(JOBS[job][1].split(","))
    _assert_close(results)
    original = _load(tiny_models[JOBS[job][0]])
    for layout, entry in results.items():
        if "export" in layout:
            tensors = _load(Path(entry["export_dir"]))
            assert sorted(tensors) == sorted(original), layout
            for name, tensor in original.items():
                assert torch.equal(tensors[name], tensor), f"{layout}: {name} changed in the round trip"


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_mla_logits_and_round_trip(arch, tiny_models, bridge):
    """DeepSeek-V3 (MLA with a query latent, sigmoid grouped top-k with the score-correction bias, a shared
    expert, a dense first layer) and DeepSeek-V2 (V2-Lite's MLA without a query latent, YaRN, softmax
    group-limited top-k, 2 shared experts): TP2(+SP), PP2, EP2, CP2 equal HF; exports are bit-exact."""
    results = bridge[arch]
    assert set(results) == set(JOBS[arch][1].split(","))
    _assert_close(results)
    original = _load(tiny_models[arch])
    exports = [entry["export_dir"] for entry in results.values() if "export_dir" in entry]
    assert exports
    for directory in exports:
        tensors = _load(Path(directory))
        assert sorted(tensors) == sorted(original)
        for name, tensor in original.items():
            assert torch.equal(tensors[name], tensor), f"{arch} {directory}: {name} changed in the round trip"


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_lora_matches_peft(arch, bridge):
    """LoRA under --strategy megatron at TP2 from PEFT's own adapters (random B), targets in _bridge_worker's
    LORA_TARGETS: DeepSeek's latent attention (q_a/q_b (V3) or q (V2), kv_a_proj_with_mqa, kv_b, o; V2 without
    sequence parallelism, where each rank's rotary-key gradient covers its own heads only and is summed over TP),
    Qwen3-MoE's and Mixtral's routed experts (PEFT's one adapter per fused expert parameter, split per expert and
    over expert-TP) and Qwen2-MoE's shared expert. Logits equal PEFT's, every adapter gradient of
    ``sum(logits * W)`` gathered back into PEFT's layout equals PEFT's, the gathered adapters loaded into PEFT give
    its logits, and the merged export gives PEFT's merge_and_unload logits."""
    from transformers import AutoModelForCausalLM

    (entry,) = bridge[f"{arch}-lora"].values()
    assert entry["lora_logits"] <= TOLERANCE and entry["lora_gathered"] <= TOLERANCE, entry
    assert entry["lora_grad_max"] > 1.0 and entry["lora_grads"] <= 1e-5 * entry["lora_grad_max"], entry
    if "lora_merged" not in entry:
        return
    directory = Path(entry["lora_merged"])
    expected = torch.load(directory / "peft_merged_logits.pt")  # PEFT's merge_and_unload on the worker's ids
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)(expected["ids"]).logits
    torch.testing.assert_close(merged, expected["logits"], rtol=TOLERANCE, atol=TOLERANCE)


def test_mistral_tp2(bridge):
    assert set(bridge["mistral"]) == {"tp=2", "pp=2"}
    _assert_close(bridge["mistral"])


def test_mcore_export_at_tp2_loads_at_pp2_and_back_to_hf(tiny_models, bridge):
    from toolkit.plugins import get_plugin_manager

    source = tiny_models["llama"]
    mcore_dir = bridge["mcore_dir"]  # saved by "llama" at TP2, read back by the launch at PP2 and TP2+SP
    assert (mcore_dir / "toolkit_mcore.json").is_file()

    results = bridge["llama-mcore"]
    assert set(results) == {"pp=2+mcore=1", "tp=2+sp=1+mcore=1"}
    _assert_close(results)

    resolved = get_plugin_manager().resolve_export_source(str(mcore_dir))
    assert resolved is not None and resolved.source.config.model_type == "llama"
    tensors = dict(resolved.tensors())
    original = _load(source)
    assert sorted(tensors) == sorted(original)
    assert all(torch.equal(tensors[n], t) for n, t in original.items())
    assert get_plugin_manager().resolve_export_source(str(source)) is None  # HF dirs are not claimed


def test_cli_export_preset_to_mcore_and_back_is_bit_exact(tmp_path):
    import os

    from toolkit.testing import run_python

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}

    def toolkit(*args: str) -> None:
        result = run_python(["-m", "toolkit", *args], env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]

    toolkit("export", "tiny-qwen2", "--to", "mcore", "--output", str(tmp_path / "mcore"), "--tp", "2")
    marker = json.loads((tmp_path / "mcore" / "toolkit_mcore.json").read_text())
    assert marker["saved_layout"]["tensor"] == 2, marker  # the flag reached the exporter
    toolkit("export", str(tmp_path / "mcore"), "--to", "hf", "--output", str(tmp_path / "back"))
    toolkit("export", "tiny-qwen2", "--to", "hf", "--output", str(tmp_path / "direct"))
    back, direct = _load(tmp_path / "back"), _load(tmp_path / "direct")
    assert sorted(back) == sorted(direct)
    assert all(torch.equal(back[name], tensor) for name, tensor in direct.items())
    assert (tmp_path / "back" / "tokenizer.json").is_file()
