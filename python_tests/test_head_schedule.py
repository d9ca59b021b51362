"""Head schedules: ``pullback train head --stages`` trains one importance head per stage into one
folder, ``pullback evaluate --head DIR`` (and ``--pareto``) runs at the schedule's layers, and
``pullback_ext.metric.load_schedule`` gives the heads and layers to the patch API."""

import json

import pytest
import torch

from pullback_ext.cli import main
from pullback_ext.errors import CheckpointError, PullbackError

TRAIN = ["train", "head", "--model", "demo", "--task", "cls", "--num-images", "2", "--heldout", "2", "--rank", "2",
         "--power", "0", "--steps", "1", "--batch-size", "2", "--hidden", "8", "--heads", "2", "--warmup", "0", "--no-progress"]
EVALUATE = ["evaluate", "--model", "demo", "--strategies", "importance", "--ratios", "0.1", "--num-images", "2", "--seeds", "1",
            "--no-timing", "--quiet"]


def _handmade_schedule(folder, stages=(2, 4), probe_layers=None):
    """A schedule folder of random demo-width heads, each saved with the probe layer it claims."""
    from pullback_ext.metric.checkpoint import save_model
    from pullback_ext.metric.head import ImportanceHead
    from pullback_ext.metric.schedule import stage_folder, write_schedule

    torch.manual_seed(0)
    for stage, layer in zip(stages, probe_layers or [s - 1 for s in stages]):
        save_model(folder / stage_folder(stage), "head", ImportanceHead(192, hidden=8, heads=2), {"probe": {"model": "demo", "layer": layer}})
    write_schedule(folder, stages, {"model": "demo"})
    return folder


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """``(folder, printed output)`` of a 2-stage schedule trained on the demo model."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("schedule") / "heads"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(TRAIN + ["--stages", "2,4", "--out", str(out)]) == 0
    return out, printed.getvalue()


def test_trains_one_head_per_stage_on_the_block_before_it(trained):
    out, printed = trained
    assert sorted(p.name for p in out.iterdir()) == ["schedule.json", "stage-2", "stage-4"]
    for stage in (2, 4):
        config = json.loads((out / f"stage-{stage}" / "config.json").read_text())
        assert config["kind"] == "head" and config["step"] == 1
        assert config["probe"]["layer"] == stage - 1 and config["probe"]["decoder"] == "embedding"
        assert json.loads((out / f"stage-{stage}" / "results.json").read_text())["heldout"]["count"] == 2
    schedule = json.loads((out / "schedule.json").read_text())
    assert schedule["stages"] == [2, 4] and schedule["heads"] == ["stage-2", "stage-4"] and schedule["probe_layers"] == [1, 3]
    assert schedule["model"] == "demo" and schedule["decoder"] == "embedding"
    assert "stage 1/2 (layer 2): head on the output of block 1" in printed and "stage 2/2 (layer 4)" in printed
    assert printed.index("stage-2/results.json") < printed.index("stage 2/2") < printed.rindex("schedule.json")


def test_evaluate_runs_the_trained_schedule_at_its_layers(trained, tmp_path, capsys):
    out, _ = trained
    assert main(EVALUATE + ["--head", str(out), "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "results.json").read_text())["layers"] == [2, 4]
    assert "warning" not in capsys.readouterr().err


def test_resume_skips_finished_stages_and_continues_the_rest(trained, capsys):
    out, _ = trained
    assert main(TRAIN + ["--stages", "2,4", "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
    (out / "schedule.json").unlink()
    (out / "stage-4" / "results.json").unlink()  # as if killed after the last checkpoint of stage 2
    assert main(TRAIN + ["--stages", "2,4", "--out", str(out), "--resume"]) == 0
    printed = capsys.readouterr().out
    assert "stage 1/2 (layer 2): finished" in printed and "skipped" in printed
    assert "stage 2/2 (layer 4): head on the output of block 3" in printed
    assert (out / "stage-4" / "results.json").is_file() and json.loads((out / "schedule.json").read_text())["stages"] == [2, 4]


def test_evaluate_and_pareto_take_a_schedule_folder(tmp_path, capsys):
    heads = _handmade_schedule(tmp_path / "heads")
    assert main(EVALUATE + ["--head", str(heads), "--layers", "2,4", "--out", str(tmp_path / "e")]) == 0
    assert json.loads((tmp_path / "e" / "results.json").read_text())["layers"] == [2, 4]
    assert main(["evaluate", "--model", "demo", "--pareto", "--methods", "importance", "--head", str(heads), "--ratios", "0.1",
                 "--num-images", "2", "--seeds", "1", "--no-timing", "--quiet", "--out", str(tmp_path / "p")]) == 0
    pareto = json.loads((tmp_path / "p" / "pareto.json").read_text())
    assert pareto["layers"] == [2, 4] and "warning" not in capsys.readouterr().err


@pytest.mark.parametrize("stages, shown", [(["--layers", "2,5"], "[2, 5]"), (["--stages", "2,4"], "[1, 2]")],
                         ids=["absolute", "scaled"])
def test_evaluate_refuses_stages_that_do_not_match_the_schedule(tmp_path, capsys, stages, shown):
    heads = _handmade_schedule(tmp_path / "heads")
    for pareto in ([], ["--pareto"]):
        assert main(EVALUATE + pareto + ["--head", str(heads), *stages, "--out", str(tmp_path / "e")]) == 2
        err = capsys.readouterr().err.strip()
        assert stages[0] in err and shown in err and "[2, 4]" in err and len(err.splitlines()) == 1


def test_a_schedule_folder_must_be_the_only_head(tmp_path):
    from pullback_ext.commands.evaluate_plan import schedule_folder, stage_layers

    heads = _handmade_schedule(tmp_path / "heads")
    assert schedule_folder(str(heads)) == str(heads) and schedule_folder(str(heads / "stage-2")) is None
    assert stage_layers(None, 8, head=str(heads)) == (2, 4) and stage_layers(None, 8) == (2,)  # default 4, scaled
    with pytest.raises(PullbackError, match="must be the only --head"):
        stage_layers(None, 8, head=f"{heads},{heads / 'stage-2'}")


def test_load_schedule_gives_the_patch_api_its_heads_and_layers(tmp_path, random_demo_model):
    import pullback_ext.patch as patch
    from pullback_ext.metric import load_schedule

    heads, layers = load_schedule(_handmade_schedule(tmp_path / "heads"))
    assert layers == (2, 4) and len(heads) == 2 and not any(p.requires_grad for h in heads for p in h.parameters())
    backbone = random_demo_model().backbone
    x = torch.rand(1, 3, 112, 112)
    full = backbone.forward_features(x)
    patch.timm(backbone, ratio=0.0, layers=layers, head=heads)
    assert torch.allclose(backbone.forward_features(x), full, atol=1e-5)
    patch.timm(backbone, ratio=0.3, layers=layers, head=heads)
    assert patch.config(backbone).layers == (2, 4) and torch.isfinite(backbone.forward_features(x)).all()
    patch.unpatch(backbone)


@pytest.mark.parametrize(
    "break_it, match",
    [
        (lambda d: (d / "schedule.json").write_text("{not json"), "unreadable schedule"),
        (lambda d: (d / "schedule.json").write_text('{"format": "other"}'), "not a head schedule"),
        (lambda d: (d / "schedule.json").write_text(json.dumps({"format": "pullback_ext.head_schedule/1", "stages": [2, 4],
                                                                 "heads": ["stage-2"]})), "same non-zero length"),
        (lambda d: (d / "schedule.json").unlink(), "no schedule.json"),
        (lambda d: (d / "stage-4" / "model.safetensors").unlink(), "checkpoint file not found"),
    ],
    ids=["not-json", "other-format", "lengths", "no-schedule", "missing-head"],
)
def test_load_schedule_names_what_is_wrong(tmp_path, break_it, match):
    from pullback_ext.metric import load_schedule

    folder = _handmade_schedule(tmp_path / "heads")
    break_it(folder)
    with pytest.raises(CheckpointError, match=match):
        load_schedule(folder)


def test_load_schedule_refuses_a_head_trained_at_another_layer(tmp_path):
    from pullback_ext.metric import load_schedule

    with pytest.raises(CheckpointError, match="stage at layer 4 must be trained on the output of block 3, but its probe layer is 4"):
        load_schedule(_handmade_schedule(tmp_path / "heads", probe_layers=[1, 4]))


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--stages", "0,2"], "--stages: expected layers in [1, 7]"),
        (["--stages", "4,2"], "--stages: expected strictly increasing layers, got [4, 2]"),
        (["--stages", "2,2"], "--stages: expected strictly increasing"),
        (["--stages", "2,8"], "--stages: expected layers in [1, 7]"),
        (["--stages", "2,x"], "--stages must be comma-separated numbers"),
        (["--stages", "2,4.5"], "--stages: expected block indices (ints)"),
        (["--stages", "2,4", "--layer", "1"], "--stages: give either --layer (one head) or --stages"),
        (["--stages", "2,4", "--vae", "runs/vae"], "--stages: not with --vae"),
    ],
    ids=["zero", "decreasing", "repeated", "beyond-depth", "not-numbers", "not-ints", "with-layer", "with-vae"],
)
def test_bad_stages_are_refused_with_the_flag_named(tmp_path, capsys, extra, message):
    assert main(TRAIN + extra + ["--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_stages_only_train_heads(tmp_path, capsys):
    argv = ["train", "spn", "--model", "demo", "--stages", "2,4", "--out", str(tmp_path / "out")]
    assert main(argv) == 2
    assert "--stages: only for `pullback train head`" in capsys.readouterr().err
