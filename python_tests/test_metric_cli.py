"""``pullback train`` and ``pullback eval-head`` end to end on a real timm architecture (random
weights, 32 px) and an image folder."""

import json

import numpy as np
import pytest

from pullback_ext.cli import main

MODEL = ["--model", "timm:vit_tiny_patch16_224", "--img-size", "32"]


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(12):
        Image.fromarray(rng.integers(0, 255, (40, 40, 3), dtype=np.uint8)).save(folder / f"img{i:02d}.png")
    return folder


def _train(kind, out, image_dir, *extra):
    argv = ["train", kind, *MODEL, "--layer", "10", "--images", str(image_dir), "--num-images", "8", "--heldout", "4",
            "--steps", "6", "--batch-size", "4", "--hidden", "16", "--heads", "2", "--warmup", "1", "--no-progress", "--out", str(out), *extra]
    return main(argv)


def test_train_head_then_eval_head(tmp_path, image_dir, capsys):
    assert _train("head", tmp_path / "head", image_dir, "--rank", "4", "--power", "1") == 0
    printed = capsys.readouterr().out
    assert "ImportanceHead(dim=192, hidden=16, heads=2, mlp_hidden=0):" in printed and "parameters" in printed
    results = json.loads((tmp_path / "head" / "results.json").read_text())
    assert results["heldout"]["count"] == 4 and -1 <= results["heldout"]["mean"] <= 1
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["probe"] == {"model": "timm:vit_tiny_patch16_224", "layer": 10, "decoder": "cls", "weights": None,
                               "output_size": None, "img_size": 32, "vae": None}
    assert (tmp_path / "head" / "training.png").stat().st_size > 0
    assert len((tmp_path / "head" / "metrics.jsonl").read_text().splitlines()) == 1
    out = tmp_path / "eval.json"
    assert main(["eval-head", "--head", str(tmp_path / "head"), "--images", str(image_dir), "--num-images", "8",
                 "--heldout", "4", "--rank", "4", "--out", str(out)]) == 0
    evaluated = json.loads(out.read_text())
    assert evaluated["per_image"] == pytest.approx(results["heldout"]["per_image"], abs=1e-6)
    assert "Spearman rho vs imp*" in capsys.readouterr().out


def test_train_spn_exact_and_refuses_to_overwrite(tmp_path, image_dir, capsys):
    assert _train("spn", tmp_path / "spn", image_dir, "--rank", "3", "--targets", "exact") == 0
    results = json.loads((tmp_path / "spn" / "results.json").read_text())
    assert results["heldout"]["reference"]["mode"] == "exact" and 0 <= results["heldout"]["mean"] <= 1
    per_image = results["heldout"]["per_image"]
    assert len(per_image) == results["heldout"]["count"] and sum(per_image) / len(per_image) == pytest.approx(results["heldout"]["mean"])
    assert _train("spn", tmp_path / "spn", image_dir, "--rank", "3") == 2
    assert "--resume" in capsys.readouterr().err
    assert _train("spn", tmp_path / "spn", image_dir, "--rank", "3", "--targets", "exact", "--resume", "--steps", "8") == 0
    assert json.loads((tmp_path / "spn" / "config.json").read_text())["step"] == 8
    assert _train("head", tmp_path / "distilled", image_dir, "--rank", "3", "--target", f"spn:{tmp_path / 'spn'}") == 0
    assert json.loads((tmp_path / "distilled" / "config.json").read_text())["target"] == f"spn:{tmp_path / 'spn'}"


def test_train_vae_then_spn_at_its_latent(tmp_path, image_dir):
    assert _train("vae", tmp_path / "vae", image_dir, "--latent-dim", "4") == 0
    vae_results = json.loads((tmp_path / "vae" / "results.json").read_text())
    assert vae_results["heldout"]["relative_reconstruction_error"] > 0
    assert vae_results["diagnosis"]["latent"]["rank"] <= 5 * 4 - 1
    assert 0 <= vae_results["diagnosis"]["features"]["aggregate"]["kappa_cap"]["mean"] <= 1
    assert _train("spn", tmp_path / "spn", image_dir, "--rank", "2", "--vae", str(tmp_path / "vae"), "--on-the-fly") == 0
    config = json.loads((tmp_path / "spn" / "config.json").read_text())
    assert config["model"]["dim"] == 4 and config["probe"]["vae"] == str(tmp_path / "vae")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "head", *MODEL, "--images", "IMAGES", "--out", "OUT"], "--layer: required"),
        (["train", "head", *MODEL, "--layer", "1", "--images", "/nonexistent/images", "--out", "OUT"], "--images"),
        (["train", "head", *MODEL, "--layer", "99", "--images", "IMAGES", "--num-images", "2", "--heldout", "1", "--out", "OUT"], "layer"),
        (["train", "head", *MODEL, "--layer", "1", "--images", "IMAGES", "--num-images", "12", "--heldout", "4", "--out", "OUT"], "at least 16 images"),
        (["train", "head", *MODEL, "--layer", "1", "--images", "IMAGES", "--target", "oracle", "--out", "OUT"], "--target"),
        (["train", "spn", "--layer", "1", "--images", "IMAGES", "--out", "OUT"], "--model: required"),
        (["eval-head", "--head", "/nonexistent/ckpt", "--images", "IMAGES"], "checkpoint file not found"),
    ],
)
def test_bad_arguments_exit_2_with_a_one_line_message(tmp_path, image_dir, capsys, argv, message):
    argv = [str(image_dir) if a == "IMAGES" else str(tmp_path / "out") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_train_head_on_the_demo_model_defaults_to_rendered_scenes(tmp_path):
    argv = ["train", "head", "--model", "demo", "--layer", "1", "--task", "cls", "--num-images", "2", "--heldout", "2",
            "--rank", "2", "--power", "0", "--steps", "1", "--batch-size", "2", "--hidden", "8", "--heads", "2", "--warmup", "0",
            "--no-progress"]
    assert main(argv + ["--out", str(tmp_path / "new")]) == 0
    config = json.loads((tmp_path / "new" / "config.json").read_text())
    assert config["probe"]["model"] == "demo" and config["images"] == {"demo": "render", "seed": 1000, "block": 32, "count": 2}
    with pytest.warns(FutureWarning, match="--demo is deprecated"):
        assert main([a for a in argv if a not in ("--model", "demo")] + ["--demo", "--out", str(tmp_path / "old")]) == 0
    new, old = (json.loads((tmp_path / name / "results.json").read_text()) for name in ("new", "old"))
    assert new["heldout"]["per_image"] == old["heldout"]["per_image"]
    assert main(["eval-head", "--head", str(tmp_path / "new"), "--heldout", "2", "--rank", "2", "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "results.json").read_text())["per_image"] == pytest.approx(new["heldout"]["per_image"], abs=1e-6)
