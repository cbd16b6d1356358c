"""The protocols in contracts.py are the whole contract: every registered component satisfies its
kind's protocol, the core reads nothing a protocol does not declare, components written to the
protocol alone (no base class, optional members left out) work, and incomplete ones are refused
with their missing members named before any model loads."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path
from typing import ClassVar

import pytest

from toolkit import contracts, hookimpl
from toolkit.contracts import OPTIONAL, PROTOCOLS, missing_members, protocol_members

CORE = Path(contracts.__file__).resolve().parent
# how the core's code names a component of each kind, where it reads the component's members
NAMES = {"engine": "engine", "tuner": "tuner", "loss": "loss", "callback": "cb", "strategy": "strategy",
         "fmt": "dataset_format", "exporter": "exporter", "backend": "inference_backend"}


def test_every_registered_component_satisfies_its_protocol():
    from toolkit.plugins import get_plugin_manager

    manager, checked = get_plugin_manager(), 0
    for kind in PROTOCOLS:
        if kind == "engine":  # built by strategies, checked on every run (test below)
            continue
        for name, cls in manager.registry(kind).items():
            assert missing_members(kind, cls) == [], f"{kind} {name!r} of plugin {manager.registry(kind).owner(name)}"
            checked += 1
    assert checked >= 15  # the core's own built-ins alone register more


def test_every_tuner_with_an_adapter_spec_describes_its_own_options():
    """``Tuner.adapter_spec()`` (optional) gives a frozen ``contracts.AdapterSpec`` of the options the tuner was built
    with (a strategy reads nothing else of them): changing an option changes the spec, and the spec cannot be
    changed by its reader. Tuners without it are the ones without adapters (``full``, ``freeze``)."""
    from toolkit.contracts import AdapterSpec, member
    from toolkit.plugins import get_plugin_manager

    registry, described = get_plugin_manager().registry("tuner"), []
    for name, cls in registry.items():
        tuner = cls(cls.Config())
        describe = member(tuner, "tuner", "adapter_spec")
        if describe is None:
            continue
        spec = describe()
        assert isinstance(spec, AdapterSpec), (name, spec)
        with pytest.raises(dataclasses.FrozenInstanceError):
            spec.rank = 1  # type: ignore[misc]
        fields = {f.name for f in dataclasses.fields(tuner.config)}
        changed = {"rank": 3, "alpha": 5.0, "dropout": 0.25, "rslora": True, "target_modules": ["q_proj", "v_proj"],
                   "modules_to_save": ["lm_head"], "bias": "all", "init": "gaussian"}
        other = cls(cls.Config(**{k: v for k, v in changed.items() if k in fields})).adapter_spec()
        for key, value in changed.items():
            if key in fields:
                assert getattr(other, key) == (tuple(value) if isinstance(value, list) else value), (name, key)
        described.append((name, spec.dora))
    if "lora" in registry:  # toolkit-peft installed
        assert ("lora", False) in described and ("dora", True) in described, described
    assert "full" not in dict(described)


def _reads(tree: ast.AST) -> list[tuple[str, str, str]]:
    """(variable, member, how) for ``x.member``, ``getattr(x, "member", ...)`` and ``hasattr(x, "member")``
    where ``x`` (or ``self.x``) is one of NAMES."""
    def variable(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        return None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and variable(node.value) in NAMES:
            found.append((variable(node.value), node.attr, "attribute"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and variable(node.args[0]) in NAMES and isinstance(node.args[1], ast.Constant)):
            found.append((variable(node.args[0]), node.args[1].value, node.func.id))
    return found


def test_the_core_reads_only_declared_members_and_optional_ones_through_member():
    """The runner, the data pipeline, export, inference and the commands: every member of a component they
    read is declared by its protocol, and none is probed with getattr/hasattr (``contracts.member`` says
    what an optional member's absence means, in one place)."""
    files = [*CORE.glob("train/*.py"), *CORE.glob("data/*.py"), *CORE.glob("commands/*.py"),
             CORE / "export.py", CORE / "inference.py"]
    undeclared, probed, seen = [], [], 0
    for path in files:
        for var, name, how in _reads(ast.parse(path.read_text())):
            kind = NAMES[var]
            seen += 1
            if how != "attribute":
                probed.append(f"{path.relative_to(CORE)}: {how}({var}, {name!r})")
            elif name not in protocol_members(kind):
                undeclared.append(f"{path.relative_to(CORE)}: {var}.{name} (contracts.{PROTOCOLS[kind].__name__})")
    assert seen > 20
    assert undeclared == [] and probed == [], undeclared + probed


def test_the_scan_sees_an_undeclared_read():
    tree = ast.parse("def f(engine, self):\n    engine.secret_method()\n    getattr(self.tuner, 'extra', None)\n")
    assert ("engine", "secret_method", "attribute") in _reads(tree) and ("tuner", "extra", "getattr") in _reads(tree)
    assert "secret_method" not in protocol_members("engine")


def test_member_gives_the_documented_default_and_refuses_undeclared_names():
    class Bare:
        pass

    assert contracts.member(Bare(), "engine", "supports_rollback") is True
    assert contracts.member(Bare(), "tuner", "adapter_export") is None
    assert contracts.member(Bare(), "callback", "on_step_end")(3, {}) is None
    with pytest.raises(KeyError, match="not a member of contracts.Engine"):
        contracts.member(Bare(), "engine", "secret_method")


def test_the_optional_table_names_only_declared_kinds_and_documents_each_member():
    hooks = (Path(__file__).resolve().parents[1] / "docs" / "hooks.md").read_text()
    for kind, members in OPTIONAL.items():
        assert kind in PROTOCOLS
        for name in members:
            assert f"`{name}" in hooks, f"docs/hooks.md does not mention the optional {kind} member {name}"


def test_each_base_class_gives_exactly_the_documented_defaults():
    """contracts.BASES: every kind with optional members has a base class, and inheriting it changes nothing that
    ``member`` would give without it: each optional member reads the same through the base as on a bare class, and
    the base adds no required member (so a subclass still has to write those)."""
    from toolkit.contracts import BASES

    class Bare:
        pass

    assert set(BASES) == set(OPTIONAL)
    for kind, base in BASES.items():
        instance = base.__new__(base)
        for name, default in OPTIONAL[kind].items():
            assert hasattr(base, name), (kind, name)
            got, bare = contracts.member(instance, kind, name), contracts.member(Bare(), kind, name)
            if callable(default) or callable(got):  # a no-op method: same result for the same call
                args = [None] * len(inspect.signature(got).parameters) if callable(got) else []
                assert (got(*args) if callable(got) else got) == (bare(*args) if callable(bare) else bare), (kind, name)
            else:
                assert got == bare == default, (kind, name, got, default)
        declared = set(contracts.protocol_members(kind)) - set(OPTIONAL[kind])
        assert not {n for n in declared if n in vars(base)} - {"name", "__init__"}, (kind, base)


def test_a_tuner_on_the_base_class_with_only_required_members_is_complete():
    """A third party's tuner: TunerBase plus the required methods is what the runner accepts (nothing missing), and
    the optional members it did not write read as documented (full-precision base, ZeRO-3 compatible)."""
    from toolkit.contracts import TunerBase

    class Mine(TunerBase):
        name = "mine"
        Config = NoOptions

        def validate(self, recipe, source): return []
        def model_load_kwargs(self): return {}
        def apply(self, model, source): return model
        def checkpoint_state(self, model): return {}
        def load_checkpoint_state(self, model, state): pass
        def export_tensors(self, model): return iter(())

    assert contracts.missing_members("tuner", Mine) == []
    assert contracts.missing_members("tuner", TunerBase) == sorted(
        ["Config", "apply", "checkpoint_state", "export_tensors", "load_checkpoint_state", "model_load_kwargs", "name", "validate"])
    tuner = Mine()
    assert contracts.member(tuner, "tuner", "quantized") is False and contracts.member(tuner, "tuner", "zero3_compatible")
    assert contracts.member(tuner, "tuner", "before_step") is None


@dataclasses.dataclass(kw_only=True)
class NoOptions:
    pass


class LogOnly:
    """A third party's callback written to contracts.Callback alone: only on_log, no base class."""

    name: ClassVar[str] = "log-only"
    Config: ClassVar[type] = NoOptions
    seen: ClassVar[list] = []

    def __init__(self, config):
        self.config = config

    def on_log(self, step, metrics):
        LogOnly.seen.append((step, metrics["loss"]))


class log_only_plugin:  # noqa: N801
    @staticmethod
    @hookimpl
    def toolkit_register_callbacks(register):
        register(LogOnly)


def test_a_callback_with_only_on_log_trains_and_hears_every_logged_step(toolkit_manager, tmp_path):
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import run_training

    toolkit_manager(log_only_plugin, installed=False)
    LogOnly.seen.clear()
    run = run_training(resolve_recipe({"model": "tiny-llama", "dataset": ["demo"], "seq_len": 64, "micro_batch_size": 2,
                                       "max_steps": 3, "log_every": 1, "output": str(tmp_path / "run")}))
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert LogOnly.seen == [(m["step"], m["loss"]) for m in logged] and len(logged) == 3


class HalfStrategy:
    """Declares validate and build but not checkpoint_tensors."""

    name: ClassVar[str] = "half"
    Config: ClassVar[type] = NoOptions

    def __init__(self, config):
        self.config = config

    def validate(self, recipe, world_size):
        return []

    def build(self, source, tuner, loss, recipe):
        raise AssertionError("an incomplete strategy must be refused before it builds")


class ForgetfulStrategy(HalfStrategy):
    """Complete, but the engine it builds lacks set_total_steps and current_lr."""

    name: ClassVar[str] = "forgetful"

    def build(self, source, tuner, loss, recipe):
        class Engine:
            dp_rank, dp_world_size, is_main = 0, 1, True

        return Engine()

    def checkpoint_tensors(self, checkpoint, source, tuner, recipe):
        return iter(())


class strategies_plugin:  # noqa: N801
    @staticmethod
    @hookimpl
    def toolkit_register_strategies(register):
        register(HalfStrategy)
        register(ForgetfulStrategy)


def test_an_incomplete_strategy_is_refused_before_the_model_loads(toolkit_manager, tmp_path, monkeypatch):
    from toolkit.errors import PluginLoadError
    from toolkit.recipe import resolve_recipe
    from toolkit.train import runner

    toolkit_manager(("strategies_plugin", strategies_plugin), installed=False)
    monkeypatch.setattr(runner, "check_model_limits", lambda *a: pytest.fail("the model was reached"))
    with pytest.raises(PluginLoadError) as error:
        runner.run_training(resolve_recipe({"model": "tiny-llama", "dataset": ["demo"], "strategy": "half",
                                            "output": str(tmp_path / "run")}))
    assert "strategy 'half' (plugin 'strategies_plugin') lacks checkpoint_tensors" in str(error.value)
    assert "contracts.Strategy" in str(error.value)


def test_an_engine_without_required_members_is_named_with_its_strategy(toolkit_manager, tmp_path):
    from toolkit.errors import PluginLoadError
    from toolkit.recipe import resolve_recipe
    from toolkit.train.runner import run_training

    toolkit_manager(("strategies_plugin", strategies_plugin), installed=False)
    with pytest.raises(PluginLoadError) as error:
        run_training(resolve_recipe({"model": "tiny-llama", "dataset": ["demo"], "strategy": "forgetful",
                                     "output": str(tmp_path / "run")}))
    message = str(error.value)
    assert "strategy 'forgetful' built an engine" in message and "set_total_steps" in message and "current_lr" in message
    assert "train_step" in message  # every missing member, not only the first


OUTSIDE_PLUGIN = '''
"""A third party's plugin, written to docs/hooks.md and contracts.py alone: no toolkit base class, every
optional member left out, installed as a distribution with an entry point (not part of this repository)."""
import dataclasses
import json
import os

from toolkit import hookimpl
from toolkit.config import option
from toolkit.contracts import LossOutput


@dataclasses.dataclass(kw_only=True)
class ScaledConfig:
    scale: float = option(1.0, help="Multiplies the token-averaged cross-entropy.")


class ScaledCrossEntropy:
    name = "scaled-ce"
    Config = ScaledConfig
    consumes = "logps"
    needs_reference = False
    example_kinds = ("lm",)

    def __init__(self, config):
        self.config = config

    def __call__(self, out, ctx):
        loss = -(out.logps * out.mask).sum() / max(ctx.label_tokens, 1) * self.config.scale
        return LossOutput(loss=loss)


@dataclasses.dataclass(kw_only=True)
class NoOptions:
    pass


class StepFile:
    name = "step-file"
    Config = NoOptions

    def __init__(self, config):
        self.config = config

    def on_step_end(self, step, metrics):
        with open(os.environ["OUTSIDE_STEPS"], "a") as handle:
            handle.write(json.dumps({"step": step, "loss": metrics["loss"]}) + "\\n")


@hookimpl
def toolkit_register_losses(register):
    register(ScaledCrossEntropy)


@hookimpl
def toolkit_register_callbacks(register):
    register(StepFile)
'''


@pytest.mark.slow
def test_a_plugin_outside_the_repository_written_to_the_contract_trains(tmp_path):
    """Installed like any distribution (a dist-info with a ``toolkit`` entry point on the path), its loss trains
    with its option (scale 2 doubles every step's loss against the core's sft on the same run) and its
    callback, with only on_step_end, hears every step."""
    import os

    from toolkit.testing import run_python

    site = tmp_path / "site"
    (site / "outside_plugin-0.1.dist-info").mkdir(parents=True)
    (site / "outside_plugin.py").write_text(OUTSIDE_PLUGIN)
    (site / "outside_plugin-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: outside-plugin\nVersion: 0.1\n")
    (site / "outside_plugin-0.1.dist-info" / "entry_points.txt").write_text("[toolkit]\noutside = outside_plugin\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
           "OUTSIDE_STEPS": str(tmp_path / "steps.jsonl"), "HF_HUB_OFFLINE": "1"}
    common = ["--model", "tiny-llama", "--dataset", "demo", "--seq-len", "64", "--max-steps", "3", "--log-every", "1",
              "--lr", "1e-3"]

    def run(*args):
        result = run_python(["-m", "toolkit", *args], env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    listing = json.loads(run("plugins", "--json").stdout)
    outside = next(row for row in listing if row["name"] == "outside")
    assert outside["error"] is None and outside["registers"] == {"loss": ["scaled-ce"], "callback": ["step-file"]}
    run("train", "--loss", "scaled-ce", "--scaled-ce-scale", "2", *common, "--output", str(tmp_path / "scaled"))
    run("sft", *common, "--output", str(tmp_path / "sft"))
    scaled, sft = ([json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
                   for name in ("scaled", "sft"))
    assert scaled[0] == pytest.approx(2 * sft[0], rel=1e-6)
    heard = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [h["step"] for h in heard] == [1, 2, 3, 1, 2, 3]  # both runs, every step
    assert [h["loss"] for h in heard[:3]] == pytest.approx(scaled)
