"""``pullback demo``: stage handling and the quick run end to end."""

import json
import math
from types import SimpleNamespace

import pytest
import torch

from pullback_ext.cli import main
from pullback_ext.demo import pipeline
from pullback_ext.demo.stages import StageResult, TrainedHead


def _walk_numbers(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _walk_numbers(v)
    elif isinstance(value, list):
        for v in value:
            yield from _walk_numbers(v)
    elif isinstance(value, float):
        yield value


def _stage(name, run):
    return SimpleNamespace(NAME=name, run_demo_stage=run, PLAN={True: "a stage", False: "a stage"}, EXPECTED_S={True: 1, False: 1})


def test_the_stages_are_the_demo_modules_in_order():
    from pullback_ext.demo import diagnostic_stage, importance_stage, pruning_stage

    assert pipeline.STAGES == (diagnostic_stage, importance_stage, pruning_stage)
    assert [stage.NAME for stage in pipeline.STAGES] == ["diagnostic", "importance_head", "pruning"]


def test_heads_pass_from_stage_to_stage_as_values(tmp_path, monkeypatch):
    head = torch.nn.Identity()
    seen = []

    def trains(inputs):
        assert inputs.heads == () and inputs.scenes["images"].shape[0] == 4 and inputs.images.spec == "builtin:scenes"
        return StageResult({"trained": True}, heads=(TrainedHead("cls", head, 2),))

    def uses(inputs):
        seen.append(inputs.heads)
        return StageResult({"used": [h.layer for h in inputs.heads]})

    monkeypatch.setattr(pipeline, "STAGES", (_stage("first", trains), _stage("second", uses)))
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    assert seen == [(TrainedHead("cls", head, 2),)]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["stages"]["first"]["result"] == {"trained": True}
    assert results["stages"]["second"]["result"] == {"used": [2]} and results["stages"]["second"]["status"] == "ok"
    assert results["scenes"] == {"source": "builtin:scenes", "seed": 0, "num_images": 4}
    assert 0 <= results["model"]["this_run"]["top1"] <= 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json"]  # nothing read or left through the folder


def test_failing_stage_is_recorded_and_exit_code_is_1(tmp_path, monkeypatch):
    def run_demo_stage(inputs):
        raise RuntimeError("boom")

    monkeypatch.setattr(pipeline, "STAGES", (_stage("bad", run_demo_stage), _stage("after", run_demo_stage)))
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 1
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["stages"]["bad"]["status"] == "failed" and "boom" in results["stages"]["bad"]["error"]
    assert results["stages"]["after"]["status"] == "failed"  # later stages still run


def test_the_segmentation_decoder_is_left_out_for_other_weights_and_said(capsys):
    """The shipped segmentation head decodes the shipped weights; for other ``--weights`` the demo
    runs without that decoder and says why; with the shipped weights a mismatch is an error."""
    from pullback_ext import embedded
    from pullback_ext.embedded.model import DemoModel
    from pullback_ext.errors import CheckpointError

    assert pipeline.segmentation_head(embedded.load(), None) is not None
    torch.manual_seed(0)
    other = DemoModel().eval()
    assert pipeline.segmentation_head(other, "other.safetensors") is None
    assert "the segmentation decoder is left out: weights: " in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="was trained for demo weights"):
        pipeline.segmentation_head(other, None)


def test_jsonable_handles_tensors_and_non_finite_values():
    out = pipeline.jsonable({"a": torch.tensor([1.0, float("nan")]), 3: (float("inf"), torch.tensor(2))})
    assert out == {"a": [1.0, None], "3": [None, 2]}


def test_out_must_be_a_folder(tmp_path, capsys):
    target = tmp_path / "file"
    target.write_text("x")
    assert main(["demo", "--quick", "--out", str(target)]) == 2
    assert "--out" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_quick_demo_end_to_end(tmp_path, capsys):
    from PIL import Image

    from pullback_ext.comparison.tasks import TASKS
    from pullback_ext.demo.diagnostic_stage import PROBE_LAYERS

    code = main(["demo", "--quick", "--out", str(tmp_path), "--results-page", str(tmp_path / "page" / "demo-run"), "--allow-dirty"])
    printed = capsys.readouterr()
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0, results["stages"]
    assert all(math.isfinite(x) for x in _walk_numbers(results))
    diagnostic = results["stages"]["diagnostic"]
    assert diagnostic["status"] == "ok"
    rows = diagnostic["result"]["table"]
    assert {(r["decoder"], r["layer"]) for r in rows} == {(d, l) for d in ("embedding", "depth") for l in PROBE_LAYERS}
    for row in rows:
        assert 0 <= row["kappa_cap"] <= 1 + 1e-6 and row["cv"] >= 0
        assert row["regime"] in {"i", "ii", "iii", "iv", "v"}
        assert 1 <= row["r_eff_trunc"] <= 20
    for name in diagnostic["result"]["plots"]:
        assert (tmp_path / name).stat().st_size > 1000
    for stage in results["stages"].values():
        assert stage["status"] == "ok"
    assert results["stages"]["pruning"]["result"]["heads"] == {"cls": 2, "depth": 2}  # the importance stage's heads, by value
    assert all(stage["cpu_seconds"] > 0 for stage in results["stages"].values())
    assert printed.out.startswith("\n".join(pipeline.plan_lines(True)))
    assert all(f"[{stage.NAME}] done in " in printed.out for stage in pipeline.STAGES)
    pruning = results["stages"]["pruning"]["result"]
    assert [task for task in TASKS if task in pruning] == list(TASKS)  # every decoder of the task table
    assert 0 < results["model"]["this_run"]["miou"] <= results["model"]["this_run"]["pixel_accuracy"] <= 1
    for task in TASKS:
        headline = pruning[task]["headline"]
        assert headline["metric"] == TASKS[task].primary
        assert {row["method"] for row in headline["rows"]} >= {"tome", "importance_tome"}
        assert "Measured winner: " in (tmp_path / "pruning" / task / "table.md").read_text()
        figure = headline["figure"]  # ToMe and ours at matched cost, drawn on a held-out scene
        assert figure["file"] == f"pruning/{task}/merges.png" and (tmp_path / figure["file"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(tmp_path / figure["file"]) as picture:
            picture.verify()
        top = max(row["knob"]["tome_r"] for row in headline["rows"])
        assert [row["row"] for row in figure["rows"]] == [row["row"] for row in headline["rows"] if row["knob"]["tome_r"] == top]
    assert [row["row"] for row in pruning["segmentation"]["headline"]["rows"]] == ["tome", "importance_tome (no head)"]
    summary = printed.out[printed.out.index("\nSummary\n"):]
    assert "CLS embedding: κ_cap" in summary and "DPT depth: κ_cap" in summary
    for task in TASKS:
        assert f"recommended for {TASKS[task].label} (measured winner): " in summary
        assert f"what each merged on held-out scene 0: pruning/{task}/merges.png" in summary
    assert f"Files in {tmp_path}" in summary
    tables = [block for block in printed.out.split("\n\n") if block.startswith("| strategy |")]
    assert len(tables) == len(set(tables)), "a quality table is printed twice"
    assert all(len(line) < 200 for line in printed.err.splitlines()) and "\r" not in printed.err  # plain progress lines
    # the run as a stamped page: its JSON is the run's results, the page what the run printed
    page, published = (tmp_path / "page" / "demo-run.md").read_text(), json.loads((tmp_path / "page" / "demo-run.json").read_text())
    assert published["stages"] == results["stages"] and "pullback demo --quick" in published["stamp"]["command"]
    for stage in pipeline.STAGES:
        assert f"| {stage.NAME} | ok | {results['stages'][stage.NAME]['seconds']:.0f} | {stage.EXPECTED_S[True]:.0f} |" in page
    for task in TASKS:
        winner = summary.split(f"recommended for {TASKS[task].label} (measured winner): ")[1].splitlines()[0]
        assert f"Measured winner: {winner}" in page
    assert f"segmentation mIoU {results['model']['this_run']['miou']:.3f}" in page
    assert results["stages"]["diagnostic"]["result"]["table_text"].strip() in page
    rho = results["stages"]["importance_head"]["result"]["cls"]["spearman"]
    assert f"| CLS embedding | shipped | 1 |" in page and f"{rho['mean']:.3f} ± {rho['std']:.3f}" in page


def _row(decoder, layer, kappa, regime, name, method):
    return {"decoder": decoder, "layer": layer, "kappa_cap": kappa, "regime": regime, "regime_name": name, "recommended": method}


def _headline_row(row, method, ours, r, error, speedups, flop_ratio=1.4):
    """A row in the group of ToMe's ``r``; ours merges more per block to match ToMe's cost."""
    knob = {"tome_r": r, "r": r} if method == "tome" else {"tome_r": r, "r": r + 6, "early_merges": False}
    return {"row": row, "method": method, "ours": ours, "knob": knob, "flop_ratio": flop_ratio,
            "error": {"mean": error, "p95": 2 * error},
            "speedup": {"median": sorted(speedups)[1], "low": min(speedups), "high": max(speedups)}}


def _headline(metric, tome, ours):
    """A headline at r = 8 and 16: ToMe and importance_tome, ``(error, speed-ups)`` each at r = 16."""
    from pullback_ext.demo.headline import winner

    rows = [_headline_row("tome", "tome", False, 8, 0.1, (1.1, 1.2, 1.3), 1.2),
            _headline_row("importance_tome", "importance_tome", True, 8, 0.01, (1.1, 1.2, 1.3), 1.2),
            _headline_row("tome", "tome", False, 16, *tome), _headline_row("importance_tome", "importance_tome", True, 16, *ours)]
    result = {"metric": metric, "batch": 32, "repeats": 3, "num_images": 16, "rows": rows}
    return result | {"winner": winner(result)}


def test_the_recommendation_is_the_measured_winner():
    """The winner is computed from the numbers: the lowest error at the largest r among the rows
    faster than the unpruned model; none when no row is."""
    from pullback_ext.demo.headline import UNREACHED, headline_table, verdict, winner

    ours_better = _headline("cosine_x100", (0.5, (1.3, 1.4, 1.5)), (0.05, (1.2, 1.3, 1.4)))
    assert ours_better["winner"]["method"] == "importance_tome"
    assert verdict(ours_better).startswith("importance_tome at r=22, early_merges=False: cosine_x100 0.050")
    assert "ToMe at r=16: 0.500" in verdict(ours_better)
    tome_better = _headline("cosine_x100", (0.05, (1.3, 1.4, 1.5)), (0.5, (1.2, 1.3, 1.4)))
    assert tome_better["winner"]["method"] == "tome" and "ToMe at" not in verdict(tome_better)
    assert "ToMe at" not in verdict(json.loads(json.dumps(tome_better)))  # as a page renders it, from the JSON
    ours_slow = _headline("cosine_x100", (0.5, (1.3, 1.4, 1.5)), (0.05, (0.8, 0.9, 1.2)))
    assert ours_slow["winner"]["method"] == "tome"  # lower error but slower than the unpruned model
    short = _headline("cosine_x100", (0.5, (1.3, 1.4, 1.5)), (0.05, (1.2, 1.3, 1.4)))
    short["rows"][-1]["row"] += UNREACHED  # ours could not reach ToMe's cost: never the winner
    assert winner(short)["method"] == "tome"
    nothing_faster = _headline("cosine_x100", (0.5, (0.8, 0.9, 1.0)), (0.05, (0.8, 0.9, 1.2)))
    assert nothing_faster["winner"] is None and verdict(nothing_faster).startswith("none")
    table = headline_table(ours_better, "CLS")
    assert "| r = 16 | importance_tome (ours) | r=22, early_merges=False | 1.40 | 1.30× (1.20–1.40) | 0.050 | 0.100 |" in table
    assert "Measured winner: importance_tome at r=22" in table


def test_the_summary_says_what_was_found_the_measured_winner_and_where_the_files_are(tmp_path):
    from pullback_ext.demo.summary import summary
    from pullback_ext.diagnostics import REGIMES

    rows = [_row("embedding", 1, 0.95, "v", REGIMES["v"][0], REGIMES["v"][1]), _row("embedding", 6, 0.39, "iii", REGIMES["iii"][0], REGIMES["iii"][1]),
            _row("depth", 1, 0.99, "v", REGIMES["v"][0], REGIMES["v"][1]), _row("depth", 3, 0.98, "v", REGIMES["v"][0], REGIMES["v"][1])]
    pruning = {"cls": {"headline": _headline("cosine_x100", (0.5, (1.3, 1.4, 1.5)), (0.05, (1.2, 1.3, 1.4)))},
               "depth": {"headline": _headline("silog_x100", (0.2, (1.3, 1.4, 1.5)), (0.4, (1.2, 1.3, 1.4)))},
               "segmentation": {"headline": _headline("pixel_kl_x100", (0.02, (1.3, 1.4, 1.5)), (0.01, (1.2, 1.3, 1.4)))
                                | {"figure": {"file": "pruning/segmentation/merges.png", "scene": 0}}}}
    results = {"stages": {"diagnostic": {"status": "ok", "result": {"table": rows}}, "pruning": {"status": "ok", "result": pruning}}}
    text = summary(results, tmp_path)
    lines = text.splitlines()
    embedding = next(line for line in lines if line.strip().startswith("CLS embedding: κ_cap"))
    assert "κ_cap 0.95 / 0.39 at layers 1 / 6" in embedding
    assert f"layer 1: regime (v) {REGIMES['v'][0]}" in embedding and f"layer 6: regime (iii) {REGIMES['iii'][0]}" in embedding
    assert "recommended" not in embedding  # the recommendation is measured, below
    depth = next(line for line in lines if line.strip().startswith("DPT depth: κ_cap"))
    assert "layer" not in depth.split(". ", 1)[1]  # one regime for both layers: said once
    cls_line = next(line for line in lines if line.strip().startswith("CLS embedding, cosine_x100 at the cost of ToMe r = 16"))
    assert "tome 0.5 at FLOP ratio 1.40, 1.40× (1.30–1.50)" in cls_line and "importance_tome (ours) 0.05" in cls_line
    assert "recommended for CLS embedding (measured winner): importance_tome at r=22" in text
    assert "recommended for DPT depth (measured winner): tome at r=16" in text
    segmentation = text.split("DPT segmentation, pixel_kl_x100 at the cost of ToMe r = 16")[1]
    assert "recommended for DPT segmentation (measured winner): importance_tome at r=22" in segmentation
    assert "what each merged on held-out scene 0: pruning/segmentation/merges.png" in segmentation
    assert "what each merged" not in text.split("DPT segmentation, ")[0]  # a run without pictures names none
    assert f"Files in {tmp_path}:" in text and "pruning/cls/, pruning/depth/, pruning/segmentation/" in text and "results.json" in text
    failed = {"stages": {"diagnostic": {"status": "failed", "error": "RuntimeError: boom"}}}
    text = summary(failed, tmp_path)
    assert "(the diagnostic stage failed: RuntimeError: boom)" in text and "(the pruning stage did not run)" in text


def test_the_demo_states_its_plan_and_expected_times():
    """Each stage says what it does and how long it takes on an idle 2-core machine; the first
    line gives the total."""
    for quick in (True, False):
        lines = pipeline.plan_lines(quick)
        assert len(lines) == 1 + len(pipeline.STAGES)
        for stage, line in zip(pipeline.STAGES, lines[1:]):
            assert line.split()[0] == stage.NAME and f"~{stage.EXPECTED_S[quick]:>4.0f} s" in line and stage.PLAN[quick] in line
        total = sum(stage.EXPECTED_S[quick] for stage in pipeline.STAGES)
        assert f"about {total / 60:.0f} min" in lines[0] and ("--quick" in lines[0]) == quick and "idle 2-core machine" in lines[0]


def test_the_demo_ends_with_the_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("pullback_ext.machine.busy_note", lambda *args, **kwargs: None)  # whatever the machine's load
    monkeypatch.setattr(pipeline, "STAGES", (_stage("diagnostic", lambda inputs: StageResult({"table": [
        _row("embedding", 1, 0.9, "v", "low rank, localised", "either")]})),))
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1].strip().startswith("pruning/subspace.json")
    assert "Summary" in out and "CLS embedding: κ_cap 0.90 at layers 1" in out and "(the pruning stage did not run)" in out
    assert main(["demo", "--quick", "--quiet", "--overwrite", "--out", str(tmp_path)]) == 0
    quiet = capsys.readouterr()
    assert "Summary" in quiet.out and "wrote" not in quiet.out and "pullback demo" not in quiet.err


def test_a_table_that_repeats_an_earlier_one_is_printed_once():
    from pullback_ext.demo.pruning_stage import printed_tables

    def cells(silog, cosine):
        return {"0.5": {"silog_x100": {"mean": silog, "std": 0.0}, "cosine_x100": {"mean": cosine, "std": 0.0}}}

    result = {"task": "depth", "ratios": [0.5], "layers": [2, 4], "seeds": 1, "tables": {
        "llf": {"tome_score": cells(1.0, 0.25)}, "no_llf": {"tome_score": cells(3.0, 0.25)}}}
    text = printed_tables(result)
    assert text.count("| tome_score |") == 3  # silog twice, cosine once
    assert "**cosine_x100** (no_llf): the same as (llf), not repeated" in text and "3.000 ± 0.000" in text
    result["tables"]["no_llf"]["tome_score"]["0.5"]["cosine_x100"]["mean"] = 0.25 + 1e-9  # prints the same
    assert printed_tables(result) == text
    result["tables"]["no_llf"]["tome_score"]["0.5"]["cosine_x100"]["mean"] = 0.5
    assert printed_tables(result).count("| tome_score |") == 4 and "not repeated" not in printed_tables(result)


@pytest.mark.parametrize("task", ["cls", "depth", "segmentation"])
def test_the_headline_matches_ours_to_tomes_flops_with_the_least_reduction(task):
    """Each of ours costs at most ToMe's FLOPs at its r, and one merge less per block (or η one step
    lower) would cost more: the cheapest-to-ToMe setting, not a cheaper one. Segmentation, which has
    no importance head, runs ours without one and no paper pipeline."""
    from pullback_ext import embedded
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.comparison.pareto import resolve
    from pullback_ext.demo.headline import PAPER_ETAS, Setup, flop_counter, headline_points
    from pullback_ext.prune.methods.importance_tome import auto_setting
    from pullback_ext.prune.reduction_options import ReductionOptions

    model = embedded.load()
    backbone = demo_backbone(model, embedded.load_segmentation_head(model=model) if task == "segmentation" else None)
    head = None if task == "segmentation" else torch.nn.Sequential(torch.nn.Linear(192, 1), torch.nn.Flatten(-2))  # F [B, K, D] -> [B, K]
    setup = Setup(task, head, 1, (2, 4), int(model.backbone.patch_embed.num_patches), True)
    image = torch.rand(1, 3, model.image_size, model.image_size)
    flops = flop_counter(backbone, task, image)
    points = headline_points(backbone, setup, image)
    tome = next(p for p in points if p.options.strategy == "tome")
    assert [p.row for p in points] == {"cls": ["tome", "importance_tome"], "segmentation": ["tome", "importance_tome (no head)"],
                                       "depth": ["tome", "importance_tome (no head)", "importance (paper preset, prune + LLF)"]}[task]
    for p in points[1:]:
        assert flops(p.options) <= flops(tome.options), p.row
        o = p.options
        if o.strategy == "importance_tome":
            assert o.head is (head if task == "cls" else None) and p.knob == {"tome_r": 16, "r": o.r, "early_merges": o.early_merges}
            less = o.replace(r=o.r - 1)
            assert o.r >= 16 and flops(less) > flops(tome.options)
            at_tome = resolve(o.replace(r=16, schedule="auto", early_merges="auto"), backbone)
            # ToMe's reach at r = 16 on the demo (tome_reach: 1.51) is beyond GUARDED_REACH; a head on block 1 has no middle setting
            assert (o.schedule, o.early_merges) == auto_setting(at_tome.options, at_tome.backbone) == ("constant", True)
        else:
            less = ReductionOptions(strategy="importance", head=head, ratio=PAPER_ETAS[PAPER_ETAS.index(o.ratio) - 1],
                                    layers=(2, 4), mode="prune", preset="paper")
            assert flops(less) > flops(tome.options)


def test_the_segmentation_headline_is_the_pixel_kl_of_its_rows_and_its_picture_their_merges(tmp_path, monkeypatch):
    """The segmentation headline (ours without a head against ToMe) on three held-out scenes: each
    row's errors are the per-pixel KL ×100 of its class distributions against the model's own
    segmentation (``model.segment``), computed here with torch's ``kl_div``, and its FLOP ratio the
    counted FLOPs' of the task's forward; its picture is a PNG whose ToMe row holds ToMe's token
    count after each drawn block."""
    from PIL import Image

    from pullback_ext import embedded
    from pullback_ext.comparison.backbones import demo_backbone
    from pullback_ext.comparison.cost import count_flops
    from pullback_ext.comparison.pareto import resolve
    from pullback_ext.demo import headline
    from pullback_ext.demo.importance_stage import LAYER

    monkeypatch.setitem(headline.SETTINGS, True, {"batch": 2, "repeats": 2})
    model = embedded.load()
    head = embedded.load_segmentation_head(model=model)
    backbone = demo_backbone(model, head)
    scenes = embedded.heldout(3)["images"]
    n = int(model.backbone.patch_embed.num_patches)
    setup = headline.Setup("segmentation", None, LAYER, (2, 4), n, True)
    points = headline.headline_points(backbone, setup, scenes[:1])
    result = headline.run_headline(backbone, scenes, setup, points, progress=False)
    assert result["metric"] == "pixel_kl_x100" and [row["row"] for row in result["rows"]] == ["tome", "importance_tome (no head)"]
    full_forward, reduced_forward = backbone.forwards("segmentation")
    with torch.no_grad():
        full = model.segment(scenes, head).double().log_softmax(dim=1)
        for point, row in zip(points, result["rows"]):
            reduction = resolve(point.options, backbone)
            reduced = reduced_forward(reduction, scenes)["segmentation"].double().log_softmax(dim=1)
            kl = torch.nn.functional.kl_div(reduced, full, reduction="none", log_target=True).sum(dim=1)
            errors = 100 * kl.flatten(1).mean(dim=1)
            assert float(errors.min()) > 0, row["row"]
            assert (row["error"]["mean"], row["error"]["worst"]) == pytest.approx((float(errors.mean()), float(errors.max())), rel=1e-6)
            flop_ratio = count_flops(full_forward, scenes[:1]) / count_flops(lambda x: reduced_forward(reduction, x), scenes[:1])
            assert row["flop_ratio"] == pytest.approx(flop_ratio, rel=1e-9)
    assert result["rows"][1]["flop_ratio"] >= result["rows"][0]["flop_ratio"] - 1e-9  # ours at most ToMe's cost
    drawn = headline.merges_figure(model, "segmentation", points, result, scenes[:1], tmp_path / "merges.png", head)
    assert (tmp_path / "merges.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(tmp_path / "merges.png") as picture:
        picture.verify()
    assert drawn["blocks"] == [3, 7] and [row["row"] for row in drawn["rows"]] == ["tome", "importance_tome (no head)"]
    assert [drawn["rows"][0]["counts"][str(b)]["tokens"] for b in (3, 7)] == [n - 16 * 4, n - 16 * 8]  # r = 16 in every block
