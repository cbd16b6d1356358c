"""Presets in the cache: one writer (rank 0 of a process group; a file lock between processes),
one on-disk format (transformers' checkpoint layout, per-expert keys for MoE), checked on read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from toolkit.errors import ModelError
from toolkit.testing import run_distributed


def materialise_on_this_rank(root: str) -> dict:
    """Every rank asks for the same MoE preset in the same cache while the process group is up;
    rank 1 starts first, so without the one-writer rule it would write the cache itself."""
    import time

    import torch.distributed as dist
    from safetensors import safe_open

    from toolkit.models import materialize_preset

    if dist.get_rank() == 0:
        time.sleep(1.0)
    target = materialize_preset("tiny-qwen2-moe", Path(root) / "model")
    with safe_open(str(target / "model.safetensors"), "pt") as weights:
        keys = sorted(weights.keys())
    return {"keys": keys, "mtime": (target / "model.safetensors").stat().st_mtime_ns}


@pytest.mark.slow
def test_rank_zero_writes_the_preset_and_the_other_rank_reads_it(tmp_path):
    first, second = run_distributed(materialise_on_this_rank, nproc=2, args=(str(tmp_path),))
    assert first == second  # the same file, written once
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")  # transformers reads back what it wrote
    assert model.config.num_experts == 4
    assert "model.layers.0.mlp.experts.0.down_proj.weight" in first["keys"]  # the checkpoint layout, not fused
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".model-")] == []  # no staging left behind


def test_a_damaged_cache_entry_is_refused_with_its_path(tmp_path):
    from toolkit.models import PRESET_MANIFEST, materialize_preset

    target = materialize_preset("tiny-llama", tmp_path / "model", num_hidden_layers=1)
    assert json.loads((target / PRESET_MANIFEST).read_text())["files"]["model.safetensors"]
    assert materialize_preset("tiny-llama", tmp_path / "model", num_hidden_layers=1) == target
    with open(target / "model.safetensors", "r+b") as handle:
        handle.seek(-4, os.SEEK_END)
        handle.write(b"\0\0\0\1")
    with pytest.raises(ModelError, match=f"preset cache {target} is damaged: model.safetensors was changed.*rm -rf"):
        materialize_preset("tiny-llama", tmp_path / "model", num_hidden_layers=1)
    with pytest.raises(ModelError, match="it holds .*not "):
        materialize_preset("tiny-llama", tmp_path / "model", num_hidden_layers=2)


def test_a_folder_without_a_manifest_is_not_taken_for_a_preset(tmp_path):
    from toolkit.models import materialize_preset

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ModelError, match=f"preset cache {tmp_path / 'model'} exists but has no toolkit-preset.json"):
        materialize_preset("tiny-llama", tmp_path / "model")


def test_a_waiting_rank_names_the_cache_when_rank_zero_never_writes(tmp_path, monkeypatch):
    from toolkit import models as loaders

    monkeypatch.setenv("TOOLKIT_PRESET_WAIT_S", "0.3")
    with pytest.raises(ModelError, match=f"rank 1 waited 0s for rank 0 to write the preset cache {tmp_path / 'never'}"):
        loaders._wait_for_preset(tmp_path / "never", "{}", rank=1)
