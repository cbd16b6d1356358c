"""``toolkit export``: turn a run, checkpoint, HF directory or preset into another tool's artefact."""

from __future__ import annotations

import click


@click.command("export")
@click.argument("source")
@click.option("--to", "exporter", default="hf", show_default=True, help="Exporter: hf, mcore, vllm, lmdeploy.")
@click.option("--output", "-o", required=True, type=click.Path(file_okay=False), help="Directory to write.")
@click.option("--merge-lora/--no-merge-lora", default=True, help="Merge adapters into the base weights (hf).")
@click.option("--adapter-only", is_flag=True, help="Write only the adapters in PEFT's format.")
@click.option("--option", "extra", multiple=True, help="Exporter option KEY=VALUE (repeatable), e.g. tp=2.")
@click.option("--overwrite", is_flag=True, help="Replace an existing output directory that holds a previous export.")
@click.option("--quantize", default=None, help="Quantize the export: bnb4, bnb8, gptq, awq, fp8 (toolkit-quantize); a "
                                             "quantization.json beside it gives size and held-out perplexity.")
@click.option("--calibration-dataset", default=None, help="With --quantize: your records to calibrate GPTQ/AWQ on (its last "
                                                          "10% are held out for the report unless --eval-dataset is given).")
@click.option("--eval-dataset", default=None, help="With --quantize: held-out text for the perplexity in the report.")
@click.option("--trust-remote-code", is_flag=True, help="Run the model's own Python code (auto_map); a run's recipe.yaml "
                                                        "cannot turn this on.")
def export_command(source: str, exporter: str, output: str, merge_lora: bool, adapter_only: bool, extra: tuple[str, ...],
                   overwrite: bool, quantize: str | None, calibration_dataset: str | None, eval_dataset: str | None,
                   trust_remote_code: bool) -> None:
    """Export SOURCE (run dir, checkpoint, HF dir, mcore dir or preset) with an exporter."""
    from toolkit.export import run_export

    if quantize:
        from toolkit.quantize import run_quantized_export

        run_quantized_export(source, output, quantize, exporter=exporter, calibration=calibration_dataset,
                             eval_dataset=eval_dataset, extra=extra, overwrite=overwrite,
                             trust_remote_code=trust_remote_code)
        return
    if calibration_dataset or eval_dataset:
        from toolkit.errors import ConfigError

        raise ConfigError("--calibration-dataset and --eval-dataset apply to --quantize; add --quantize METHOD or leave them out")

    run_export(source, exporter, output, merge_lora=merge_lora, adapter_only=adapter_only, extra=extra, overwrite=overwrite,
               trust_remote_code=trust_remote_code)
