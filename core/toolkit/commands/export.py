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
@click.option("--tp", type=int, default=None, help="Tensor-parallel size of the written layout (mcore).")
@click.option("--pp", type=int, default=None, help="Pipeline-parallel size of the written layout (mcore).")
@click.option("--vpp", type=int, default=None, help="Virtual pipeline stages per rank (mcore).")
@click.option("--ep", type=int, default=None, help="Expert-parallel size (mcore, MoE models).")
@click.option("--trust-remote-code", is_flag=True, help="Run the model's own Python code (auto_map); a run's recipe.yaml "
                                                        "cannot turn this on.")
def export_command(source: str, exporter: str, output: str, merge_lora: bool, adapter_only: bool, extra: tuple[str, ...],
                   overwrite: bool, quantize: str | None, calibration_dataset: str | None, eval_dataset: str | None,
                   tp: int | None, pp: int | None, vpp: int | None, ep: int | None, trust_remote_code: bool) -> None:
    """Export SOURCE (run dir, checkpoint, HF dir, mcore dir or preset) with an exporter."""
    from toolkit.export import run_export

    extra = (*layout_options(exporter, {"tp": tp, "pp": pp, "vpp": vpp, "ep": ep}), *extra)

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


def layout_options(exporter: str, sizes: dict[str, int | None]) -> list[str]:
    """``--tp 2 --pp 2`` as the exporter's ``tp=2 pp=2`` options, refused for an exporter without a layout."""
    given = {axis: size for axis, size in sizes.items() if size is not None}
    if not given:
        return []
    import dataclasses

    from toolkit.errors import ConfigError
    from toolkit.plugins import get_plugin_manager

    fields = {f.name for f in dataclasses.fields(get_plugin_manager().get("exporter", exporter).Config)}
    unknown = [f"--{axis}" for axis in given if axis not in fields]
    if unknown:
        raise ConfigError(f"{', '.join(unknown)} set the parallel layout an exporter writes (--to mcore); "
                          f"--to {exporter} writes none")
    return [f"{axis}={size}" for axis, size in given.items()]
