"""DeepSeek-V3's multi-token-prediction layers (issue 27): no strategy builds them, so they are dropped with a
warning on load and left out of exports, whose config then says ``num_nextn_predict_layers: 0``."""

from __future__ import annotations

import json


def test_deepseek_mtp_layers_are_dropped_with_a_warning_and_left_out_of_exports(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    from toolkit.contracts import ExportModel
    from toolkit.hfdir import write_model_metadata
    from toolkit.models import materialize_preset, resolve_model

    directory = materialize_preset("tiny-deepseek-v3", tmp_path / "v3")
    assert json.loads((directory / "config.json").read_text())["num_nextn_predict_layers"] == 1  # transformers' default
    resolve_model(str(directory))
    assert "multi-token-prediction" not in capsys.readouterr().err  # the config's 1, but no MTP tensors: nothing dropped
    # DeepSeek stores its MTP layer after the decoder layers (model.layers.61.* for V3's 61 layers; 2 here)
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(128, 256), "model.layers.2.enorm.weight": torch.ones(128)},
              str(directory / "model-mtp.safetensors"))
    source = resolve_model(str(directory))
    err = capsys.readouterr().err
    assert "toolkit: warning:" in err and "2 tensors of 1 multi-token-prediction layer(s)" in err
    assert "model.layers.2.*" in err and len(err.strip().splitlines()) == 1
    out = tmp_path / "export"
    out.mkdir()
    write_model_metadata(ExportModel(source=source, tensors=lambda: iter(())), out)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert source.config.num_nextn_predict_layers == 1  # the source's config is left as it was
