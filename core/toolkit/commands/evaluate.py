"""``toolkit eval``: generate answers to a question/answer dataset and score them (predictions.jsonl, scores.json).

Its ``--<metric>-<field>`` flags come from the ``Config`` of every registered metric (``--regex-pattern``,
``--rouge-type``), the same way training commands get theirs from losses and tuners.
"""

from __future__ import annotations

from typing import Any

import click


def build_eval_command(manager: Any) -> click.Command:
    from toolkit.commands.infer import given, sampling_options
    from toolkit.commands.train import add_registered_options, collect_values

    params: list[click.Parameter] = [
        click.Argument(["model"]),
        click.Option(["--dataset"], required=True, help="Question/answer records (jsonl, json, parquet, csv or a "
                                                        "save_to_disk folder): a prompt column and an answer column."),
        click.Option(["--metric", "metrics"], multiple=True, required=True,
                     help=f"Metric (repeatable): {', '.join(manager.registry('metric').names())}."),
        click.Option(["--backend"], default="hf", show_default=True, help="Inference backend: hf, vllm, lmdeploy."),
        click.Option(["--output"], default=None, help="Folder for predictions.jsonl and scores.json [default: "
                                                      "RUN/eval-<dataset> for a run, else ./eval-<dataset>]."),
        click.Option(["--batch-size"], default=8, show_default=True, type=int, help="Prompts generated together (hf)."),
        *sampling_options(),
        click.Option(["--system"], default="", help="System message placed before each prompt (chat template)."),
        click.Option(["--no-chat-template"], is_flag=True, help="Feed text prompts as raw text."),
        click.Option(["--dtype"], default="float32", show_default=True,
                     type=click.Choice(["float32", "bfloat16", "float16"])),
        click.Option(["--prompt-column"], default="", help="Column holding the prompt (text or chat messages) "
                                                           "[default: prompt, question, instruction, query or input]."),
        click.Option(["--answer-column"], default="", help="Column holding the answer (text or a list of accepted "
                                                           "answers) [default: answer, answers, reference, output, ...]."),
        click.Option(["--max-samples"], default=0, show_default=True, type=int, help="Evaluate the first N records (0: all)."),
        click.Option(["--option", "extra"], multiple=True, help="Backend option KEY=VALUE (repeatable)."),
        click.Option(["--trust-remote-code"], is_flag=True, help="Run the model directory's own Python code (auto_map)."),
    ]
    sections = add_registered_options(params, manager, ("metric",))

    sampling = {option.name for option in sampling_options()}

    def callback(model: str, dataset: str, metrics: tuple[str, ...], backend: str, output: str | None, batch_size: int,
                 system: str, no_chat_template: bool, dtype: str, prompt_column: str, answer_column: str, max_samples: int,
                 extra: tuple[str, ...], trust_remote_code: bool, **metric_flags: Any) -> None:
        from toolkit.scoring import default_output, run_eval

        generation = given({name: metric_flags.pop(name) for name in sampling})
        summary = run_eval(model, dataset, list(metrics), backend=backend, output=output,
                           metric_options=collect_values(metric_flags, sections), prompt_column=prompt_column,
                           answer_column=answer_column, max_samples=max_samples, extra=extra, batch_size=batch_size,
                           **generation, system=system,
                           chat_template=not no_chat_template, dtype=dtype, trust_remote_code=trust_remote_code)
        where = output or default_output(model, dataset)
        for name, value in summary["metrics"].items():
            matched = f" ({summary['matches'][name]}/{summary['count']})" if name in summary["matches"] else ""
            click.echo(f"{name}: {value:.4f}{matched}")
        click.echo(f"predictions and scores in {where}")

    return click.Command("eval", params=params, callback=callback, context_settings={"max_content_width": 110},
                         help="Score MODEL (a run, HF directory or preset) on a question/answer DATASET: generate an "
                              "answer per record and compare it with the reference by each --metric.",
                         short_help="Score a model on a question/answer dataset (exact, contains, regex, rouge).")
