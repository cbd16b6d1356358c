"""noxfile.py finds plugins from plugins/*/pyproject.toml and honours [tool.toolkit.nox]."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def noxfile():
    pytest.importorskip("nox")
    spec = importlib.util.spec_from_file_location("toolkit_noxfile", ROOT / "noxfile.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def write_plugin(root: Path, name: str, nox_table: str = "") -> None:
    path = root / "plugins" / name
    path.mkdir(parents=True)
    (path / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "0.1"\n{nox_table}')


def test_the_repository_plugins_are_discovered(noxfile):
    names = {p.name for p in noxfile.PLUGINS}
    on_disk = {p.name for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").is_file()}
    assert "toolkit-example" in names and len(names) == len(on_disk)


def test_opt_in_settings_and_defaults(noxfile, tmp_path):
    write_plugin(tmp_path, "toolkit-plain")
    write_plugin(tmp_path, "toolkit-engine", '[tool.toolkit.nox]\nown-session = true\nrequires = ["toolkit-plain"]\n'
                                             'install = ["engine==1.0"]\npython = "3.12"\nenv = {A = "1"}\n')
    plain, engine = sorted(noxfile.discover_plugins(tmp_path), key=lambda p: p.name != "toolkit-plain")
    assert (plain.own_session, plain.extras, plain.requirement) == (False, ["test"], "toolkit-plain[test]")
    assert (engine.own_session, engine.requires, engine.install, engine.python, engine.env, engine.short) == (
        True, ["toolkit-plain"], ["engine==1.0"], "3.12", {"A": "1"}, "engine")


def test_unknown_keys_are_refused(noxfile, tmp_path):
    write_plugin(tmp_path, "toolkit-typo", "[tool.toolkit.nox]\nown_sesion = true\n")
    with pytest.raises(SystemExit, match="unknown keys in \\[tool.toolkit.nox\\]: own_sesion"):
        noxfile.discover_plugins(tmp_path)


@pytest.fixture(scope="module")
def nox_list():
    """``nox -l`` of the repository's noxfile, run once for the tests that read it."""
    result = subprocess.run([sys.executable, "-m", "nox", "-l", "-f", str(ROOT / "noxfile.py")], capture_output=True, text=True, timeout=120)
    if "No module named nox" in result.stderr:
        pytest.skip("nox is not installed")
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_nox_lists_the_sessions(nox_list):
    for session in ("tests", "lint", "demo", "bench"):
        assert f" {session} " in nox_list + " "


def test_plugins_naming_one_session_share_it(noxfile, tmp_path):
    write_plugin(tmp_path, "toolkit-a", '[tool.toolkit.nox]\nown-session = true\nsession = "engine"\n')
    write_plugin(tmp_path, "toolkit-b", '[tool.toolkit.nox]\nown-session = true\nsession = "engine"\n')
    write_plugin(tmp_path, "toolkit-c", '[tool.toolkit.nox]\nown-session = true\n')
    names = {p.name: p.session_name for p in noxfile.discover_plugins(tmp_path)}
    assert names == {"toolkit-a": "tests-engine", "toolkit-b": "tests-engine", "toolkit-c": "tests-c"}


def test_a_suite_session_runs_a_shared_plugins_suite_in_another_lane(noxfile, tmp_path):
    """suite-session: the plugin stays in the shared venv (other suites use it) and its suite runs in the named own
    session, which installs it; naming no own session is refused with the file."""
    write_plugin(tmp_path, "toolkit-engine", '[tool.toolkit.nox]\nown-session = true\n')
    write_plugin(tmp_path, "toolkit-guest", '[tool.toolkit.nox]\nsuite-session = "engine"\nrequires = ["toolkit-plain"]\n')
    write_plugin(tmp_path, "toolkit-plain")
    plugins = {p.name: p for p in noxfile.discover_plugins(tmp_path)}
    sessions = noxfile.own_sessions(list(plugins.values()))
    assert {name: ([p.name for p in members], [p.name for p in guests]) for name, (members, guests) in sessions.items()} == {
        "tests-engine": (["toolkit-engine"], ["toolkit-guest"])}
    assert [noxfile.suite_session(plugins[n]) for n in ("toolkit-engine", "toolkit-guest", "toolkit-plain")] == [
        "tests-engine", "tests-engine", "tests"]
    assert not plugins["toolkit-guest"].own_session  # so install_shared installs it

    write_plugin(tmp_path, "toolkit-lost", '[tool.toolkit.nox]\nsuite-session = "nowhere"\n')
    with pytest.raises(SystemExit, match=r"toolkit-lost/pyproject.toml: suite-session 'nowhere' must name"):
        noxfile.own_sessions(noxfile.discover_plugins(tmp_path))


def test_a_suite_on_one_process_runs_first_in_its_lane(noxfile, tmp_path):
    """The own sessions run one after another beside the shared one: the session holding a suite that runs on one
    process (workers = 1) goes first, and that suite first within it, so the end of the run, once the shared session
    is done, is left to suites that use both cores."""
    write_plugin(tmp_path, "toolkit-alpha", '[tool.toolkit.nox]\nown-session = true\n')
    write_plugin(tmp_path, "toolkit-guest", '[tool.toolkit.nox]\nsuite-session = "zeta"\n')
    write_plugin(tmp_path, "toolkit-zeta", '[tool.toolkit.nox]\nown-session = true\nworkers = 1\n')
    sessions = noxfile.own_sessions(noxfile.discover_plugins(tmp_path))
    assert list(sessions) == ["tests-zeta", "tests-alpha"]
    members, guests = sessions["tests-zeta"]
    assert [p.name for p in noxfile.one_process_first([*guests, *members])] == ["toolkit-zeta", "toolkit-guest"]


def test_the_repositorys_suites_each_run_in_exactly_one_session(noxfile):
    sessions = noxfile.own_sessions(noxfile.PLUGINS)
    runs = [p.name for members, guests in sessions.values() for p in [*members, *guests]]
    runs += [p.name for p in noxfile.PLUGINS if not p.own_session and not p.suite_session and not p.skip]
    assert sorted(runs) == sorted(p.name for p in noxfile.PLUGINS if not p.skip)


def test_the_vllm_engine_is_installed_once_for_its_plugins(nox_list):
    assert "tests-vllm [tests] -> toolkit-rl, toolkit-vllm in their own venv" in nox_list
    assert "tests-rl" not in nox_list


def test_a_module_fixture_runs_once_on_the_workers_the_test_sessions_use(noxfile, pytester, monkeypatch):
    """TOOLKIT_TEST_WORKERS spreads a suite over pytest-xdist workers; a module's expensive fixture (a torchrun
    job several tests read) must still run once, not once per worker that got one of its tests."""
    pytest.importorskip("xdist")
    monkeypatch.setenv("TOOLKIT_TEST_WORKERS", "2")
    monkeypatch.delenv("TOOLKIT_TEST_FAST", raising=False)
    builds = pytester.path / "builds.txt"
    pytester.makepyfile(test_shared=f"""
        import time
        import pytest

        @pytest.fixture(scope="module")
        def job():
            with open({str(builds)!r}, "a") as f:
                f.write("built\\n")

        @pytest.mark.parametrize("i", range(8))
        def test_reads_the_job(job, i):
            time.sleep(0.1)

        @pytest.mark.parametrize("i", range(8))
        def test_other(i):
            time.sleep(0.1)
    """)
    args = noxfile.pytest_args(type("Session", (), {"posargs": [], "venv_backend": "none"})())
    assert args[args.index("-n") + 1] == "2"
    result = pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=16)
    assert builds.read_text().count("built") == 1


def test_session_installs_skip_byte_compiling_everything(noxfile):
    """pip byte-compiles every installed module unless told not to: ~14 s of CPU for torch and transformers in
    each of the test venvs, mostly for modules no test imports."""
    calls = []
    session = type("Session", (), {"venv_backend": "venv", "install": lambda self, *args: calls.append(args)})()
    noxfile.install(session, "-c", "constraints.txt", "toolkit-core[test]")
    assert calls == [("--no-compile", "-c", "constraints.txt", "toolkit-core[test]")]


FAKE_NOX = """
import json, os, sys, time
start = time.monotonic()
time.sleep(0.3)
failing = os.environ["FAKE_FAIL"]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"argv": sys.argv[1:], "suites": os.environ["TOOLKIT_TEST_SUITES"], "start": start,
                          "end": time.monotonic()}) + "\\n")
sys.exit(1 if "--install-only" in sys.argv and failing in sys.argv else 0)
"""


def test_the_pool_runs_each_suite_after_its_install_within_its_lanes(tmp_path, monkeypatch):
    """scripts/test_pool.py: each suite in its own ``nox -R -s SESSION`` with ``TOOLKIT_TEST_SUITES``, none before its
    session's install passed, never more at once than lanes; a failed install leaves its suites unrun (and reported)."""
    spec = importlib.util.spec_from_file_location("toolkit_test_pool", ROOT / "scripts" / "test_pool.py")
    pool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = pool  # dataclasses look their module up there
    try:
        spec.loader.exec_module(pool)
        fake = tmp_path / "nox.py"
        fake.write_text(FAKE_NOX)
        monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls.jsonl"))
        monkeypatch.setenv("FAKE_FAIL", "tests-broken")
        jobs = pool.plan([("tests", "toolkit", 500), ("tests", "toolkit-a", 20), ("tests-engine", "toolkit-b", 300),
                          ("tests-broken", "toolkit-c", 900), ("tests-skipped", "toolkit-d", 10)],
                         ["tests", "tests-engine", "tests-broken"])
        pool.run(jobs, 2, [sys.executable, str(fake)], ["-k", "x"], tmp_path)
        # a small session's install waits behind a long suite that is ready; the shared session's install goes first
        order = pool.plan([("tests", "toolkit", 500), ("tests-small", "toolkit-s", 30), ("tests-engine", "toolkit-b", 300)],
                          ["tests", "tests-small", "tests-engine"])
        assert pool.next_job(order).name == "tests install"
        order[0].status = "passed"
        assert [pool.next_job(order).name] == ["tests: toolkit"]
    finally:
        del sys.modules[spec.name]
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    status = {job.name: job.status for job in jobs}
    assert status == {"tests install": "passed", "tests-engine install": "passed", "tests-broken install": "failed",
                      "tests: toolkit": "passed", "tests: toolkit-a": "passed", "tests-engine: toolkit-b": "passed",
                      "tests-broken: toolkit-c": "waiting"}
    installs = {call["argv"][-1]: call for call in calls if "--install-only" in call["argv"]}
    suites = [call for call in calls if "--install-only" not in call["argv"]]
    assert sorted(call["suites"] for call in suites) == ["toolkit", "toolkit-a", "toolkit-b"]
    for call in suites:
        session = call["argv"][call["argv"].index("-s") + 1]
        assert call["argv"][:1] == ["-R"] and call["argv"][-2:] == ["-k", "x"], call
        assert call["start"] >= installs[session]["end"], call
    edges = sorted([(c["start"], 1) for c in calls] + [(c["end"], -1) for c in calls])
    running = [sum(step for _, step in edges[:i + 1]) for i in range(len(edges))]
    assert max(running) == 2


def test_a_plugins_workers_cap_its_suites_processes(noxfile, tmp_path, pytester, monkeypatch):
    """``workers = 1`` runs the suite in pytest's own process (no xdist worker); a larger cap limits
    TOOLKIT_TEST_WORKERS and never raises it."""
    pytest.importorskip("xdist")
    for name, cap in [("toolkit-alone", 1), ("toolkit-three", 3), ("toolkit-free", None)]:
        write_plugin(tmp_path, name, "" if cap is None else f"[tool.toolkit.nox]\nworkers = {cap}\n")
    plugins = {p.name: p for p in noxfile.discover_plugins(tmp_path)}
    session = type("Session", (), {"posargs": [], "venv_backend": "none"})()

    def processes(name: str) -> str | None:
        args = noxfile.pytest_args(session, plugins[name].workers)
        return args[args.index("-n") + 1] if "-n" in args else None

    monkeypatch.setenv("TOOLKIT_TEST_WORKERS", "2")
    assert [processes(n) for n in ("toolkit-alone", "toolkit-three", "toolkit-free")] == [None, "2", "2"]
    monkeypatch.setenv("TOOLKIT_TEST_WORKERS", "4")
    assert [processes(n) for n in ("toolkit-alone", "toolkit-three", "toolkit-free")] == [None, "3", "4"]
    seen = pytester.path / "seen.txt"
    pytester.makepyfile(test_where=f"""
        def test_where(request):  # an xdist worker's config has workerinput (PYTEST_XDIST_WORKER may be inherited)
            with open({str(seen)!r}, "a") as f:
                f.write(("worker" if hasattr(request.config, "workerinput") else "main") + "\\n")
    """)
    monkeypatch.delenv("TOOLKIT_TEST_FAST", raising=False)
    pytester.runpytest_subprocess(*noxfile.pytest_args(session, 1), "-p", "no:cacheprovider").assert_outcomes(passed=1)
    assert seen.read_text().split() == ["main"]


def test_the_sessions_workers_are_forked_from_its_fork_server(noxfile, pytester, monkeypatch):
    """In a session's venv the pytest-xdist workers start as toolkit.testworker: forked from the session's shared fork
    server, with its preloaded modules already imported (here colorsys, which nothing else imports)."""
    import tempfile

    from toolkit import forkserver

    pytest.importorskip("xdist")
    forks = tempfile.mkdtemp(prefix="tw-")
    for name, value in {"TOOLKIT_TEST_FORK_DIR": forks, "TOOLKIT_TEST_PRELOAD": "colorsys", "TOOLKIT_TEST_WORKERS": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TOOLKIT_TEST_FAST", raising=False)
    session = type("Session", (), {"posargs": [], "venv_backend": "uv", "bin": str(Path(sys.executable).parent)})()
    args = noxfile.pytest_args(session)
    assert "toolkit.testworker" in args[args.index("--tx") + 1]
    pytester.makepyfile(test_forked="""
        import sys
        import pytest

        @pytest.mark.parametrize("i", range(4))
        def test_preloaded(i, request):
            assert hasattr(request.config, "workerinput") and "colorsys" in sys.modules
    """)
    try:
        pytester.runpytest_subprocess(*args, "-p", "no:cacheprovider").assert_outcomes(passed=4)
    finally:
        forkserver.stop_shared(forks)
