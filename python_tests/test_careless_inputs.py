"""Careless inputs a new user gives the command line: each is exit code 2 and exactly one stderr
line that names the flag or the file at fault, never a traceback; what the command changes on its
own (a tiny image upscaled) is said in a warning."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pullback_ext.cli import main


def _fail(argv, capsys, *names):
    """Run ``argv``: exit 2, one stderr line naming each of ``names``; returns that line."""
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for name in names:
        assert str(name) in err, f"{name!r} not named in: {err}"
    return err


@pytest.fixture
def timm_args(timm_weights):
    name, weights = timm_weights
    return ["--model", f"timm:{name}", "--weights", weights, "--img-size", "32", "--layer", "10", "--task", "cls",
            "--rank", "2", "--probes", "4", "--slq-steps", "0"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random DINOv2 saved as a transformers folder (config.json + weights)."""
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("hf") / "dinov2"
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          image_size=32, patch_size=8)
    Dinov2Model(config).save_pretrained(folder)
    return folder


def _copy_hf(hf_dir, tmp_path, edit):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(hf_dir, folder)
    edit(folder)
    return folder


def _diagnose_hf(folder, images, out):
    return ["diagnose", "--model", f"hf:{folder}", "--layer", "0", "--task", "cls", "--images", images,
            "--num-images", "1", "--rank", "2", "--probes", "4", "--slq-steps", "0", "--out", out]


def test_hf_config_that_is_not_json(hf_dir, tmp_path, image_folder, capsys):
    folder = _copy_hf(hf_dir, tmp_path, lambda f: (f / "config.json").write_text('{"model_type": "dinov2",'))
    _fail(_diagnose_hf(folder, image_folder(), tmp_path / "out"), capsys, "config.json")


def test_hf_config_with_a_wrong_typed_field(hf_dir, tmp_path, image_folder, capsys):
    def edit(f):
        config = json.loads((f / "config.json").read_text())
        (f / "config.json").write_text(json.dumps(dict(config, hidden_size="thirty-two")))

    folder = _copy_hf(hf_dir, tmp_path, edit)
    _fail(_diagnose_hf(folder, image_folder(), tmp_path / "out"), capsys, "config.json")


def test_bad_preprocessor_config_is_blamed_on_that_file(hf_dir, tmp_path, image_folder, capsys):
    folder = _copy_hf(hf_dir, tmp_path, lambda f: (f / "preprocessor_config.json").write_text("{not json"))
    err = _fail(_diagnose_hf(folder, image_folder(), tmp_path / "out"), capsys, "preprocessor_config.json")
    assert "img0" not in err


def test_evaluate_out_naming_an_existing_file(tmp_path, capsys):
    existing = tmp_path / "results.json"
    existing.write_text("{}")
    _fail(["evaluate", "--model", "demo", "--num-images", "2", "--seeds", "1", "--out", existing], capsys, "--out", existing)
    assert existing.read_text() == "{}"


def test_rank_larger_than_the_output_space_is_capped_with_a_warning_and_recorded(timm_args, image_folder, out_dir):
    """ψ = the CLS embedding of a 192-wide ViT: M = 192, so --rank 500 is capped at 192."""
    args = list(map(str, timm_args))
    args[args.index("--rank") + 1] = "500"
    with pytest.warns(UserWarning, match="rank"):
        assert main(["diagnose", *args, "--images", str(image_folder(2)), "--num-images", "1", "--out", str(out_dir)]) == 0
    settings = json.loads((out_dir / "diagnosis.json").read_text())["settings"]
    assert settings["rank"] == 192 and settings["rank_requested"] == 500


@pytest.mark.parametrize("num_images", ["0", "-3"])
def test_num_images_below_one(timm_args, image_folder, out_dir, capsys, num_images):
    _fail(["diagnose", *timm_args, "--images", image_folder(), "--num-images", num_images, "--out", out_dir], capsys, "--num-images")


def test_missing_images_folder(timm_args, tmp_path, out_dir, capsys):
    _fail(["diagnose", *timm_args, "--images", tmp_path / "nowhere", "--out", out_dir], capsys, "nowhere")
    assert not out_dir.exists()


def test_empty_images_folder(timm_args, tmp_path, out_dir, capsys):
    (tmp_path / "empty").mkdir()
    _fail(["diagnose", *timm_args, "--images", tmp_path / "empty", "--out", out_dir], capsys, "empty")
    assert not out_dir.exists()


def test_a_non_image_file_in_the_folder(timm_args, tmp_path, out_dir, capsys):
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(folder / "a.png")
    (folder / "b.png").write_text("not an image")
    _fail(["diagnose", *timm_args, "--images", folder, "--num-images", "2", "--out", out_dir], capsys, "b.png")


def _head_checkpoint(tmp_path):
    from pullback_ext.metric.checkpoint import save_model
    from pullback_ext.metric.head import ImportanceHead

    probe = {"model": "demo", "layer": 1, "decoder": "embedding", "weights": None, "output_size": None, "img_size": None, "vae": None}
    return save_model(tmp_path / "head", "head", ImportanceHead(192, hidden=8, heads=2), {"probe": probe})


def test_corrupt_checkpoint(tmp_path, capsys):
    head = _head_checkpoint(tmp_path)
    (head / "model.safetensors").write_bytes(b"\x00" * 64)
    _fail(["eval-head", "--head", head, "--heldout", "1", "--out", tmp_path / "eval"], capsys, "model.safetensors")


def test_checkpoint_config_that_disagrees_with_its_weights(tmp_path, capsys):
    head = _head_checkpoint(tmp_path)
    config = json.loads((head / "config.json").read_text())
    config["probe"]["layer"] = 5
    (head / "config.json").write_text(json.dumps(config))
    _fail(["eval-head", "--head", head, "--heldout", "1", "--out", tmp_path / "eval"], capsys, "config.json", "layer")


def test_a_tiny_image_is_upscaled_with_a_warning(timm_args, tmp_path, out_dir):
    from PIL import Image

    folder = tmp_path / "tiny"
    folder.mkdir()
    Image.fromarray(np.full((7, 7, 3), 128, np.uint8)).save(folder / "dot.png")
    with pytest.warns(UserWarning, match=r"dot\.png.*7.7"):
        assert main(["diagnose", *map(str, timm_args), "--images", str(folder), "--num-images", "1", "--out", str(out_dir)]) == 0


def test_diagnose_refuses_to_replace_an_earlier_diagnosis_unless_overwrite(timm_args, image_folder, out_dir, capsys):
    argv = ["diagnose", *map(str, timm_args), "--images", str(image_folder(2)), "--num-images", "1", "--out", str(out_dir)]
    assert main(argv) == 0
    first = (out_dir / "diagnosis.json").read_text()
    (out_dir / "diagnosis.json").write_text(first.replace('"rank"', '"rank_marker"', 1))  # tell the two runs apart
    capsys.readouterr()
    err = _fail(argv, capsys, "--out", out_dir, "already holds a diagnosis", "--overwrite")
    assert "--out" in err and '"rank_marker"' in (out_dir / "diagnosis.json").read_text()
    assert main([*argv, "--overwrite"]) == 0
    assert (out_dir / "diagnosis.json").read_text() == first


def test_hf_folder_without_weights_is_refused_unless_random_weights(hf_dir, tmp_path, image_folder, capsys):
    """A config.json without weights (an unfinished download): one line; --random-weights opts in,
    is recorded in the JSON and printed in the summary."""
    def drop_weights(f):
        for weights in (f / "model.safetensors", f / "pytorch_model.bin"):
            weights.unlink(missing_ok=True)

    folder = _copy_hf(hf_dir, tmp_path, drop_weights)
    out = tmp_path / "out"
    _fail(_diagnose_hf(folder, image_folder(), out), capsys, f"hf:{folder}", "no weights", "--weights", "--random-weights")
    assert not out.exists()
    assert main([*map(str, _diagnose_hf(folder, image_folder(), out)), "--random-weights"]) == 0
    printed = capsys.readouterr().out
    assert "RANDOM WEIGHTS" in printed
    settings = json.loads((out / "diagnosis.json").read_text())["settings"]
    assert settings["random_weights"] is True and settings["weights"] is None


def test_the_summary_names_the_task_and_explains_r90(out_dir, capsys):
    """--task cls on the demo model is printed as cls (not the probe's decoder name), and an r90 of
    n/a says that κ_cap did not reach 0.9 within r."""
    argv = ["diagnose", "--model", "demo", "--layer", "2", "--task", "cls", "--num-images", "1", "--rank", "1", "--power", "1", "--probes", "4", "--slq-steps", "0", "--out", str(out_dir)]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header, row = lines[0].split(), lines[1].split()
    assert header[2] == "task" and row[2] == "cls", lines[:2]
    data = json.loads((out_dir / "diagnosis.json").read_text())
    kappa_at_1 = data["images"][0]["kappa_cap"]
    assert kappa_at_1 < 0.9, "the check needs an image whose one direction captures less than 0.9"
    assert "r90" not in data["aggregate"]
    assert any(line.startswith("r90 n/a: κ_cap stays below 0.9 within the r = 1 directions") for line in lines), lines


@pytest.mark.parametrize("argv,names", [
    (["evaluate", "--task", "panoptic"], ["--task", "panoptic", "cls", "segmentation"]),
    (["evaluate", "--model", "demo", "--threads", "0"], ["--threads", "positive"]),
    (["diagnose", "--rank", "many"], ["--rank", "many"]),
    (["train", "tap", "--steps"], ["--steps"]),
    (["evaluate", "--out", "out", "--no-such-option"], ["--no-such-option"]),
    (["no-such-command"], ["no-such-command"]),
])
def test_an_argument_error_is_one_line_and_exit_2(argv, names, capsys):
    err = _fail(argv, capsys, *names)
    assert "usage:" not in err and err.endswith("--help"), err


def test_a_timed_run_on_a_busy_machine_warns_in_one_line(monkeypatch, tmp_path, capsys):
    import os

    from pullback_ext.machine import busy_note, usable_cores

    monkeypatch.setattr(os, "getloadavg", lambda: (usable_cores() + 1.5, 0.0, 0.0))
    note = busy_note("wall-clock times")
    assert note is not None and f"{usable_cores() + 1.5:.1f} on {usable_cores()} cores" in note
    assert busy_note("wall-clock times", cores=usable_cores() + 2) is None
    # an argument error stays one line: the warning comes once the options are checked
    _fail(["evaluate", "--model", "demo", "--seeds", "0", "--out", str(tmp_path / "out")], capsys, "--seeds")
    # evaluate --pareto warns when its run starts (interrupted here as it starts measuring)
    from pullback_ext.comparison import pareto

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pareto, "image_errors", interrupted)
    argv = ["evaluate", "--model", "demo", "--pareto", "--methods", "random", "--num-images", "2", "--seeds", "1",
            "--out", str(tmp_path / "out")]
    assert main(argv) == 130
    warning, stopped = capsys.readouterr().err.strip().splitlines()
    assert warning == f"pullback evaluate: warning: {note}" and "interrupted" in stopped
    assert main([*argv, "--no-timing"]) == 130
    assert "warning" not in capsys.readouterr().err  # untimed: no warning
