"""toolkit.testing, the fixtures plugin authors use: tiny models and the 2-process gloo runner."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from toolkit import forkserver
from toolkit.testing import DistributedError, RankResult, run_distributed


def all_reduce_rank_plus_one(scale: float) -> tuple[int, int, float]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([scale * (dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), value.item()


def rank_one_fails() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise RuntimeError("rank one is broken on purpose")
    dist.barrier()  # rank 0 waits here for a rank that never comes


@pytest.mark.slow
def test_run_distributed_returns_each_ranks_value():
    assert run_distributed(all_reduce_rank_plus_one, nproc=2, args=(2.0,)) == [(0, 2, 6.0), (1, 2, 6.0)]


@pytest.mark.slow
def test_run_distributed_reports_the_failing_rank_quickly():
    import time

    start = time.monotonic()
    with pytest.raises(DistributedError) as error:
        run_distributed(rank_one_fails, timeout=120)
    assert "rank 1 exited with 1" in str(error.value) and "rank one is broken on purpose" in str(error.value)
    assert time.monotonic() - start < 60  # the waiting rank is not left to gloo's own timeout


def test_run_distributed_runs_scripts_with_the_torchrun_environment(tmp_path):
    script = tmp_path / "show_env.py"
    script.write_text("import os, sys\nprint(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'], sys.argv[1])\n")
    results = run_distributed(script, nproc=2, args=["hello"])
    assert [r.rank for r in results] == [0, 1] and all(isinstance(r, RankResult) and r.returncode == 0 for r in results)
    ranks = [r.stdout.split() for r in results]
    assert [r[0] for r in ranks] == ["0", "1"] and {r[1] for r in ranks} == {"2"} and {r[3] for r in ranks} == {"hello"}
    assert ranks[0][2] == ranks[1][2]  # one rendezvous port for both


def test_a_failing_script_rank_fails_the_run_without_waiting_for_the_timeout(tmp_path):
    import time

    script = tmp_path / "one_fails.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit('rank 1 gives up')\ntime.sleep(60)\n")
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1 gives up"):
        run_distributed(script, timeout=120)
    assert time.monotonic() - start < 40


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    import socket

    from toolkit.train.distributed import _ephemeral_ports, free_port

    for _ in range(20):
        port = free_port()
        assert port not in _ephemeral_ports()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_run_distributed_retries_a_rendezvous_port_taken_in_the_meantime(monkeypatch):
    """The first port handed out is already listened on (what another process did in CI): the run
    fails with EADDRINUSE there and succeeds on the next port."""
    import socket

    import toolkit.testing as testing

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = testing.free_port
    monkeypatch.setattr(testing, "free_port", lambda: next(ports, None) or real())
    try:
        assert run_distributed(all_reduce_rank_plus_one, nproc=2, args=(2.0,), timeout=120) == \
            run_distributed(all_reduce_rank_plus_one, nproc=2, args=(2.0,), timeout=120)
    finally:
        taken.close()


def test_run_distributed_rejects_functions_other_processes_cannot_import():
    def local():
        return 1

    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(local)


def test_tiny_model_factory_builds_presets_deterministically(tiny_model_factory):
    import torch
    from transformers import AutoModelForCausalLM

    model = tiny_model_factory("qwen2", num_hidden_layers=1)
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 1
    again = tiny_model_factory("tiny-qwen2", num_hidden_layers=1)
    other = tiny_model_factory("qwen2", seed=1, num_hidden_layers=1)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        logits = model(ids).logits
        assert torch.equal(logits, again(ids).logits)
        assert not torch.allclose(logits, other(ids).logits)
        directory = tiny_model_factory.directory("qwen2", num_hidden_layers=1)
        reloaded = AutoModelForCausalLM.from_pretrained(directory).eval()
        torch.testing.assert_close(reloaded(ids).logits, logits)
    assert tiny_model_factory.tokenizer()("hello").input_ids


def test_tiny_model_factory_names_the_families(tiny_model_factory):
    with pytest.raises(ValueError, match="families: llama, mistral, qwen2"):
        tiny_model_factory.config("gpt5")


def test_toolkit_manager_installs_a_fresh_process_wide_manager(toolkit_manager):
    from toolkit import plugins

    before = plugins.get_plugin_manager()
    inner = toolkit_manager(installed=False)
    assert plugins.get_plugin_manager() is inner and inner is not before


PLUGIN_AUTHOR_TESTS = '''
import dataclasses
from toolkit import hookimpl
from toolkit.plugins import get_plugin_manager


class Mine:
    """A loss from a third-party plugin."""
    name = "mine"

    @dataclasses.dataclass(kw_only=True)
    class Config:
        pass

    def __init__(self, config):
        self.config = config


class my_plugin:
    @staticmethod
    @hookimpl
    def toolkit_register_losses(register):
        register(Mine)


def test_uses_the_fixtures(toolkit_manager, cli_runner):
    toolkit_manager(("mine", my_plugin), installed=False)
    assert "mine" in get_plugin_manager().registry("loss")
    result = cli_runner.invoke("mine", "--help")
    assert result.exit_code == 0 and "A loss from a third-party plugin." in result.stdout


def test_the_next_test_does_not_see_it():
    assert "mine" not in get_plugin_manager().registry("loss")
'''


def test_the_fixtures_reach_plugin_authors_through_the_pytest11_entry_point(pytester):
    pytester.makepyfile(test_author=PLUGIN_AUTHOR_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


CPU_TESTS = """
import subprocess, sys

def test_spends_cpu_in_a_subprocess():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 1.5\\nwhile time.process_time() < end: pass"], check=True)

def test_sleeps():
    import time
    time.sleep(1.5)
"""


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_cpu_report_counts_the_subprocesses_a_test_waits_for_not_its_sleep(pytester, workers):
    if workers:
        pytest.importorskip("xdist")
    pytester.makepyfile(test_cpu=CPU_TESTS)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--toolkit-cpu-report", "5", *workers)
    result.assert_outcomes(passed=2)
    lines = result.stdout.lines[next(i for i, line in enumerate(result.stdout.lines) if "CPU time:" in line):]
    assert "over 2 tests" in lines[0]
    spent, top = lines[1].split()
    assert top.endswith("test_spends_cpu_in_a_subprocess") and float(spent.rstrip("s")) >= 1.4
    slept, second = lines[2].split()
    assert second.endswith("test_sleeps") and float(slept.rstrip("s")) < 0.5


def test_children_fork_once_the_conftest_defaults_are_in_the_servers_environment(monkeypatch):
    """A default a conftest puts in ``os.environ`` after toolkit.forkserver was imported (``HF_HUB_OFFLINE``, which
    huggingface_hub reads at import) stops forking until the tests are collected; ``TORCH_EXTENSIONS_DIR``, read only
    when an extension is built, never does, nor ``NVTE_FLASH_ATTN`` (set by megatron-core as it builds a model in the
    test process) without Transformer Engine."""
    argv = [sys.executable, "-c", "pass"]
    monkeypatch.delenv("TOOLKIT_TEST_FORK", raising=False)
    monkeypatch.setattr(forkserver, "_server", None)
    monkeypatch.setattr(forkserver, "_BASE_ENV", {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not forkserver.forkable(argv, None)
    forkserver.take_environment()
    assert forkserver.forkable(argv, None)
    assert forkserver.forkable(argv, {**os.environ, "TORCH_EXTENSIONS_DIR": "/elsewhere"})
    assert not forkserver.forkable(argv, {**os.environ, "HF_HUB_OFFLINE": "0"})
    with_engine = importlib.util.find_spec("transformer_engine") is not None
    assert forkserver.forkable(argv, {**os.environ, "NVTE_FLASH_ATTN": "0"}) is not with_engine


SERVER_OF_THIS_JOB = ("import os; monitor = open(f'/proc/{os.getppid()}/stat').read();"  # the job's parent: its monitor
                      "print(monitor.rsplit(')', 1)[1].split()[1])")                    # whose parent is the server
CLIENT = ("import sys; from toolkit import forkserver;"
          "print(forkserver.run([sys.executable, '-c', sys.argv[1]], capture_output=True, text=True, check=True).stdout)")


def _server_of_a_job(env: dict[str, str]) -> int:
    """A fresh test process (a pytest-xdist worker, the next suite) forks one job: the pid of the server it used."""
    done = subprocess.run([sys.executable, "-c", CLIENT, SERVER_OF_THIS_JOB], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture
def fork_dir():
    """A directory for shared fork servers: short, as a socket's path must be (pytest's tmp_path is too long)."""
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="tf-"))
    yield directory
    forkserver.stop_shared(directory)
    shutil.rmtree(directory, ignore_errors=True)


def test_test_processes_of_a_session_share_one_fork_server_per_import_environment(fork_dir):
    """With TOOLKIT_TEST_FORK_DIR, test processes that agree on the import-time environment use one server (the
    second does not start its own); one that disagrees gets another; stop_shared ends both."""
    tmp_path = fork_dir
    env = {**os.environ, "TOOLKIT_TEST_FORK_DIR": str(tmp_path), "TOOLKIT_TEST_PRELOAD": "json", "HF_HUB_OFFLINE": "1"}
    first, second = _server_of_a_job(env), _server_of_a_job(env)
    other = _server_of_a_job({**env, "HF_HUB_OFFLINE": "0"})
    assert first == second != other
    assert sorted(int(p.read_text()) for p in tmp_path.glob("*/pid")) == sorted({first, other})
    assert _running(first) and _running(other)  # they outlive the processes that started them
    assert forkserver.stop_shared(tmp_path) == 2
    deadline = time.monotonic() + 10
    while (_running(first) or _running(other)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(first) and not _running(other) and not tmp_path.exists()


def test_a_shared_fork_server_ends_when_idle_and_the_next_job_starts_another(fork_dir):
    tmp_path = fork_dir
    env = {**os.environ, "TOOLKIT_TEST_FORK_DIR": str(tmp_path), "TOOLKIT_TEST_PRELOAD": "json",
           "TOOLKIT_TEST_FORK_IDLE": "0.5"}
    first = _server_of_a_job(env)
    deadline = time.monotonic() + 20
    while _running(first) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(first)
    assert not list(tmp_path.glob("*/socket"))  # it took its socket with it
    second = _server_of_a_job(env)
    assert second != first and _running(second)


BURN_AND_COUNT = """
import resource, subprocess, sys, time
from toolkit import forkserver
forkserver.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.0: pass"],
               check=True)
time.sleep(3.0)  # the shared server ends, idle
subprocess.run(["true"])  # reaps this process's finished children, as any later subprocess of a test session does
children = resource.getrusage(resource.RUSAGE_CHILDREN)
print(children.ru_utime + children.ru_stime, forkserver.forked_cpu_seconds)
"""


def test_a_forked_jobs_cpu_is_counted_once_after_its_shared_server_ends(fork_dir):
    """CpuReport adds the jobs' CPU (forked_cpu_seconds); the shared server that forked them, its own CPU holding
    theirs, must not be reaped into the test process's children too (it is detached, not a child)."""
    env = {**os.environ, "TOOLKIT_TEST_FORK_DIR": str(fork_dir), "TOOLKIT_TEST_PRELOAD": "json",
           "TOOLKIT_TEST_FORK_IDLE": "0.5"}
    done = subprocess.run([sys.executable, "-c", BURN_AND_COUNT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    children, forked = map(float, done.stdout.split()[-2:])
    assert forked >= 1.0 and children < 0.5, (children, forked)


def test_a_shared_fork_directory_too_long_for_a_socket_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TOOLKIT_TEST_FORK_DIR", str(tmp_path / ("x" * 100)))
    with pytest.raises(RuntimeError, match="TOOLKIT_TEST_FORK_DIR=.* is too long a path"):
        forkserver._Server()


def _resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_fresh_toolkit_process_of_a_test_is_forked_and_dies_with_its_stand_in(tmp_path, monkeypatch):
    """In a session that shares fork servers, a test's plain ``subprocess`` ``python -m toolkit ...`` (torchrun's
    ranks, runs the web UI launches) hands itself to the running server: the process its parent holds stays a small
    stand-in without torch (a fresh interpreter that trained holds several hundred MiB), and killing it ends the job."""
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="forks-", dir="/tmp"))  # a socket's path ends at 107 bytes: not tmp_path
    monkeypatch.setenv(forkserver.SHARED_DIR_VARIABLE, str(shared))
    site = str(Path(forkserver.__file__).with_name("_forksite"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([site, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))
    monkeypatch.setattr(forkserver, "_server", None)
    monkeypatch.setattr(forkserver, "_BASE_ENV", dict(os.environ))
    assert forkserver.run([sys.executable, "-c", "pass"]).returncode == 0  # the shared server, started and warm
    run = tmp_path / "run"
    stand_in = subprocess.Popen([sys.executable, "-m", "toolkit", "sft", "--model", "tiny-llama", "--dataset", "demo",
                                 "--seq-len", "32", "--max-steps", "100000", "--output", str(run)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (run / "metrics.jsonl").is_file() or not (run / "metrics.jsonl").read_text().strip():
            assert stand_in.poll() is None and time.monotonic() < deadline, "the run never logged a step"
            time.sleep(0.2)
        assert _resident_mib(stand_in.pid) < 100  # torch alone is more
        stand_in.kill()
        stand_in.wait()
        time.sleep(2)  # the server's watcher ends the job within 0.05 s of losing its client
        size = (run / "metrics.jsonl").stat().st_size
        time.sleep(3)
        assert (run / "metrics.jsonl").stat().st_size == size, "the job trained on after its stand-in was killed"
    finally:
        stand_in.kill()
        forkserver.stop_shared(shared)
