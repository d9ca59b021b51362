"""Checkpoints of the learned metric models: exact round trip, clear errors, atomic writes."""

import json

import pytest
import torch

from pullback_ext.errors import CheckpointError
from pullback_ext.metric import FeatureVAE, ImportanceHead, SPN, load_model, save_model
from pullback_ext.metric.checkpoint import MODEL_FILE, read_config


@pytest.mark.parametrize(
    "kind, build",
    [
        ("spn", lambda: SPN(12, 3, hidden=16, heads=2, eps=0.01)),
        ("head", lambda: ImportanceHead(12, hidden=16, heads=2)),
        ("head", lambda: ImportanceHead(12, hidden=16, heads=2, mlp_hidden=8)),
        ("vae", lambda: FeatureVAE(12, 4, hidden=8)),
    ],
)
def test_round_trip_is_exact(tmp_path, kind, build):
    torch.manual_seed(0)
    model = build().double()
    probe_def = {"model": "demo", "layer": 3, "decoder": "cls"}
    save_model(tmp_path, kind, model, {"probe": probe_def})
    loaded, config = load_model(tmp_path, kind=kind)
    assert config["probe"] == probe_def and config["kind"] == kind
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    readable = json.loads((tmp_path / "config.json").read_text())
    assert readable["model"] == model.config() and len(readable["weights_sha256"]) == 64
    assert read_config(tmp_path / MODEL_FILE)["probe"] == probe_def
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_missing_and_corrupt_files_raise_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nothing")
    save_model(tmp_path, "head", ImportanceHead(8, hidden=16, heads=2))
    weights = tmp_path / MODEL_FILE
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt"):
        load_model(tmp_path)
    weights.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match=str(weights)):
        load_model(weights)


def test_mismatched_kind_or_shapes_raise_checkpoint_error(tmp_path):
    save_model(tmp_path, "head", ImportanceHead(8, hidden=16, heads=2))
    with pytest.raises(CheckpointError, match="expected a 'spn' checkpoint, got a 'head'"):
        load_model(tmp_path, kind="spn")
    from safetensors.torch import load_file, save_file
    from safetensors import safe_open

    weights = tmp_path / MODEL_FILE
    with safe_open(str(weights), "pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(weights))
    tensors["score.weight"] = torch.zeros(1, 32)
    save_file(tensors, str(weights), metadata=metadata)
    with pytest.raises(CheckpointError, match=r"score.weight: expected \(1, 16\), got \(1, 32\)"):
        load_model(tmp_path)
    save_file({"x": torch.zeros(1)}, str(weights))
    with pytest.raises(CheckpointError, match="not a pullback_ext metric checkpoint"):
        load_model(tmp_path)


def test_failed_write_leaves_previous_checkpoint_intact(tmp_path, monkeypatch):
    head = ImportanceHead(8, hidden=16, heads=2)
    save_model(tmp_path, "head", head)
    before = (tmp_path / MODEL_FILE).read_bytes()
    import safetensors.torch

    def broken(tensors, filename, metadata=None):
        with open(filename, "wb") as fh:
            fh.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with torch.no_grad():
        head.score.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        save_model(tmp_path, "head", head)
    assert (tmp_path / MODEL_FILE).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
