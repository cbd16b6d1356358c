"""The form comes from the registries: every Config field appears, and the command line it writes
parses back, through the real ``toolkit`` CLI, to the same resolved recipe as its YAML."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from toolkit.plugins import get_plugin_manager
from toolkit.recipe import OPTION_KINDS, read_yaml, resolve_recipe
from toolkit_webui import forms


@pytest.fixture(scope="module")
def fields():
    return forms.form_fields(get_plugin_manager())


def defaults(fields):
    return {f.key: forms.widget_value(f, f.default) for f in fields}


def test_every_registered_option_is_a_field(fields):
    manager = get_plugin_manager()
    keys = {f.key for f in fields}
    expected = set()
    for kind in OPTION_KINDS:
        for name, cls in manager.registry(kind).items():
            expected |= {f"{name}.{f.name}" for f in dataclasses.fields(cls.Config)}
    assert expected <= keys
    assert {"focal.gamma", "focal.detach_weight"} <= keys  # toolkit-example's loss, known to no UI code
    assert "focal" in next(f for f in fields if f.key == "loss").choices


def parse_with_cli(args, monkeypatch, tmp_path):
    """What the real ``toolkit`` command builds from ``args`` (training itself replaced by a recorder)."""
    import toolkit.train.runner as runner
    from toolkit.cli import main

    seen = []
    monkeypatch.setattr(runner, "run_training", lambda recipe, **_: seen.append(recipe))
    main(args)
    return seen[0]


def test_command_line_and_yaml_give_the_same_recipe(fields, monkeypatch, tmp_path):
    raw = defaults(fields)
    raw.update({"loss": "focal", "focal.gamma": 0.5, "focal.detach_weight": True, "max_steps": 7, "lr": 3e-4,
                "packing": True, "dataset": "demo, demo", "columns": "instruction=question", "output": str(tmp_path / "r"),
                "local.recompute_logits": True, "local.master_weights": "false", "schedule": "linear", "resume": ""})
    values, problems = forms.recipe_values(fields, raw)
    assert problems == []
    args = forms.command_args(fields, values, get_plugin_manager())
    assert args[0] == "focal" and "--focal-gamma" in args and "--no-local-master-weights" in args
    from_cli = parse_with_cli(args, monkeypatch, tmp_path)
    path = tmp_path / "recipe.yaml"
    path.write_text(forms.recipe_yaml(values))
    from_yaml = resolve_recipe(read_yaml(path), source=str(path))
    assert from_cli == from_yaml
    assert from_cli.section("focal") == {"gamma": 0.5, "detach_weight": True}
    assert from_cli.dataset == ["demo", "demo"] and from_cli.columns == {"instruction": "question"}


def test_grpo_runs_its_own_command_and_its_reward_options(fields, monkeypatch, tmp_path):
    """toolkit-rl's grpo has no core training command: the form writes `toolkit grpo` (its RL loop; `toolkit
    train --loss grpo` would run the core's runner), and the rewards it names bring their options along."""
    pytest.importorskip("toolkit_rl")
    import toolkit_rl.loop

    raw = defaults(fields)
    raw.update({"loss": "grpo", "grpo.rewards": "answer:0.5, length", "grpo.num_generations": 2, "answer.mode": "contains",
                "focal.gamma": 0.5, "output": str(tmp_path / "r"), "resume": ""})
    values, problems = forms.recipe_values(fields, raw)
    assert problems == [] and values["answer"] == {"mode": "contains"} and "focal" not in values
    assert forms.form_sections(fields, raw) >= {"grpo", "answer"}
    args = forms.command_args(fields, values, get_plugin_manager())
    assert args[0] == "grpo"
    seen = []
    monkeypatch.setattr(toolkit_rl.loop, "run_grpo", lambda recipe, **_: seen.append(recipe))
    from toolkit.cli import main

    main(args)
    path = tmp_path / "recipe.yaml"
    path.write_text(forms.recipe_yaml(values))
    assert seen[0] == resolve_recipe(read_yaml(path), source=str(path))
    assert seen[0].section("grpo")["rewards"] == ["answer:0.5", "length"] and seen[0].section("answer")["mode"] == "contains"


def test_yaml_loads_back_into_the_form(fields):
    raw = defaults(fields)
    raw.update({"loss": "focal", "focal.gamma": 1.25, "max_steps": 3, "tuner": "freeze", "freeze.trainable_layers": 1})
    values, _ = forms.recipe_values(fields, raw)
    again, problems = forms.recipe_values(fields, forms.values_from_recipe(fields, values))
    assert problems == [] and again == values


def test_options_of_unchosen_things_stay_out(fields):
    raw = defaults(fields)
    raw.update({"focal.gamma": 0.5, "fsdp.cpu_offload": True})  # loss sft, strategy local: neither applies
    values, _ = forms.recipe_values(fields, raw)
    assert "focal" not in values and "fsdp" not in values


def test_bad_values_are_named(fields):
    raw = defaults(fields)
    raw.update({"max_steps": "many", "columns": "no equals sign"})
    _, problems = forms.recipe_values(fields, raw)
    assert any(p.startswith("--max-steps:") for p in problems), problems
    assert any(p.startswith("--columns:") and "KEY=VALUE" in p for p in problems), problems


EXAMPLES = sorted((Path(__file__).resolve().parents[3] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_recipes_survive_the_form(fields, path):
    """Every example recipe the installed plugins can resolve: file -> form -> recipe resolves as the
    command its header documents does (``toolkit dpo --config examples/dpo.yaml``: a dpo recipe, although
    the file names no loss; its options, an optimizer's, a reward's, all kept)."""
    from toolkit.errors import ToolkitError

    data = read_yaml(path)
    command = re.search(rf"toolkit ([a-z0-9-]+) --config examples/{re.escape(path.name)}", path.read_text())
    if command and "loss" not in data and command.group(1) in get_plugin_manager().registry("loss").names():
        data = {"loss": command.group(1), **data}  # what `toolkit LOSS --config FILE` trains
    values, problems = forms.recipe_values(fields, forms.values_from_recipe(fields, read_yaml(path)))
    try:
        expected = resolve_recipe(data, source=str(path))
    except ToolkitError as exc:
        if "not installed" not in str(exc):
            raise
        pytest.skip(f"{path.name} needs a plugin that is not installed here")
    assert problems == []
    assert without_default_sections(resolve_recipe(values, source="the form")) == without_default_sections(expected)


def without_default_sections(recipe):
    """A section holding only its Config's defaults means the same as no section."""
    from toolkit.recipe import _option_owner

    manager = get_plugin_manager()
    options = {name: section for name, section in recipe.options.items()
               if section != dataclasses.asdict(_option_owner(manager, name).Config())}
    return dataclasses.replace(recipe, options=options)


def test_launch_refuses_a_directory_that_holds_a_run(fields, tmp_path):
    from toolkit.errors import ToolkitError
    from toolkit_webui.app import App
    from toolkit_webui.paths import Roots

    app = App(Roots(tmp_path))
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "recipe.yaml").write_text("model: tiny-llama\n")
    raw = {**defaults(fields), "output": "old"}
    with pytest.raises(ToolkitError, match="already holds a run"):
        app.launch(raw, 1)
    assert app.runs.processes == {}  # nothing started


def test_launch_runs_the_command_shown_on_n_processes(fields, tmp_path, monkeypatch):
    """Launch starts what the command box shows: the same arguments, under torchrun with the processes chosen
    (test_runs trains and stops such a run on 2 processes)."""
    import shlex

    from toolkit_webui.app import App
    from toolkit_webui.paths import Roots

    app = App(Roots(tmp_path))
    started = []
    monkeypatch.setattr(app.runs, "launch", lambda args, run_dir, nproc=1: started.append((args, run_dir, nproc)) or
                        type("P", (), {"pid": 1})())
    raw = {**defaults(fields), "output": "two", "max_steps": 3, "loss": "focal", "focal.gamma": 0.5}
    _, command, status = app.describe(raw, 3)
    app.launch(raw, 3)
    ((args, run_dir, nproc),) = started
    assert status == "Ready to launch." and nproc == 3 and run_dir == tmp_path / "two"
    assert command == shlex.join(["toolkit", "launch", "--nproc", "3", *args])
    from toolkit_webui.runs import process_command

    torchrun = process_command(args, nproc)
    assert "--nproc-per-node=3" in torchrun and torchrun[-len(args):] == args


def test_an_edit_is_one_event_that_sends_only_the_sections_it_shows_or_hides(tmp_path):
    """Each event costs the browser time in proportion to its inputs and outputs (Gradio 6 walks the page's tree for
    each), so an edit of the form redraws the YAML, the command line and the option sections in one event, and sends
    a section only when its visibility changes."""
    import gradio as gr

    from toolkit_webui.app import App, build
    from toolkit_webui.paths import Roots

    app = App(Roots(tmp_path))
    page = build(app)
    loss = next(block for block in page.blocks.values() if getattr(block, "elem_id", None) == "field-recipe-loss")
    on_edit = [fn for fn in page.fns.values() if any(target == loss._id and event == "change" for target, event in fn.targets)]
    assert len(on_edit) == 1
    (describe,) = on_edit
    ids = [getattr(block, "elem_id", None) for block in describe.outputs]
    sections = [i for i, name in enumerate(ids) if name and name.startswith("section-")]
    state_at = len(ids) - 1
    raw = {f.key: forms.widget_value(f, f.default) for f in app.fields}
    inputs = [raw[f.key] for f in app.fields]

    def sent(result: tuple) -> dict:
        return {ids[i]: result[i] for i in sections if result[i] != gr.skip()}

    first = describe.fn(*inputs, 1, [])  # a page that shows no section yet
    shown = first[state_at]
    assert "loss: sft" in first[0] and set(shown) == forms.form_sections(app.fields, raw)
    assert sent(first) == {f"section-{name}": gr.update(visible=True) for name in shown}
    assert sent(describe.fn(*inputs, 1, shown)) == {}  # nothing to show or hide: no section is sent

    inputs[[f.key for f in app.fields].index("loss")] = "focal"
    focal = describe.fn(*inputs, 1, shown)
    assert sent(focal) == {"section-focal": gr.update(visible=True)}
    assert focal[1].strip().splitlines()[-1].startswith("toolkit focal ")
    assert set(focal[state_at]) == set(shown) | {"focal"}


def test_a_loaded_recipe_changes_only_the_fields_it_sets(tmp_path):
    """Loading a recipe sends every field's value; each that differs from what the page holds is a change, and each
    change redraws the recipe: a value given in another form than the widget's (None for an empty optional number
    shown as text) cost a redraw per such field (10 on every load, 9 s of a CI machine's browser)."""
    from toolkit_webui.app import App, build, elem_id
    from toolkit_webui.paths import Roots

    app = App(Roots(tmp_path))
    page = build(app)
    by_elem = {getattr(block, "elem_id", None): block for block in page.blocks.values()}
    held = {f.key: by_elem[elem_id(f)].value for f in app.fields}
    raw = {f.key: forms.widget_value(f, f.default) for f in app.fields}
    raw.update({"max_steps": 7, "output": "loaded"})
    app.save(raw, "recipes/seven.yaml")
    loaded = app.load("recipes/seven.yaml")
    changed = {key for key, value in loaded.items() if value != held[key]}
    assert changed == {"max_steps", "output"}, {key: (held[key], loaded[key]) for key in changed}
