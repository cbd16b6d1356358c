"""A preset materialised by every rank of a process group at once is complete on each of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from toolkit.testing import run_distributed

pytestmark = pytest.mark.slow


def materialise_on_this_rank(root: str) -> dict:
    """Each rank writes the preset into its own folder while the process group is up."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from toolkit.builtins.loaders import materialize_preset

    target = materialize_preset("tiny-qwen2", Path(root) / f"rank-{dist.get_rank()}")
    weights = load_file(str(target / "model.safetensors"))
    return {"files": sorted(p.name for p in target.iterdir()), "sum": float(sum(t.double().sum() for t in weights.values()))}


def test_every_rank_writes_a_complete_preset(tmp_path):
    # transformers' save_pretrained writes nothing on ranks other than 0 of a process group.
    first, second = run_distributed(materialise_on_this_rank, nproc=2, args=(str(tmp_path),))
    assert "config.json" in second["files"] and "model.safetensors" in second["files"]
    assert first == second
