"""The Runs, Data, Plan, Export and Chat tabs of the page (the Recipe tab is in :mod:`toolkit_webui.app`)."""

from __future__ import annotations

import hashlib
from typing import Any

from toolkit.errors import ToolkitError
from toolkit_webui import forms, tools

REFRESH_SECONDS = 2.0
"""How often the Runs tab looks for changes while a run of the directory trains or stops. A tick costs the browser
about half a CPU-second in a page of this size, more while the curves it draws grow: every second, an open page
of a training run kept most of a core of the user's machine busy (headless chromium, 2026-12-07)."""
IDLE_REFRESH_SECONDS = 5.0
"""How often it looks while none does (an open Runs tab with nothing to show took 0.7 of a core ticking every
second, 0.3 every 5 s). A run launched meanwhile shows within this many seconds, and is then followed every
:data:`REFRESH_SECONDS`."""
LIVE_STATES = ("running", "stopping")


def refresh_seconds(rows: list[list[Any]]) -> float:
    """The Runs tab's tick for these runs-table rows (name, state, step, loss)."""
    return REFRESH_SECONDS if any(str(row[1]).startswith(LIVE_STATES) for row in rows) else IDLE_REFRESH_SECONDS


def _error(exc: BaseException) -> str:
    return f"**Error:** {exc}" if isinstance(exc, ToolkitError) else f"**Error:** {type(exc).__name__}: {exc}"


def runs_tab(app: Any) -> Any:
    """The runs of the directory with their status; stop, resume; live curves and the log of the chosen one."""
    import gradio as gr

    with gr.Row():
        table = gr.Dataframe(headers=["run", "status", "step", "loss"], interactive=False, label="runs",
                             elem_id="runs-table", value=app.runs.table())
    with gr.Row():
        select = gr.Dropdown(choices=[(p.name, str(p)) for p in app.runs.run_dirs()], label="run", elem_id="run-select",
                             scale=3)
        stop = gr.Button("Stop (saves a checkpoint)", elem_id="stop-run", scale=1)
        resume = gr.Button("Resume", elem_id="resume-run", scale=1)
    message = gr.Markdown(elem_id="runs-message")
    plots = []
    for pair in (("loss", "learning rate"), ("tokens/s", "reward")):
        with gr.Row():
            plots += [gr.LinePlot(x="step", y="value", color="series", title=title, label=title, x_title="step", y_title=title,
                                  elem_id=f"plot-{title.split()[0].replace('/', '')}", height=240,
                                  elem_classes=["toolkit-plot"]) for title in pair]
    log = gr.Code(label="log (webui.log)", elem_id="run-log", interactive=False)
    timer = gr.Timer(REFRESH_SECONDS)

    # what this browser tab was sent: each tick sends only what changed, so an idle page (a stopped run, another
    # tab) neither re-sends its curves nor has the browser redraw them on every tick
    shown = gr.State({})

    def refresh(selected: str | None, before: dict) -> list:
        try:
            rows, choices, *curves, text = app.run_view(selected)
        except Exception:  # a run directory vanishing mid-read: the next tick shows it again
            return [gr.skip() for _ in outputs]
        digests = [hashlib.sha1(frame.to_json(orient="values").encode()).hexdigest() for frame in curves]
        now = {"rows": rows, "choices": [list(c) for c in choices], "log": text, "plots": digests,
               "plots before": before.get("plots"), "tick": refresh_seconds(rows)}
        # a plot is sent on the tick its data changed and on the next one: Gradio 6's LinePlot draws the data of
        # the update before the newest (a run whose last steps came in one tick kept showing the previous curve)
        recent = [before.get("plots") or [None] * len(curves), before.get("plots before") or [None] * len(curves)]
        # colors_in_legend on every update redraws the plot with a colour for each series: an update of
        # the data alone keeps the colour scale of the first drawing (none, if that had no data yet)
        plotted = [gr.update(value=frame, colors_in_legend=sorted(set(frame["series"])) or None)
                   if any(digest != sent[index] for sent in recent) else gr.skip()
                   for index, (frame, digest) in enumerate(zip(curves, digests))]

        def changed(key: str, update: Any) -> Any:
            return update if key not in before or before[key] != now[key] else gr.skip()

        return [changed("rows", rows), changed("choices", gr.update(choices=now["choices"])), now, *plotted,
                changed("log", text), changed("tick", gr.Timer(now["tick"]))]

    outputs = [table, select, shown, *plots, log, timer]
    once = {"concurrency_id": "runs-refresh", "concurrency_limit": 1, "trigger_mode": "always_last"}
    timer.tick(refresh, [select, shown], outputs, show_progress="hidden", **once)
    select.change(refresh, [select, shown], outputs, show_progress="hidden", **once)

    def do_stop(selected: str | None) -> str:
        try:
            return app.runs.stop(app.run_path(selected or ""))
        except Exception as exc:
            return _error(exc)

    def do_resume(selected: str | None) -> str:
        try:
            process = app.resume(app.run_path(selected or ""))
        except Exception as exc:
            return _error(exc)
        return f"Resuming (process {process.pid}) from the newest whole checkpoint."

    stop.click(do_stop, select, message)
    resume.click(do_resume, select, message)
    return select


def data_tab(app: Any) -> None:
    """``toolkit data inspect`` in the page: samples as training sees them, trained tokens highlighted."""
    import gradio as gr

    from toolkit.models import PRESETS

    with gr.Row():
        dataset = gr.Textbox("demo", label="dataset (bundled name or a file inside the data directories)", elem_id="data-dataset")
        model = gr.Dropdown(list(PRESETS), value="tiny-llama", allow_custom_value=True, label="model (tokenizer, template)",
                            elem_id="data-model")
        loss = gr.Dropdown(sorted(app.manager.registry("loss").names()), value="sft", label="loss (decides which tokens train)",
                           elem_id="data-loss")
        fmt = gr.Dropdown(["auto", *sorted(app.manager.registry("dataset_format").names())], value="auto", label="format",
                          elem_id="data-format")
        num = gr.Number(3, precision=0, minimum=1, label="samples", elem_id="data-num")
        seq_len = gr.Number(512, precision=0, minimum=1, label="seq len", elem_id="data-seq-len")
    show = gr.Button("Show samples", variant="primary", elem_id="data-show")
    summary = gr.Markdown(elem_id="data-summary")
    samples = gr.HighlightedText(label="samples (trained tokens highlighted)", color_map={"trained": "green"},
                                 show_legend=True, combine_adjacent=False, elem_id="data-samples")

    def run(*args: Any) -> tuple:
        try:
            text, segments = tools.preview(app.roots, *args)
        except Exception as exc:
            return _error(exc), []
        return text, segments

    show.click(run, [dataset, model, loss, fmt, num, seq_len], [summary, samples])


def plan_tab(app: Any) -> None:
    """``toolkit plan``: layouts for a model on N GPUs, per-GPU memory and estimated step time."""
    import gradio as gr

    from toolkit.models import PRESETS
    from toolkit.plan.hardware import GPU_KINDS
    from toolkit.plan.memory import TUNERS

    with gr.Row():
        model = gr.Dropdown(list(PRESETS), value="tiny-llama", allow_custom_value=True,
                            label="model (preset, HF directory or config.json)", elem_id="plan-model")
        gpus = gr.Number(8, precision=0, minimum=1, label="GPUs", elem_id="plan-gpus")
        kind = gr.Dropdown(list(GPU_KINDS), value="h100", label="GPU kind", elem_id="plan-gpu")
        memory = gr.Textbox("", label="GPU memory (e.g. 80GiB; empty: the kind's)", elem_id="plan-memory")
        seq_len = gr.Number(4096, precision=0, minimum=1, label="seq len", elem_id="plan-seq-len")
        tuner = gr.Dropdown(list(TUNERS), value="full", label="tuner", elem_id="plan-tuner")
    button = gr.Button("Plan", variant="primary", elem_id="plan-run")
    message = gr.Markdown(elem_id="plan-message")
    report = gr.Code(label="toolkit plan", elem_id="plan-report", interactive=False)

    def run(*args: Any) -> tuple:
        try:
            return "", tools.plan(app.roots, *args)
        except Exception as exc:
            return _error(exc), ""

    button.click(run, [model, gpus, kind, memory, seq_len, tuner], [message, report])


def export_tab(app: Any) -> None:
    """``toolkit export`` of a run (its newest checkpoint) with any registered exporter."""
    import gradio as gr

    exporters = sorted(app.manager.registry("exporter").names())
    with gr.Row():
        source = gr.Dropdown([(p.name, str(p)) for p in app.runs.run_dirs()], allow_custom_value=True,
                             label="source (a run, checkpoint or HF directory)", elem_id="export-source")
        exporter = gr.Dropdown(exporters, value="hf" if "hf" in exporters else exporters[0], label="exporter",
                               elem_id="export-to")
        output = gr.Textbox("", label="output directory (inside the runs directory; empty: SOURCE/export)",
                            elem_id="export-output")
    options = gr.Textbox("", lines=2, label="exporter options, KEY=VALUE per line (toolkit export --option)",
                         elem_id="export-options")
    with gr.Row():
        refresh = gr.Button("Refresh runs", elem_id="export-refresh")
        button = gr.Button("Export", variant="primary", elem_id="export-run")
    message = gr.Markdown(elem_id="export-message")

    def run(src: str, to: str, out: str, opts: str) -> str:
        try:
            target = out or f"{(src or '').rstrip('/')}/{'export' if to == 'hf' else 'export-' + to}"
            path, _ = tools.export(app.roots, src or "", to, target, opts)
        except Exception as exc:
            return _error(exc)
        return f"Exported to `{path}`."

    button.click(run, [source, exporter, output, options], message)
    refresh.click(lambda: gr.update(choices=[(p.name, str(p)) for p in app.runs.run_dirs()]), None, source)


def chat_tab(app: Any) -> None:
    """Chat with an export through a registered inference backend; its options come from the backend's Config."""
    import gradio as gr

    backends = app.manager.registry("inference_backend")
    names = sorted(backends.names())
    with gr.Row():
        model = gr.Textbox("", label="model (a run, its export, an HF directory or a preset)", elem_id="chat-model", scale=3)
        backend = gr.Dropdown(names, value="hf" if "hf" in names else names[0], label="backend", elem_id="chat-backend")
    widgets, groups = [], []
    from toolkit_webui.app import widget

    for name in names:
        fields = forms.config_fields(backends.get(name).Config, name, "inference_backend")
        with gr.Accordion(f"{name} options", open=False, visible=name == backend.value) as group:
            widgets += [(field, widget(field)) for field in fields]
        groups.append((name, group))
    chatbot = gr.Chatbot(label="chat", elem_id="chat-box", height=320)
    with gr.Row():
        prompt = gr.Textbox("", label="message", elem_id="chat-prompt", scale=4)
        send = gr.Button("Send", variant="primary", elem_id="chat-send", scale=1)
    message = gr.Markdown(elem_id="chat-message")

    def reply(history: list, text: str, model_ref: str, chosen: str, *raw: Any) -> tuple:
        options = {}
        try:
            for (field, _), value in zip(widgets, raw):
                if field.section == chosen:
                    options[field.name] = forms.parse_widget(field, value)
            answer = tools.generate(app.roots, model_ref, chosen, options, text)
        except Exception as exc:
            return history, text, _error(exc)
        return [*history, {"role": "user", "content": text}, {"role": "assistant", "content": answer}], "", ""

    inputs = [chatbot, prompt, model, backend, *[w for _, w in widgets]]
    send.click(reply, inputs, [chatbot, prompt, message])
    prompt.submit(reply, inputs, [chatbot, prompt, message])
    backend.change(lambda chosen: [gr.update(visible=name == chosen) for name, _ in groups], backend, [g for _, g in groups])
