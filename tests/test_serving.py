"""toolkit.serving against a fake engine server: waits until it answers, prints the URL, ends the
whole process tree on SIGTERM, and reports an early exit or a server that never answers."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from toolkit.testing import free_port

FAKE_SERVER = textwrap.dedent("""
    import http.server, json, os, subprocess, sys, time
    report, delay, port, code = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(report, "w") as f:
        json.dump({"pid": os.getpid(), "child": child.pid, "env": os.environ.get("FAKE_ENV")}, f)
    time.sleep(delay)
    if code:
        print("fake engine: out of memory", flush=True)
        sys.exit(code)
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
""")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def command(tmp_path: Path, port: int, delay: float = 0.5, code: int = 0):
    from toolkit.serving import ServerCommand

    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    argv = [sys.executable, str(script), str(tmp_path / "report.json"), str(delay), str(port), str(code)]
    return ServerCommand(argv=argv, host="127.0.0.1", port=port, env={"FAKE_ENV": "set"}, name="fake engine")


def test_serve_forever_prints_url_and_ends_the_tree_on_sigterm(tmp_path):
    port = free_port()
    cmd = command(tmp_path, port, delay=1.0)
    code = ("import json, sys; from toolkit.serving import ServerCommand, serve_forever; "
            "c = ServerCommand(**json.loads(sys.argv[1])); sys.exit(serve_forever(c, startup_timeout_s=60))")
    spec = json.dumps({"argv": cmd.argv, "host": cmd.host, "port": cmd.port, "env": cmd.env, "name": cmd.name})
    runner = subprocess.Popen([sys.executable, "-c", code, spec], stdout=subprocess.PIPE, text=True)
    lines = []
    try:
        for line in runner.stdout:
            lines.append(line)
            if "is ready" in line:
                break
        assert f"fake engine is ready: http://127.0.0.1:{port}/v1" in lines[-1], lines
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["env"] == "set" and alive(report["pid"]) and alive(report["child"])
        runner.send_signal(signal.SIGTERM)
        assert runner.wait(timeout=30) == 0
    finally:
        if runner.poll() is None:
            runner.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (alive(report["pid"]) or alive(report["child"])):
        time.sleep(0.1)
    assert not alive(report["pid"]) and not alive(report["child"])


def test_early_exit_names_code_and_log(tmp_path):
    from toolkit.serving import RunningServer, ServeError

    with RunningServer(command(tmp_path, free_port(), delay=0.2, code=3)) as server, \
            pytest.raises(ServeError, match=r"(?s)exited with code 3 before answering.*out of memory"):
        server.wait_ready(timeout_s=30, poll_s=0.1)


def test_server_that_never_answers_times_out_and_is_stopped(tmp_path):
    from toolkit.serving import RunningServer, ServeError

    server = RunningServer(command(tmp_path, free_port(), delay=600))
    with pytest.raises(ServeError, match="did not answer"):
        server.wait_ready(timeout_s=1.5, poll_s=0.2)
    report = json.loads((tmp_path / "report.json").read_text())
    assert server.process.poll() is not None and not alive(report["child"])


def test_split_extra_applies_known_fields_and_passes_the_rest():
    from dataclasses import dataclass

    from toolkit.serving import engine_flags, split_extra

    @dataclass(kw_only=True)
    class Config:
        tp: int = 1
        name: str = ""

    config, rest = split_extra(Config(), ["tp=4", "max-model-len=512", "enable-prefix-caching=true", "skip=false"])
    assert config.tp == 4 and rest == {"max-model-len": "512", "enable-prefix-caching": "true", "skip": "false"}
    assert engine_flags(rest) == ["--max-model-len", "512", "--enable-prefix-caching"]


def test_the_server_log_path_has_no_space(tmp_path):
    from toolkit.serving import RunningServer, ServerCommand

    with RunningServer(ServerCommand(argv=["true"], host="127.0.0.1", port=1, env={}, name="vLLM server")) as server:
        assert " " not in str(server.log_path) and server.log_path.name.startswith("toolkit-vllm-server-")
    server.log_path.unlink(missing_ok=True)


def test_infer_takes_backend_options_and_names_the_valid_ones(cli_runner):
    from toolkit.builtins.inference import GenerateConfig, HFBackend
    from toolkit.models import materialize_preset

    short = cli_runner.invoke("infer", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "8", "--option", "max_new_tokens=2")
    assert short.exit_code == 0, short.output
    [two] = HFBackend().generate(materialize_preset("tiny-llama"), ["Hello"], GenerateConfig(max_new_tokens=2))
    [eight] = HFBackend().generate(materialize_preset("tiny-llama"), ["Hello"], GenerateConfig(max_new_tokens=8))
    assert short.stdout.strip().splitlines()[-1] == two.strip() != eight.strip()  # the option won over the flag's 8
    wrong = cli_runner.invoke("infer", "tiny-llama", "--prompt", "Hello", "--option", "nosuch=1")
    assert wrong.exit_code != 0 and "nosuch" in wrong.output and "its options: max_new_tokens" in wrong.output


def test_infer_samples_with_the_sampling_flags_and_refuses_bad_ones(cli_runner):
    """--temperature/--top-p/--top-k (toolkit.inference.SamplingOptions, the flags toolkit grpo takes too) reach
    transformers' generate: --top-k 1 and a tiny --top-p are greedy at any temperature, a hot temperature alone is
    not (the tiny model's distribution is near uniform), and a value outside its range is refused before loading."""
    import transformers

    def completion(*flags: str) -> str:
        transformers.set_seed(0)
        result = cli_runner.invoke("infer", "tiny-llama", "--prompt", "Hello", "--max-new-tokens", "12", *flags)
        assert result.exit_code == 0, result.output
        return result.stdout.strip().splitlines()[-1]

    greedy = completion()
    assert completion("--temperature", "5", "--top-k", "1") == greedy
    assert completion("--temperature", "5", "--top-p", "1e-6") == greedy
    assert completion("--temperature", "5") != greedy
    bad = cli_runner.invoke("infer", "tiny-llama", "--prompt", "Hello", "--top-p", "0", "--top-k", "-1")
    assert bad.exit_code != 0 and "top_p must lie in (0, 1], got 0.0" in bad.output and "top_k must be 0" in bad.output
