"""The vllm exporter: the directory reloads in transformers with identical logits, carries every
EOS id and the chat template, holds a PEFT-format adapter, and refuses what vLLM would refuse."""

from __future__ import annotations

import json

import pytest
import vllm_tiny as tiny


@pytest.fixture(scope="module")
def trained():
    return tiny.model("llama", train_steps=10)


def test_callable_adapter_form_is_accepted(tmp_path, trained):
    from toolkit_vllm.exporter import adapter_parts, write_lora_adapter

    net, _ = trained
    (config, tensors), _ = tiny.lora_adapter(net, rank=4)
    called = write_lora_adapter(lambda: (config, tensors()), tmp_path / "a")  # what toolkit.export passes
    assert called["r"] == 4 and (tmp_path / "a" / "adapter_model.safetensors").is_file()
    assert adapter_parts((config, tensors))[0] == config


def test_export_reloads_with_identical_logits_and_metadata(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from toolkit_vllm.exporter import VLLMExporter, check_export

    net, tok = tiny.model("llama", head_dim=64, intermediate_size=1024, train_steps=2)  # 3 MiB per layer
    out = VLLMExporter(VLLMExporter.Config(max_shard_size_mb=1)).export(tiny.export_model(net, tok), tmp_path / "vllm")

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((out / s).is_file() for s in shards)
    assert set(index["weight_map"]) == set(net.state_dict())

    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = torch.tensor([tok("the quick brown fox")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, net(ids).logits)

    tok2 = AutoTokenizer.from_pretrained(str(out))
    message = [{"role": "user", "content": "hello"}]
    assert tok2.apply_chat_template(message, add_generation_prompt=True) == tok.apply_chat_template(message, add_generation_prompt=True)
    generation = json.loads((out / "generation_config.json").read_text())
    expected = {tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")}
    assert set(generation["eos_token_id"]) == expected
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "float32"
    assert check_export(out, device="cpu").errors == []
    manifest = json.loads((out / "toolkit_export.json").read_text())
    assert manifest["lora_modules"] == {} and "--dtype float32" in manifest["serve"]


def test_export_casts_to_bfloat16(tmp_path, trained):
    import torch
    from safetensors import safe_open

    from toolkit_vllm.exporter import VLLMExporter

    net, tok = trained
    out = VLLMExporter(VLLMExporter.Config(dtype="bfloat16")).export(tiny.export_model(net, tok), tmp_path / "bf16")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    file = next(out.glob("*.safetensors"))
    with safe_open(str(file), framework="pt") as handle:
        name = next(iter(handle.keys()))
        assert handle.get_tensor(name).dtype == torch.bfloat16
        assert torch.equal(handle.get_tensor(name), net.state_dict()[name].to(torch.bfloat16))


def test_cpu_target_refuses_head_dim_16_and_names_it(tmp_path):
    from toolkit.hfdir import ExportError
    from toolkit_vllm.exporter import VLLMExporter

    net, tok = tiny.model("llama", head_dim=16, train_steps=0)
    with pytest.raises(ExportError, match="head_dim 16 is not supported by vLLM's CPU attention"):
        VLLMExporter(VLLMExporter.Config(device="cpu")).export(tiny.export_model(net, tok), tmp_path / "cpu")
    assert not (tmp_path / "cpu").exists()
    # The GPU build has no such limit: the same model exports (with a warning) for device=any.
    out = VLLMExporter(VLLMExporter.Config(device="any")).export(tiny.export_model(net, tok), tmp_path / "any")
    assert (out / "config.json").is_file()


def test_model_checks_name_what_is_wrong():
    from toolkit_vllm.requirements import check_model_config

    found = check_model_config({"architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_attention_heads": 4,
                                "max_position_embeddings": 128}, device="cpu", dtype="int8")
    text = "\n".join(found.errors)
    assert "'BertForMaskedLM' is not one vLLM runs natively" in text
    assert "head_dim 16" in text and "dtype 'int8'" in text
    assert check_model_config({"architectures": ["Qwen2ForCausalLM"], "head_dim": 64, "max_position_embeddings": 8},
                              device="cpu").errors == []


def test_lora_adapter_directory_loads_in_peft_and_equals_the_merge(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out, base, merged, tok = tiny.lora_export(tmp_path, rank=4, alpha=8)
    adapter_dir = out / "lora" / "adapter"
    state = load_file(str(adapter_dir / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in state
    assert len(state) == 2 * 2 * 2  # layers x targets x (A, B)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    assert config["base_model_name_or_path"] == str((tmp_path / "base").resolve())
    manifest = json.loads((out / "toolkit_export.json").read_text())
    assert manifest["lora_modules"] == {"adapter": "lora/adapter"} and manifest["max_lora_rank"] == 8
    assert manifest["lora_base"] == config["base_model_name_or_path"] and "--enable-lora" in manifest["serve"]
    # PEFT, an independent reader, applies the adapter to the base and gets the merged model.
    peft = pytest.importorskip("peft")
    on_base = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")), str(adapter_dir))
    ids = torch.tensor([tok("the quick brown fox")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(on_base(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(base(ids).logits, merged(ids).logits, atol=1e-3)


@pytest.mark.parametrize(("extra", "message"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias"),
    ({"r": 1024}, "greater than vLLM's largest max_lora_rank"),
    ({"target_modules": ["dense_h_to_4h"]}, "not LoRA-capable"),
])
def test_adapter_checks_refuse_what_vllm_refuses(extra, message):
    from toolkit_vllm.requirements import check_adapter_config

    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **extra}
    assert any(message in e for e in check_adapter_config(config).errors)
    assert check_adapter_config({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj", "v_proj"]}).errors == []


def test_adapter_only_export_through_the_core(tmp_path, trained):
    from toolkit.export import export_model
    from toolkit.hfdir import ExportError

    net, tok = trained
    adapter, _ = tiny.lora_adapter(net, rank=4)
    out = export_model(tiny.export_model(net, tok, adapter=adapter), "vllm", tmp_path / "only", adapter_only=True)
    assert sorted(p.name for p in out.iterdir() if p.name != ".toolkit-export") == ["adapter_config.json", "adapter_model.safetensors"]
    dora, _ = tiny.lora_adapter(net, rank=4, use_dora=True)
    with pytest.raises(ExportError, match="DoRA"):
        export_model(tiny.export_model(net, tok, adapter=dora), "vllm", tmp_path / "dora", adapter_only=True)
    assert not (tmp_path / "dora").exists()


def test_an_adapter_vllm_refuses_leaves_the_merged_export_and_says_why(tmp_path, trained, caplog):
    from toolkit_vllm.exporter import VLLMExporter

    net, tok = trained
    dora, _ = tiny.lora_adapter(net, rank=4, use_dora=True)
    out = VLLMExporter().export(tiny.export_model(net, tok, adapter=dora), tmp_path / "dora")
    assert (out / "config.json").is_file() and not (out / "lora").exists()
    assert json.loads((out / "toolkit_export.json").read_text())["lora_modules"] == {}
    assert "the adapter is not written (vLLM would refuse it): the adapter uses DoRA" in caplog.text


def test_the_serve_line_names_the_final_folder_not_the_staging_one(tmp_path):
    import shlex

    from toolkit.export import export_model

    net, tok = tiny.model("llama")
    out = export_model(tiny.export_model(net, tok), "vllm", tmp_path / "served")  # written to a staging folder, renamed
    serve = shlex.split(json.loads((out / "toolkit_export.json").read_text())["serve"])
    assert serve[:2] == ["vllm", "serve"] and serve[2] == str((tmp_path / "served").resolve())
    assert (tmp_path / "served" / "config.json").is_file()


def test_tp_is_checked_against_the_model_and_written_into_the_serve_line(tmp_path, cli_runner):
    """`toolkit export --to vllm --tp N`: the layout the export is served on. tiny-llama has 4 attention heads, 2
    key/value heads and an MLP of 256: tp 2 splits all three, tp 4 replicates the key/value heads (vLLM does), and
    tp 3 splits no head count, which is refused before anything is written."""
    import shlex

    for tp in (2, 4):
        out = tmp_path / f"tp{tp}"
        result = cli_runner.invoke("export", "tiny-llama", "--to", "vllm", "--tp", str(tp), "--output", str(out))
        assert result.exit_code == 0, result.output
        manifest = json.loads((out / "toolkit_export.json").read_text())
        serve = shlex.split(manifest["serve"])
        assert manifest["tensor_parallel_size"] == tp and serve[serve.index("--tensor-parallel-size") + 1] == str(tp)
    result = cli_runner.invoke("export", "tiny-llama", "--to", "vllm", "--tp", "3", "--output", str(tmp_path / "tp3"))
    assert result.exit_code != 0 and not (tmp_path / "tp3").exists()
    assert "vLLM at --tp 3: attention heads 4 / tp 3 = 1.33 is not a whole number" in result.output
    assert "key/value heads 2 neither split over tp 3" in result.output and "Traceback" not in result.output
    result = cli_runner.invoke("export", "tiny-llama", "--to", "vllm", "--pp", "2", "--output", str(tmp_path / "pp2"))
    assert result.exit_code != 0 and "--pp" in result.output and not (tmp_path / "pp2").exists()
