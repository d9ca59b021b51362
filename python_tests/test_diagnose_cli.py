"""`pullback diagnose` end to end: timm / hf / demo / linear decoders, bad input, torchrun with 2 processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pullback_ext.cli import main

from helpers.diagnose import tiny_dpt

REPO = Path(__file__).resolve().parents[1]
FAST = ["--rank", "3", "--power", "1", "--probes", "6", "--slq-steps", "4"]


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory):
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    for i in range(3):
        pixels = (np.random.RandomState(i).rand(40, 48, 3) * 255).astype("uint8")
        Image.fromarray(pixels).save(folder / f"img{i}.png")
    return folder


@pytest.fixture(scope="module")
def timm_weights(tmp_path_factory):
    import timm
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32)
    path = tmp_path_factory.mktemp("weights") / "vit_tiny.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


def timm_args(image_dir, weights, out, *extra):
    return ["diagnose", "--model", "timm:vit_tiny_patch16_224", "--img-size", "32", "--weights", str(weights),
            "--layer", "9", "--images", str(image_dir), "--out", str(out), *FAST, *extra]


def test_timm_cli_writes_json_and_plots_matching_the_library(image_dir, timm_weights, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(timm_args(image_dir, timm_weights, out, "--dtype", "float64")) == 0
    printed = capsys.readouterr().out
    assert "κ_cap(r)" in printed and "regime" in printed
    data = json.loads((out / "diagnosis.json").read_text())
    assert (out / "spectrum.png").stat().st_size > 0 and (out / "token_energy.png").stat().st_size > 0
    assert len(data["images"]) == 3 and data["settings"]["files"] == ["img0.png", "img1.png", "img2.png"]
    settings = data["settings"]
    assert (settings["rank"], settings["rank_requested"], settings["chunk_size"], settings["trace"]) == (3, 3, 32, "auto")

    import timm
    from safetensors.torch import load_file

    from pullback_ext import diagnose
    from pullback_ext.sources.image_files import list_images, load_images
    from pullback_ext.sources.preprocess import timm_preprocess
    from pullback_ext.probes import from_timm

    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32)
    model.load_state_dict(load_file(str(timm_weights)))
    model = model.double().eval()
    probe = from_timm(model, 9, "cls")
    images = load_images(list_images(image_dir), timm_preprocess(model), torch.float64)
    expected = diagnose(probe, probe.features(images), rank=3, power=1, probes=6, slq_steps=4)
    for got, want in zip(data["images"], expected.images):
        assert got["kappa_cap"] == pytest.approx(want.kappa_cap, rel=1e-9)
        assert got["sigma"] == pytest.approx(want.sigma.tolist(), rel=1e-9)
    assert data["aggregate"]["cv"]["mean"] == pytest.approx(expected.aggregate["cv"]["mean"], rel=1e-9)


def test_linear_decoder(image_dir, timm_weights, tmp_path):
    from safetensors.torch import save_file

    W = torch.randn(2, 192)
    save_file({"weight": W}, str(tmp_path / "probe.safetensors"))
    out = tmp_path / "out"
    linear = f"linear:{tmp_path / 'probe.safetensors'}"
    assert main(timm_args(image_dir, timm_weights, out, "--task", linear, "--dtype", "float64")) == 0
    first = json.loads((out / "diagnosis.json").read_text())["images"][0]
    s = torch.linalg.svdvals(W.double())
    # J = I_5 ⊗ W has rank 10 <= r + oversample: the sketch captures its range exactly
    assert first["M"] == 5 * 2 and first["sigma"] == pytest.approx([float(s[0])] * 3, rel=1e-8)
    assert first["trace"] == pytest.approx(5 * float((s**2).sum()), rel=1e-10)
    capped = tmp_path / "capped"
    with pytest.warns(UserWarning, match="rank"):
        assert main(timm_args(image_dir, timm_weights, capped, "--task", linear, "--rank", "12")) == 0
    data = json.loads((capped / "diagnosis.json").read_text())
    # --rank 12 on M = 10 outputs: the diagnosis used r = 10 and says so
    assert (data["settings"]["rank"], data["settings"]["rank_requested"]) == (10, 12)
    assert data["images"][0]["rank"] == 10 and data["regime"] == "iv"


def test_hf_dpt_cli(image_dir, tmp_path):
    folder = tmp_path / "dpt"
    tiny_dpt(dtype=torch.float32).save_pretrained(folder)
    out = tmp_path / "out"
    args = ["diagnose", "--model", f"hf:{folder}", "--layer", "1", "--task", "depth", "--output-size", "4",
            "--images", str(image_dir), "--num-images", "2", "--out", str(out), *FAST]
    assert main(args) == 0
    data = json.loads((out / "diagnosis.json").read_text())
    assert len(data["images"]) == 2 and data["images"][0]["M"] == 16 and data["images"][0]["N"] == 17
    multi = ["diagnose", "--model", f"hf:{folder}", "--task", "depth-multi", "--output-size", "4",
             "--images", str(image_dir), "--num-images", "1", "--out", str(tmp_path / "multi"), *FAST]
    assert main(multi) == 0
    first = json.loads((tmp_path / "multi" / "diagnosis.json").read_text())["images"][0]
    assert first["D"] == 4 * 32 and first["M"] == 16


def test_demo_cli(image_dir, tmp_path):
    from pullback_ext.embedded.model import DemoModel
    from pullback_ext.embedded.weights_io import save_weights

    torch.manual_seed(0)
    save_weights(DemoModel(), tmp_path / "demo.safetensors")
    out = tmp_path / "out"
    args = ["diagnose", "--model", "demo", "--weights", str(tmp_path / "demo.safetensors"), "--layer", "2",
            "--task", "depth", "--output-size", "8", "--images", str(image_dir), "--num-images", "1", "--out", str(out), *FAST]
    assert main(args) == 0
    first = json.loads((out / "diagnosis.json").read_text())["images"][0]
    assert first["N"] == 197 and first["M"] == 64


def test_demo_model_defaults_to_builtin_scenes(tmp_path):
    out = tmp_path / "out"
    args = ["diagnose", "--model", "demo", "--layer", "2", "--task", "depth", "--output-size", "4", "--num-images", "2",
            "--out", str(out), *FAST]
    assert main(args) == 0
    data = json.loads((out / "diagnosis.json").read_text())
    assert data["settings"]["images"] == "builtin:scenes" and data["settings"]["model"] == "demo"
    assert data["settings"]["files"] == ["heldout-scene-0-0", "heldout-scene-0-1"] and data["images"][0]["M"] == 16


def bad_cases(image_dir, weights, tmp):
    empty = tmp / "empty"
    empty.mkdir()
    broken = tmp / "broken"
    broken.mkdir()
    (broken / "x.png").write_text("not an image")
    garbage = tmp / "garbage.safetensors"
    garbage.write_bytes(b"\x00" * 20)
    other = tmp / "other.pt"
    torch.save({"weight": torch.zeros(3, 3)}, other)
    base = timm_args(image_dir, weights, tmp / "out")
    swap = lambda flag, value: [value if prev == flag else a for prev, a in zip([None] + base, base)]  # noqa: E731
    return {
        "layer": (swap("--layer", "12"), "layer"),
        "rank": (swap("--rank", str(5 * 192)), "rank"),
        "empty": (swap("--images", str(empty)), "--images"),
        "missing": (swap("--images", str(tmp / "nope")), "--images"),
        "unreadable": (swap("--images", str(broken)), "x.png"),
        "garbage_weights": (swap("--weights", str(garbage)), "--weights"),
        "wrong_weights": (swap("--weights", str(other)), "does not fit"),
        "missing_weights": (swap("--weights", str(tmp / "none.pt")), "--weights"),
        "decoder": (swap("--task", "panoptic") if "--task" in base else base + ["--task", "panoptic"], "--task"),
        "model": (swap("--model", "resnet:50"), "--model"),
        "probes": (swap("--probes", "1"), "probes: expected an int >= 2"),
        "chunk_size": (base + ["--chunk-size", "0"], "chunk_size: expected a positive int"),
        "kappa": (base + ["--kappa-threshold", "2"], "thresholds.kappa"),
    }


@pytest.mark.parametrize("case", ["layer", "rank", "empty", "missing", "unreadable", "garbage_weights", "wrong_weights", "missing_weights", "decoder", "model",
                                  "probes", "chunk_size", "kappa"])
def test_bad_input_one_line_error(image_dir, timm_weights, tmp_path, capsys, case):
    args, needle = bad_cases(image_dir, timm_weights, tmp_path)[case]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pullback diagnose: error:") and needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out" / "diagnosis.json").exists()


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_torchrun_two_processes_equals_single_process(image_dir, timm_weights, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    common = timm_args(image_dir, timm_weights, single, "--dtype", "float64", "--batch-size", "1")
    assert main(common) == 0
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "pullback_ext",
           *[str(multi) if a == str(single) else a for a in common]]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a = json.loads((single / "diagnosis.json").read_text())
    b = json.loads((multi / "diagnosis.json").read_text())
    assert b["settings"]["world_size"] == 2
    assert [d["index"] for d in b["images"]] == [0, 1, 2]
    for name, stats in a["aggregate"].items():
        assert b["aggregate"][name]["mean"] == pytest.approx(stats["mean"], rel=1e-9)
        assert b["aggregate"][name]["std"] == pytest.approx(stats["std"], rel=1e-6, abs=1e-12)
    assert b["regime"] == a["regime"]
