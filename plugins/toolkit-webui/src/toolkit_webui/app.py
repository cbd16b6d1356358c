"""The Gradio page: Recipe, Runs, Data, Plan, Export and Chat tabs, each built from the registries.

Widgets are made from :mod:`toolkit_webui.forms` fields, so the page holds no list of options;
every handler turns a ``ToolkitError`` into a message on the page instead of a traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from toolkit.errors import ConfigError, ToolkitError
from toolkit_webui import forms, tools
from toolkit_webui.paths import Roots
from toolkit_webui.runs import Runs, curves
from toolkit_webui.tabs import chat_tab, data_tab, export_tab, plan_tab, runs_tab

# The Recipe fields shown above the fold, in this order; every other field is under "All options".
FIRST = ("model", "dataset", "output", "loss", "tuner", "strategy", "optimizer", "dataset_format", "max_steps", "epochs", "lr",
         "micro_batch_size", "global_batch_size", "seq_len", "packing", "precision", "save_every", "log_every", "export")


DESCRIBE = "recipe-describe"
"""The queue of the events that redraw the recipe: one at a time, in order."""

def elem_id(field: forms.Field) -> str:
    return f"field-{field.section or 'recipe'}-{field.name}"


def widget(field: forms.Field, value: Any = None) -> Any:
    """The Gradio input for one field (label: its CLI flag; info: its help)."""
    import gradio as gr

    value = forms.widget_value(field, field.default) if value is None else value
    common = {"label": field.flag or field.key, "info": field.help, "elem_id": elem_id(field), "value": value}
    shape = field.shape
    if shape == "choice":
        return gr.Dropdown(choices=list(field.choices), allow_custom_value=field.custom, **common)
    if shape == "bool":
        return gr.Checkbox(**common)
    if field.typed_as_text:
        return gr.Textbox(placeholder="empty: none", **common)
    if shape in ("int", "float"):
        return gr.Number(precision=0 if shape == "int" else None, **common)
    lines = 2 if shape in ("list", "mapping") else 1
    placeholder = {"list": "comma-separated", "mapping": "KEY=VALUE, one per line"}.get(shape)
    return gr.Textbox(lines=lines, placeholder=placeholder, **common)


def shows_errors(*fallback: Any) -> Callable:
    """Decorator: a ToolkitError (or any error) becomes ``("**Error:** ...", *fallback)`` on the page."""
    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def wrapped(*args: Any) -> Any:
            try:
                return function(*args)
            except ToolkitError as exc:
                message = str(exc)
            except Exception as exc:  # the page stays up; the message names the failure
                message = f"{type(exc).__name__}: {exc}"
            return (f"**Error:** {message}", *fallback) if fallback else f"**Error:** {message}"
        return wrapped
    return decorate


class App:
    """State shared by the tabs: the manager's fields, the roots and the runs."""

    def __init__(self, roots: Roots, manager: Any = None):
        from toolkit.plugins import get_plugin_manager

        self.manager = manager or get_plugin_manager()
        self.roots = roots
        self.runs = Runs(roots.runs)
        self.fields = forms.form_fields(self.manager)

    # -- recipe -----------------------------------------------------------------------------
    def next_run_name(self) -> str:
        index = 1
        while (self.roots.runs / f"run-{index}").exists():
            index += 1
        return f"run-{index}"

    def checked(self, values: dict[str, Any]) -> dict[str, Any]:
        """Path-valued fields as absolute paths inside the roots (presets and bundled names as they are);
        any other value that names a file outside them (a plugin's reward file.py, a DeepSpeed JSON) refused."""
        values = dict(values)
        values["model"] = tools.model_reference(self.roots, values.get("model", "tiny-llama"))
        values["dataset"] = [tools.dataset_reference(self.roots, d) for d in values.get("dataset", [])]
        if values.get("eval_dataset"):
            values["eval_dataset"] = [tools.dataset_reference(self.roots, d, "--eval-dataset") for d in values["eval_dataset"]]
        values["output"] = str(self.roots.writable_path(values.get("output") or self.next_run_name(), "output"))
        if values.get("resume") not in (None, "auto"):
            values["resume"] = str(self.roots.readable_path(values["resume"], "resume"))
        by_key = {f.key: f for f in self.fields}
        for key, value in values.items():
            if key in forms.PATH_FIELDS:
                continue
            if key in by_key:
                self.roots.check_mentions(value, by_key[key].flag or key)
            elif isinstance(value, dict):  # an option section: each field under its own flag
                for name, item in value.items():
                    field = by_key.get(f"{key}.{name}")
                    self.roots.check_mentions(item, (field.flag if field else None) or f"{key}.{name}")
            else:
                self.roots.check_mentions(value, key)
        return values

    def compose(self, raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """Form values -> (checked recipe values, problems), validated by the core's own resolve_recipe."""
        from toolkit.recipe import resolve_recipe

        values, problems = forms.recipe_values(self.fields, raw)
        try:
            values = self.checked(values)
        except ToolkitError as exc:
            problems.append(str(exc))
        if not problems:
            try:
                resolve_recipe(values, source="the form", manager=self.manager)
            except ConfigError as exc:
                problems += [line.strip(" -") for line in str(exc).splitlines() if line.strip()]
        return values, problems

    def describe(self, raw: dict[str, Any], nproc: int) -> tuple[str, str, str]:
        values, problems = self.compose(raw)
        try:
            command = forms.shell_command(forms.command_args(self.fields, values, self.manager), int(nproc or 1))
        except ToolkitError as exc:
            command, problems = "", [*problems, str(exc)]
        status = "Ready to launch." if not problems else "**Fix first:**\n" + "\n".join(f"- {p}" for p in problems)
        return forms.recipe_yaml(values), command, status

    def launch(self, raw: dict[str, Any], nproc: int) -> str:
        values, problems = self.compose(raw)
        if problems:
            raise ToolkitError("the recipe has problems:\n" + "\n".join(f"- {p}" for p in problems))
        output = Path(values["output"])
        if (output / "recipe.yaml").is_file() and not values.get("resume") and not values.get("overwrite"):
            raise ToolkitError(f"{output} already holds a run: resume it on the Runs tab, set --overwrite (under All recipe "
                               "options) to start it over, or choose another --output")
        args = forms.command_args(self.fields, values, self.manager)
        process = self.runs.launch(args, output, int(nproc or 1))
        return values["output"], f"Launched {Path(values['output']).name} (process {process.pid})."

    def load(self, path: str) -> dict[str, Any]:
        from toolkit.recipe import read_yaml, resolve_recipe

        data = read_yaml(self.roots.readable_path(path, "recipe file"))
        resolve_recipe(data, source=path, manager=self.manager)  # every problem of the file, named, before the form changes
        return forms.values_from_recipe(self.fields, data)

    def save(self, raw: dict[str, Any], path: str) -> str:
        values, problems = self.compose(raw)
        if problems:
            raise ToolkitError("the recipe has problems:\n" + "\n".join(f"- {p}" for p in problems))
        target = self.roots.writable_path(path, "recipe file")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.roots.writable_path(target.with_name(f".{target.name}.tmp"), "recipe file")
        tmp.write_text(forms.recipe_yaml(values))
        tmp.replace(target)
        return f"Saved {target}."

    # -- runs -------------------------------------------------------------------------------
    def run_path(self, value: str) -> Path:
        return self.roots.writable_path(value, "run")

    def resume(self, run_dir: Path) -> Any:
        """Resume a run; one started outside the page (no launch of ours, only its recipe.yaml) has that
        recipe's paths checked against the roots first, as a recipe typed into the page would."""
        from toolkit.recipe import read_yaml
        from toolkit_webui.runs import LAUNCH_FILE

        recipe = run_dir / "recipe.yaml"
        self.runs.check_links(run_dir)  # before reading recipe.yaml, which a link could lead anywhere
        if not (run_dir / LAUNCH_FILE).is_file() and recipe.is_file():
            self.checked({**read_yaml(recipe), "output": str(run_dir)})
        return self.runs.resume(run_dir)

    def run_view(self, selected: str | None) -> tuple:
        rows = self.runs.table()
        choices = [(p.name, str(p)) for p in self.runs.run_dirs()]
        if not selected:
            empty = curves([])
            return rows, choices, *empty.values(), ""
        run_dir = self.run_path(selected)
        return rows, choices, *curves(self.runs.metrics(run_dir)).values(), self.runs.log(run_dir)


def build(app: App) -> Any:
    """The ``gr.Blocks`` page."""
    import gradio as gr

    with gr.Blocks(title="toolkit", analytics_enabled=False) as page:
        gr.Markdown(f"## toolkit\nRuns directory: `{app.roots.runs}`; readable: "
                    + ", ".join(f"`{p}`" for p in app.roots.readable))
        with gr.Tabs() as tabs:
            with gr.Tab("Recipe", id="recipe"):
                recipe = _recipe_tab(app)
            with gr.Tab("Runs", id="runs"):
                run_select = runs_tab(app)
            with gr.Tab("Data", id="data"):
                data_tab(app)
            with gr.Tab("Plan", id="plan"):
                plan_tab(app)
            with gr.Tab("Export", id="export"):
                export_tab(app)
            with gr.Tab("Chat", id="chat"):
                chat_tab(app)
        launch_button, inputs, nproc, message, initial = recipe
        page.load(*initial, concurrency_limit=1, concurrency_id=DESCRIBE)

        @shows_errors(gr.update(), gr.update())
        def launch(*raw: Any) -> tuple:
            run, text = app.launch(_by_key(app, raw[:-1]), raw[-1])
            return text, gr.Tabs(selected="runs"), gr.update(value=run, choices=[(p.name, str(p)) for p in app.runs.run_dirs()])

        launch_button.click(launch, [*inputs, nproc], [message, tabs, run_select])
    return page


def _by_key(app: App, raw: tuple) -> dict[str, Any]:
    return {field.key: value for field, value in zip(app.fields, raw)}


def _recipe_tab(app: App) -> tuple:
    import gradio as gr

    widgets: dict[str, Any] = {}
    by_key = {f.key: f for f in app.fields}
    groups: dict[str, Any] = {}
    with gr.Row():
        with gr.Column(scale=3):
            first = [by_key[name] for name in FIRST if name in by_key]
            widgets.update(_grid(first, {"output": app.next_run_name()}))
            with gr.Accordion("All recipe options", open=False):
                widgets.update(_grid([f for f in app.fields if f.section is None and f.key not in widgets]))
            shown = forms.form_sections(app.fields, {f.key: forms.widget_value(f, f.default) for f in app.fields})
            for section, kind, fields in _sections(app.fields):
                visible = section in shown
                with gr.Accordion(f"{section} ({kind}) options", open=kind in ("loss", "tuner"), visible=visible,
                                  elem_id=f"section-{section}") as group:
                    widgets.update(_grid(fields))
                groups[section] = (kind, group)
        with gr.Column(scale=2):
            nproc = gr.Number(1, precision=0, minimum=1, label="processes (torchrun when more than 1)", elem_id="nproc")
            launch_button = gr.Button("Launch", variant="primary", elem_id="launch")
            message = gr.Markdown(elem_id="recipe-message")
            status = gr.Markdown(elem_id="recipe-status")
            yaml_box = gr.Code(language="yaml", label="recipe.yaml", elem_id="recipe-yaml", interactive=False, wrap_lines=True)
            command_box = gr.Code(language="shell", label="command line", elem_id="recipe-command", interactive=False,
                                  wrap_lines=True)
            path = gr.Textbox(label="recipe file (inside the runs or data directories)", value="recipes/recipe.yaml",
                              elem_id="recipe-path")
            with gr.Row():
                save_button = gr.Button("Save recipe", elem_id="save-recipe")
                load_button = gr.Button("Load recipe", elem_id="load-recipe")
    inputs = [widgets[f.key] for f in app.fields]
    sections = list(groups)
    shown_state = gr.State(sorted(shown))  # the sections this browser tab shows now

    def describe(*raw: Any) -> tuple:
        """The recipe's YAML, command line and status, and the option sections it shows (those of what it chooses
        or names: a loss, a reward, a tracker), sending only the sections whose visibility changes."""
        *values, count, before = raw
        by_key = _by_key(app, tuple(values))
        yaml_text, command, status = app.describe(by_key, count)
        now = forms.form_sections(app.fields, by_key)
        visible = [gr.update(visible=section in now) if (section in now) != (section in before) else gr.skip()
                   for section in sections]
        return yaml_text, command, status, *visible, sorted(now)

    # One event per edit, on a queue of its own: one at a time, in the order sent, with the page's first describe
    # (page.load), as a field changed while that first one still ran had its recipe overwritten by the older one's (a
    # loaded CI machine, 2026-12-07). Each event costs the browser time in proportion to its inputs and outputs times
    # the page's components (Gradio 6 finds each by a walk of the page's tree): the YAML and the sections were two
    # events of 225 inputs each, 2.9 CPU-s of headless chromium per edit, now one (1.2)
    redraw = [*inputs, nproc, shown_state], [yaml_box, command_box, status, *(group for _, group in groups.values()), shown_state]
    gr.on([w.change for w in inputs] + [nproc.change], describe, *redraw, concurrency_limit=1, concurrency_id=DESCRIBE,
          show_progress="hidden")
    save_button.click(shows_errors()(lambda *raw: app.save(_by_key(app, raw[:-1]), raw[-1])), [*inputs, path], message)

    def load(path_value: str) -> list:
        try:
            values = app.load(path_value)
        except ToolkitError as exc:
            return [f"**Error:** {exc}", *[gr.update() for _ in inputs]]
        return [f"Loaded {path_value}.", *[values[f.key] for f in app.fields]]

    load_button.click(load, path, [message, *inputs])
    return launch_button, inputs, nproc, message, (describe, *redraw)


def _grid(fields: list[forms.Field], values: dict[str, Any] | None = None, columns: int = 3) -> dict[str, Any]:
    """Widgets for ``fields``, ``columns`` to a row."""
    import gradio as gr

    made = {}
    for start in range(0, len(fields), columns):
        with gr.Row(equal_height=True):
            for field in fields[start:start + columns]:
                made[field.key] = widget(field, (values or {}).get(field.key))
    return made


def _sections(fields: list[forms.Field]) -> list[tuple[str, str, list[forms.Field]]]:
    order: dict[str, tuple[str, list[forms.Field]]] = {}
    for field in fields:
        if field.section is not None:
            order.setdefault(field.section, (field.kind or "", []))[1].append(field)
    return [(section, kind, items) for section, (kind, items) in order.items()]
