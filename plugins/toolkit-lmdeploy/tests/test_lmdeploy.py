"""The lmdeploy exporter against LMDeploy's documented requirements, and the server command line
the backend builds, run end to end against a fake ``python -m lmdeploy`` (LMDeploy has no CPU engine)."""

from __future__ import annotations

import importlib.util
import json
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path

import pytest


def export_model(factory, family: str, head_dim: int):
    """An ``ExportModel`` over a tiny preset model with ``head_dim`` (what a strategy hands an exporter)."""
    from toolkit.contracts import ExportModel, ModelSource

    net = factory(family, head_dim=head_dim, hidden_size=4 * head_dim, num_hidden_layers=1)
    source = ModelSource(reference=f"tiny-{family}", directory=Path("."), config=net.config,
                         tokenizer=factory.tokenizer(), weight_files=[])
    return ExportModel(source=source, tensors=lambda: iter(net.state_dict().items())), net


def test_qwen2_head_dim_64_exports_for_turbomind_in_bfloat16(tmp_path, tiny_model_factory):
    import torch
    from safetensors.torch import load_file

    from toolkit_lmdeploy.exporter import LMDeployExporter, check_export

    model, net = export_model(tiny_model_factory, "qwen2", head_dim=64)
    out = LMDeployExporter().export(model, tmp_path / "lmd")
    manifest = json.loads((out / "toolkit_export.json").read_text())
    assert manifest["engine"] == "turbomind" and "--backend turbomind --dtype bfloat16" in manifest["serve"]
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16" and config["architectures"] == ["Qwen2ForCausalLM"]
    written = {}
    for file in out.glob("*.safetensors"):
        written.update(load_file(str(file)))
    expected = {k: v for k, v in net.state_dict().items() if k != "lm_head.weight"}  # tied to the embeddings
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], v.to(torch.bfloat16)) for k, v in expected.items())
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == model.source.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert check_export(out, engine="turbomind").errors == []


def test_llama_head_dim_32_falls_back_to_pytorch_and_turbomind_says_why(tmp_path, tiny_model_factory):
    from toolkit.hfdir import ExportError
    from toolkit_lmdeploy.exporter import LMDeployExporter

    model, _ = export_model(tiny_model_factory, "llama", head_dim=32)
    with pytest.raises(ExportError, match="TurboMind runs LlamaForCausalLM only with head_dim 64 or 128, this model has 32"):
        LMDeployExporter(LMDeployExporter.Config(engine="turbomind")).export(model, tmp_path / "tm")
    out = LMDeployExporter().export(model, tmp_path / "auto")
    assert json.loads((out / "toolkit_export.json").read_text())["engine"] == "pytorch"


@pytest.mark.parametrize(("config", "engine", "message"), [
    ({"architectures": ["MistralForCausalLM"], "head_dim": 128, "use_sliding_window": True, "sliding_window": 4096},
     "turbomind", "sliding-window"),
    ({"architectures": ["GPT2LMHeadModel"], "hidden_size": 64, "num_attention_heads": 1}, "auto", "neither LMDeploy engine"),
    ({"architectures": ["GPT2LMHeadModel"]}, "pytorch", "PyTorch engine's supported list"),
    ({"architectures": ["Qwen3ForCausalLM"], "head_dim": 128, "dtype": "float32"}, "auto", "float16 or bfloat16"),
    ({}, "auto", "no 'architectures'"),
])
def test_checks_follow_lmdeploy_documented_tables(config, engine, message):
    from toolkit_lmdeploy.requirements import check_model_config

    found = check_model_config(config, engine=engine)
    assert any(message in e for e in found.errors), found.errors


def test_documented_families_resolve_to_the_engine_lmdeploy_picks():
    from toolkit_lmdeploy.requirements import check_model_config

    def engine(arch, **config):
        return check_model_config({"architectures": [arch], "dtype": "bfloat16", **config}).engine

    assert engine("Qwen3MoeForCausalLM", head_dim=128) == "turbomind"
    assert engine("MixtralForCausalLM", head_dim=128) == "turbomind"
    assert engine("MistralForCausalLM", head_dim=128, use_sliding_window=True, sliding_window=8) == "pytorch"
    assert engine("Gemma2ForCausalLM", head_dim=256) == "pytorch"


@pytest.fixture
def exported(tmp_path, tiny_model_factory):
    from toolkit_lmdeploy.exporter import LMDeployExporter

    model, _ = export_model(tiny_model_factory, "qwen2", head_dim=64)
    return LMDeployExporter().export(model, tmp_path / "model")


def test_serve_command_line(exported):
    from toolkit.errors import ToolkitError
    from toolkit_lmdeploy.backend import LMDeployBackend

    argv = LMDeployBackend().serve_command(exported, "0.0.0.0", 23333, {"session_len": "4096", "log-level": "INFO"}).argv
    assert argv[:6] == [sys.executable, "-m", "lmdeploy", "serve", "api_server", str(exported)]
    line = " ".join(argv)
    assert "--server-name 0.0.0.0 --server-port 23333 --backend turbomind --dtype auto --tp 1" in line
    assert "--session-len 4096" in line and argv[-2:] == ["--log-level", "INFO"]
    with pytest.raises(ToolkitError, match="PyTorch engine only"):
        LMDeployBackend().serve_command(exported, "127.0.0.1", 1, {"adapters": "sft=/tmp/a"})
    argv = LMDeployBackend().serve_command(exported, "127.0.0.1", 1, {"adapters": "sft=/tmp/a,dpo=/tmp/b", "engine": "pytorch"}).argv
    assert argv[argv.index("--backend") + 1] == "pytorch" and argv[argv.index("--adapters") + 1:][:2] == ["sft=/tmp/a", "dpo=/tmp/b"]
    with pytest.raises(ToolkitError, match="lmdeploy adapters option: expected KEY=VALUE .* got 'dpo'"):
        LMDeployBackend().serve_command(exported, "127.0.0.1", 1, {"adapters": "sft=/tmp/a,dpo", "engine": "pytorch"})


FAKE_LMDEPLOY = textwrap.dedent("""
    import http.server, json, os, sys
    args = sys.argv[1:]
    with open(os.environ["FAKE_REPORT"], "w") as f:
        json.dump(args, f)
    port = int(args[args.index("--server-port") + 1])
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": args[2]}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


def test_serve_runs_the_command_waits_prints_url_and_stops(exported, tmp_path):
    package = tmp_path / "fake" / "lmdeploy"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(FAKE_LMDEPLOY)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    report = tmp_path / "argv.json"
    code = ("import sys; from toolkit_lmdeploy.backend import LMDeployBackend; "
            f"LMDeployBackend().serve({str(exported)!r}, '127.0.0.1', {port}, {{}})")
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path / "fake"), "FAKE_REPORT": str(report)}
    runner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        for line in runner.stdout:
            if "is ready" in line:
                break
        assert f"LMDeploy api_server is ready: http://127.0.0.1:{port}/v1" in line
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
            assert json.loads(response.read())["data"][0]["id"] == str(exported)
        assert json.loads(report.read_text())[:3] == ["serve", "api_server", str(exported)]
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=30) == 0
    finally:
        if runner.poll() is None:
            runner.kill()


@pytest.mark.skipif(importlib.util.find_spec("lmdeploy") is not None, reason="LMDeploy is installed here")
def test_missing_lmdeploy_says_what_to_do(exported):
    from toolkit_lmdeploy.backend import EngineMissingError, LMDeployBackend

    with pytest.raises(EngineMissingError, match="pip install lmdeploy.*no CPU engine"):
        LMDeployBackend().generate(exported, ["hi"], {})


def test_registered_under_its_names():
    from toolkit.plugins import get_plugin_manager

    toolkit = get_plugin_manager()
    assert toolkit.registry("exporter").get("lmdeploy").__name__ == "LMDeployExporter"
    assert toolkit.registry("inference_backend").get("lmdeploy").__name__ == "LMDeployBackend"


def test_tp_and_the_final_folder_are_written_into_the_serve_line(tmp_path, tiny_model_factory):
    """`--tp 2` reaches LMDeploy's `--tp`, after a check of the heads; the serve line names the folder the export
    ends in, not the staging folder it was written to (which is gone by then)."""
    import shlex

    from toolkit.errors import ToolkitError
    from toolkit.export import export_model as write_export
    from toolkit_lmdeploy.exporter import LMDeployExporter

    model, net = export_model(tiny_model_factory, "qwen2", head_dim=64)
    heads = net.config.num_attention_heads
    out = write_export(model, "lmdeploy", tmp_path / "served", options=LMDeployExporter.Config(tp=2))
    serve = shlex.split(json.loads((out / "toolkit_export.json").read_text())["serve"])
    assert serve[3] == str(tmp_path / "served") and serve[serve.index("--tp") + 1] == "2"
    with pytest.raises(ToolkitError, match=rf"LMDeploy at --tp {heads + 1}: attention heads {heads} / tp {heads + 1}"):
        write_export(model, "lmdeploy", tmp_path / "refused", options=LMDeployExporter.Config(tp=heads + 1))
    assert not (tmp_path / "refused").exists()
