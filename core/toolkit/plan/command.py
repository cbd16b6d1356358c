"""The ``toolkit plan`` command: flags -> model shape, cluster and workload -> ranked report."""

from __future__ import annotations

import click

from toolkit.plan.memory import STRATEGIES, TUNERS


@click.command("plan")
@click.option("--model", "model", required=True, help="HF model directory or a config.json (no weights needed).")
@click.option("--gpus", type=int, required=True, help="GPUs in total (over all nodes).")
@click.option("--nodes", type=int, default=1, show_default=True, help="Nodes the GPUs are spread over.")
@click.option("--gpu", "gpu_kind", default="h100", show_default=True, help="GPU kind for speeds: h100, h200, a100, a100-40, l40s.")
@click.option("--gpu-memory", default=None, help="Memory per GPU, e.g. 80GiB (default: the GPU kind's).")
@click.option("--seq-len", type=int, default=4096, show_default=True, help="Tokens per row.")
@click.option("--micro-batch-size", type=int, default=1, show_default=True, help="Rows per micro-batch per DP rank.")
@click.option("--global-batch-size", type=int, default=0, help="Rows per optimizer step (0: one micro-batch per data-parallel rank, as training counts it).")
@click.option("--tuner", type=click.Choice(TUNERS), default="full", show_default=True)
@click.option("--lora-rank", type=int, default=16, show_default=True)
@click.option("--local-master-weights/--no-local-master-weights", default=True, show_default=True,
              help="local strategy: bf16 params + fp32 master weights (off: fp32 params under bf16 autocast).")
@click.option("--local-bf16-mode", type=click.Choice(["master", "autocast", "pure"]), default=None,
              help="local strategy: master (bf16 params + fp32 master weights and AdamW), autocast (fp32 params), "
                   "pure (bf16 params, grads and AdamW states); overrides --local-master-weights.")
@click.option("--local-recompute-logits", is_flag=True, help="local strategy: recompute chunk logits in backward (less memory).")
@click.option("--local-logps-chunk-tokens", type=int, default=2048, show_default=True, help="Tokens per log-prob chunk.")
@click.option("--local-kernels", type=click.Choice(["auto", "triton", "liger", "torch", "none"]), default="auto",
              show_default=True, help="local strategy: fused RMSNorm/SwiGLU kernels (auto: triton, as on a GPU).")
@click.option("--local-packed-attention", type=click.Choice(["auto", "flex", "sdpa-mask"]), default="auto",
              show_default=True, help="local strategy: attention of packed rows and of Gemma 2's soft-capped scores "
                                      "(auto: flex, as on a GPU; sdpa-mask keeps Gemma 2 eager, its scores kept).")
@click.option("--local-fused-loss/--no-local-fused-loss", default=True, show_default=True,
              help="local strategy: fused linear + cross-entropy head (the engine's GPU default for pt/sft).")
@click.option("--megatron-fused-loss/--no-megatron-fused-loss", default=True, show_default=True,
              help="megatron strategy: fused output head, no [tokens, V/tp] logits (the engine's GPU default for pt/sft).")
@click.option("--strategies", default=",".join(STRATEGIES), show_default=True, help="Strategies to consider, comma-separated.")
@click.option("--top", type=int, default=3, show_default=True, help="Layouts to print.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the report.")
def plan_command(model: str, gpus: int, nodes: int, gpu_kind: str, gpu_memory: str | None, seq_len: int,
                 micro_batch_size: int, global_batch_size: int, tuner: str, lora_rank: int, local_master_weights: bool,
                 local_bf16_mode: str | None,
                 local_recompute_logits: bool, local_logps_chunk_tokens: int, local_kernels: str,
                 local_packed_attention: str, local_fused_loss: bool,
                 megatron_fused_loss: bool, strategies: str, top: int, as_json: bool) -> None:
    """Recommend parallel layouts: per-GPU memory, estimated step time and the reasons.

    Example: toolkit plan --model examples/configs/qwen2-72b.json --gpus 32 --nodes 4 --gpu-memory 80GiB
    """
    import json

    from toolkit.plan.auto import planned_kernels, planned_packed_attention
    from toolkit.plan.hardware import make_cluster
    from toolkit.plan.memory import Workload
    from toolkit.plan.model import load_shape
    from toolkit.plan.report import render, to_json
    from toolkit.plan.search import plan
    from toolkit.train.hf_engine import LocalConfig

    cluster = make_cluster(gpus, nodes, gpu_memory, gpu_kind)
    # the engine's own rule: --local-bf16-mode, else the older --local-master-weights
    scheme = LocalConfig(bf16_mode=local_bf16_mode, master_weights=local_master_weights).bf16_scheme()
    workload = Workload(seq_len=seq_len, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
                        tuner=tuner, lora_rank=lora_rank,
                        bf16_mode=scheme,
                        recompute_logits=local_recompute_logits, logps_chunk_tokens=local_logps_chunk_tokens,
                        kernels=planned_kernels(local_kernels), fused_loss=local_fused_loss,
                        packed_attention=planned_packed_attention(local_packed_attention),
                        megatron_fused_loss=megatron_fused_loss)
    chosen = tuple(s.strip() for s in strategies.split(",") if s.strip())
    result = plan(load_shape(model), cluster, workload, chosen, model=trainable_reference(model))
    click.echo(json.dumps(to_json(result, top), indent=2) if as_json else render(result, top))


def trainable_reference(model: str) -> str:
    """The ``--model`` a training command takes for the planned model: its directory (``dir/config.json`` names
    ``dir``); a config file written by hand has no weights, so ``MODEL_DIR`` stands for them in the printed commands."""
    from pathlib import Path

    path = Path(model)
    if path.is_file():
        return str(path.parent) if path.name == "config.json" else "MODEL_DIR"
    return model
