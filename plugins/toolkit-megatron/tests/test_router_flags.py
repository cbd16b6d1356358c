"""The router-loss coefficients under --strategy megatron: the deprecated --megatron-moe-* flags (Megatron's own
per-layer weights) converted to the core's, and a coefficient for a model without a router (one process, nothing trains)."""

from __future__ import annotations

import pytest

from toolkit.errors import ConfigError
from toolkit.recipe import resolve_recipe


def _four_layer_config():
    """A Qwen3-MoE config whose first layer is dense: 3 MoE layers, top-2 (k != L, so a conversion shows)."""
    from toolkit_moe.testing import tiny_config

    return tiny_config("qwen3_moe", num_hidden_layers=4, mlp_only_layers=[0])


def _megatron_coefficients(values: dict, hf_config) -> tuple[dict, str]:
    """Megatron's coefficients for a recipe mapping, and the deprecation lines printed on the way."""
    import contextlib
    import io

    from toolkit_megatron.moe import deprecated_coefficients, router_options
    from toolkit_megatron.strategy import MegatronConfig

    recipe = resolve_recipe({"strategy": "megatron", **values})
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        aux, z = deprecated_coefficients(recipe, MegatronConfig(**recipe.options.get("megatron", {})), hf_config, is_main=True)
    return router_options(hf_config, aux, z, "alltoall"), err.getvalue()


def test_deprecated_megatron_coefficients_train_the_objective_they_trained_before():
    """--megatron-moe-aux-loss-coef / --megatron-moe-z-loss-coef held Megatron's own per-layer weights, handed to
    megatron-core as given: they still are, and the warning names the --router-* value that trains the same."""
    pytest.importorskip("toolkit_moe", reason="tiny_config builds the model config")
    hf_config = _four_layer_config()
    old, err = _megatron_coefficients({"megatron": {"moe_aux_loss_coef": 0.1, "moe_z_loss_coef": 0.01}}, hf_config)
    assert old["moe_aux_loss_coeff"] == pytest.approx(0.1, rel=1e-12)
    assert old["moe_z_loss_coeff"] == pytest.approx(0.01, rel=1e-12)
    assert [line for line in err.splitlines() if "deprecated" in line] == [
        "toolkit: --megatron-moe-aux-loss-coef 0.1 (YAML megatron: moe_aux_loss_coef) is deprecated; it is Megatron's "
        "per-layer weight, which is --router-aux-loss-coef 0.15 for this model (3 MoE layers, top-2): give that instead",
        "toolkit: --megatron-moe-z-loss-coef 0.01 (YAML megatron: moe_z_loss_coef) is deprecated; it is Megatron's "
        "per-layer weight, which is --router-z-loss-coef 0.03 for this model (3 MoE layers, top-2): give that instead"]
    new, _ = _megatron_coefficients({"router_aux_loss_coef": 0.15, "router_z_loss_coef": 0.03}, hf_config)
    assert new == {k: pytest.approx(v) if isinstance(v, float) else v for k, v in old.items()}
    both, _ = _megatron_coefficients({"router_aux_loss_coef": 0.15, "megatron": {"moe_aux_loss_coef": 0.1}}, hf_config)
    assert both["moe_aux_loss_coeff"] == pytest.approx(0.1)  # the same setting given both ways
    with pytest.raises(ConfigError, match=r"--megatron-moe-aux-loss-coef 0.1 \(deprecated; Megatron's per-layer weight, "
                                          r"--router-aux-loss-coef 0.15 for this model\) and --router-aux-loss-coef 0.1 "
                                          "disagree: give --router-aux-loss-coef only"):
        _megatron_coefficients({"router_aux_loss_coef": 0.1, "megatron": {"moe_aux_loss_coef": 0.1}}, hf_config)


def test_a_negative_deprecated_weight_is_refused_with_the_recipe():
    with pytest.raises(ConfigError, match=r"megatron: moe_z_loss_coef must be 0 \(off\) or more, got -0.1"):
        resolve_recipe({"strategy": "megatron", "megatron": {"moe_z_loss_coef": -0.1}})


def test_toolkit_moe_and_megatron_deprecated_weights_must_mean_the_same():
    """toolkit-moe's old flag moves to --router-aux-loss-coef; megatron's, converted, must agree with it."""
    pytest.importorskip("toolkit_moe")
    hf_config = _four_layer_config()
    same, _ = _megatron_coefficients({"moe": {"aux_loss_coef": 0.15}, "megatron": {"moe_aux_loss_coef": 0.1}}, hf_config)
    assert same["moe_aux_loss_coeff"] == pytest.approx(0.1)
    with pytest.raises(ConfigError, match="--megatron-moe-aux-loss-coef 0.1 .* and --router-aux-loss-coef 0.1 disagree"):
        _megatron_coefficients({"moe": {"aux_loss_coef": 0.1}, "megatron": {"moe_aux_loss_coef": 0.1}}, hf_config)


def test_a_coefficient_for_a_dense_model_is_refused(tmp_path):
    from toolkit.train.runner import run_training

    recipe = resolve_recipe({"model": "tiny-llama", "strategy": "megatron", "router_z_loss_coef": 0.01, "max_steps": 1,
                             "seq_len": 32, "max_samples": 4, "output": str(tmp_path / "run")})
    with pytest.raises(ConfigError, match="--router-z-loss-coef 0.01: model type 'llama' has no MoE router"):
        run_training(recipe)


def test_a_run_saved_with_the_deprecated_weights_resumes_with_them(tmp_path):
    """recipe.yaml keeps ``megatron: {moe_aux_loss_coef: ...}`` as given, so the run resumes with the same flag; a
    ``--router-aux-loss-coef`` of the same number is another objective and is reported as a change."""
    import yaml

    from toolkit.train.runner import check_resume_changes

    def recipe(**values):
        return resolve_recipe({"model": "tiny-qwen3-moe", "strategy": "megatron", "output": str(tmp_path),
                               "resume": "auto", **values})

    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe(megatron={"moe_aux_loss_coef": 0.1}).to_yaml_dict()))
    check_resume_changes(recipe(megatron={"moe_aux_loss_coef": 0.1}), is_main=True)
    with pytest.raises(ConfigError, match=r"router_aux_loss_coef: None -> 0.1"):
        check_resume_changes(recipe(router_aux_loss_coef=0.1), is_main=True)
