"""``--report-to``: what MLflow, W&B (offline) and SwanLab (offline) hold after a run, read back with each
library's own client or reader; a tracker that is not installed is named with its pip command before the
model loads."""

from __future__ import annotations

import json
import struct

import pytest

from toolkit.errors import ConfigError
from toolkit.recipe import resolve_recipe


def train(tmp_path, name="run", **values):
    from toolkit.train.runner import run_training

    recipe = {"model": "tiny-llama", "dataset": ["demo"], "seq_len": 64, "max_steps": 3, "lr": 1e-3, "eval_split": 0.05,
              "eval_every": 2, "output": str(tmp_path / name), **values}
    return run_training(resolve_recipe(recipe))


def logged(run_dir, key):
    """``{step: value}`` of ``key`` in metrics.jsonl."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: m[key] for m in lines if key in m}


def test_mlflow_sqlite_store_holds_metrics_recipe_and_system(tmp_path):
    pytest.importorskip("mlflow", reason="MLflow is not installed: pip install 'toolkit-core[mlflow]'")
    import torch
    from mlflow.tracking import MlflowClient

    run = train(tmp_path, report_to=["mlflow"], run_name="first", stop_after=2)
    run = train(tmp_path, report_to=["mlflow"], run_name="first", resume="auto")  # continues the same MLflow run
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("toolkit")
    [found] = client.search_runs([experiment.experiment_id])
    assert found.info.run_name == "first" and found.info.status == "FINISHED"
    for key in ("loss", "eval/loss", "grad_norm"):
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}
        assert history == pytest.approx(logged(run, key)), key
    assert sorted(logged(run, "loss")) == [1, 2, 3] and sorted(logged(run, "eval/loss")) == [2, 3]
    assert found.data.params["lr"] == "0.001" and found.data.params["model"] == "tiny-llama"
    assert found.data.tags["system.torch"] == torch.__version__


def read_wandb_records(path):
    """The records of a .wandb file, parsed by wandb's own protobuf classes. wandb 0.31 ships no Python reader
    of its files (the datastore module left with the Go core, and ``wandb sync`` has no ``--view``): the file is
    a LevelDB-style log (a 7-byte header, 32 KiB blocks of crc/length/type-framed chunks), read here."""
    from wandb.proto import wandb_internal_pb2

    data, block, position = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B"
    chunks, pending = [], b""
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position:position + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (length == 0 and kind == 0):
            position += left
            continue
        chunk, position = data[position + 7:position + 7 + length], position + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            chunks.append(pending)
    records = []
    for chunk in chunks:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def test_wandb_offline_run_holds_metrics_recipe_and_system(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed: pip install 'toolkit-core[wandb]'")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    try:
        run = train(tmp_path, report_to=["wandb"])
    finally:
        wandb.teardown()  # ends wandb's service process
    [path] = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    records = read_wandb_records(path)
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(items)
    assert sorted(history) == [1, 2, 3]
    for key in ("loss", "eval/loss", "lr"):
        assert {s: h[key] for s, h in history.items() if key in h} == pytest.approx(logged(run, key)), key
    [started] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {item.key: json.loads(item.value_json) for item in started.config.update}
    assert started.display_name == "run" and config["recipe"]["lr"] == 0.001 and "torch" in config["system"]


def test_swanlab_offline_run_holds_metrics_and_recipe(tmp_path, monkeypatch):
    pytest.importorskip("swanlab", reason="SwanLab is not installed: pip install 'toolkit-core[swanlab]'")
    import yaml
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    monkeypatch.delenv("SWANLAB_MODE", raising=False)  # the default: offline, files under <run>/swanlog
    run = train(tmp_path, report_to=["swanlab"])
    [path] = list((run / "swanlog").glob("run-*/run-*.swanlab"))
    reader = DataStoreReader()
    reader.open(str(path))
    scalars: dict[str, dict[int, float]] = {}
    for raw in reader:
        record = Record()
        record.ParseFromString(raw)
        if record.HasField("scalar"):
            scalars.setdefault(record.scalar.key, {})[record.scalar.step] = record.scalar.value.number
    reader.close()
    for key in ("loss", "eval/loss"):
        assert scalars[key] == pytest.approx(logged(run, key)), key
    config = yaml.safe_load(next((run / "swanlog").glob("run-*/files/config.yaml")).read_text())
    assert "recipe" in json.dumps(config) and "tiny-llama" in json.dumps(config)


def test_tensorboard_event_files_hold_metrics_recipe_and_system(tmp_path):
    pytest.importorskip("tensorboard", reason="TensorBoard is not installed: pip install 'toolkit-core[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(tmp_path, report_to=["tensorboard"])
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    for key in ("loss", "eval/loss", "lr", "grad_norm"):
        assert {e.step: e.value for e in events.Scalars(key)} == pytest.approx(logged(run, key)), key
    texts = {tag: events.Tensors(tag)[0].tensor_proto.string_val[0].decode() for tag in ("recipe/text_summary",
                                                                                        "system/text_summary")}
    assert '"model": "tiny-llama"' in texts["recipe/text_summary"] and '"torch"' in texts["system/text_summary"]


def test_a_tracker_that_is_not_installed_is_named_before_the_model_loads(tmp_path, monkeypatch):
    import toolkit.builtins.strategies as strategies
    from toolkit.builtins.callbacks import Mlflow

    monkeypatch.setattr(strategies.LocalStrategy, "build", lambda *a, **k: pytest.fail("the model was built"))
    monkeypatch.setattr(Mlflow, "available", lambda self: False)
    with pytest.raises(ConfigError, match="--report-to mlflow needs the mlflow package, which is not installed: pip install mlflow"):
        train(tmp_path, report_to=["mlflow"])
    with pytest.raises(ConfigError, match="--report-to comet: not an installed tracker; installed: tensorboard, wandb"):
        train(tmp_path, report_to=["comet"])
    with pytest.raises(ConfigError, match="--report-to none means no tracker"):
        train(tmp_path, report_to=["none", "wandb"])


def test_trackers_run_only_when_asked(tmp_path):
    from toolkit.tracking import select_callbacks

    def names(report_to):
        return [cls.name for cls in select_callbacks(resolve_recipe({"report_to": report_to}))]

    default = names([])
    assert "jsonl" in default and "progress" in default and not {"wandb", "mlflow", "swanlab"} & set(default)
    assert not {"tensorboard", "wandb", "mlflow", "swanlab"} & set(names(["none"]))
    pytest.importorskip("wandb", reason="wandb is not installed: pip install 'toolkit-core[wandb]'")
    assert "wandb" in names(["wandb"]) and "tensorboard" not in names(["wandb"])
