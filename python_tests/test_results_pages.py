"""Results pages: stamps, tables, atomic page writes, and the benchmarks' renderers on synthetic results."""

import datetime
import importlib.util
import json
import re
from pathlib import Path

import pytest

from pullback_ext import results_pages as rp
from pullback_ext.errors import DataError, PullbackError

REPO = Path(__file__).resolve().parents[1]


def _stamp():
    return rp.stamp("python benchmarks/bench_x.py --quick")


def _clean_stamp(commit="0" * 40):
    """A stamp as made in a checkout at ``commit`` (the tests may run in one with local changes)."""
    s = _stamp()
    s["versions"]["git_commit"] = commit
    return s


def test_stamp_says_machine_versions_date_and_command():
    s = _stamp()
    assert s["command"] == "python benchmarks/bench_x.py --quick"
    assert datetime.datetime.fromisoformat(s["date"]).tzinfo is not None
    assert s["machine"]["cpu"] and s["machine"]["cores"] >= 1 and "gpu" in s["machine"]
    v = s["versions"]
    assert v["python"].count(".") == 2 and v["torch"] and v["pullback_ext"]
    if (REPO / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}( \+local changes)?", v["git_commit"])
    assert rp.stamp(["python", "a b.py", "--x"])["command"] == "python 'a b.py' --x"
    with pytest.raises(PullbackError, match="command"):
        rp.stamp("  ")


def test_current_command_names_the_script_relative_to_the_repository():
    assert rp.current_command([str(REPO / "benchmarks" / "bench_prune.py"), "--quick"]) == "python benchmarks/bench_prune.py --quick"
    assert rp.current_command(["/elsewhere/run.py"]) == "python /elsewhere/run.py"
    with pytest.raises(PullbackError, match="argv"):
        rp.current_command([])


def test_markdown_table_formats_numbers_and_checks_rows():
    table = rp.markdown_table(["a", "b"], [(1.23456, 12345), (1e-7, None), (0.5, "x")])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1.23 | 12,345 |", "| 1.00e-07 | – |", "| 0.5 | x |"]
    assert rp.format_number(float("nan")) == "nan" and rp.format_number(True) == "True" and rp.format_number(2.5e6) == "2.50e+06"
    with pytest.raises(PullbackError, match=r"rows\[1\]: expected 2 cells"):
        rp.markdown_table(["a", "b"], [(1, 2), (3,)])
    with pytest.raises(PullbackError, match="headers"):
        rp.markdown_table([], [])


def test_page_is_stamped_links_its_json_and_is_written_atomically(tmp_path):
    results = {"stamp": _stamp(), "rows": [["op", 1.5]]}
    json_path = tmp_path / "bench-x.json"
    json_path.write_text(json.dumps(results))
    page = rp.write_results_page(json_path, tmp_path / "bench-x.md", "Bench X",
                                 lambda r: rp.markdown_table(["op", "ms"], r["rows"]), note="Quick settings.")
    text = page.read_text()
    assert text.startswith(rp.GENERATED) and "# Bench X" in text and "Quick settings." in text
    assert "`python benchmarks/bench_x.py --quick`" in text and "[bench-x.json](bench-x.json)" in text
    assert "| op | 1.5 |" in text and results["stamp"]["date"] in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench-x.json", "bench-x.md"]
    # from a dict there is no JSON to link; the same results give the same page body
    again = rp.write_results_page(results, tmp_path / "other" / "x.md", "Bench X", lambda r: "body")
    assert "data |" not in again.read_text()


def test_bad_results_and_arguments_are_named(tmp_path):
    render = lambda r: ""  # noqa: E731
    with pytest.raises(DataError, match="stamp"):
        rp.write_results_page({"rows": []}, tmp_path / "p.md", "T", render)
    with pytest.raises(DataError, match="no such JSON file"):
        rp.write_results_page(tmp_path / "missing.json", tmp_path / "p.md", "T", render)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        rp.write_results_page(tmp_path / "bad.json", tmp_path / "p.md", "T", render)
    with pytest.raises(PullbackError, match="title"):
        rp.write_results_page({"stamp": _stamp()}, tmp_path / "p.md", " ", render)
    with pytest.raises(TypeError, match="render"):
        rp.write_results_page({"stamp": _stamp()}, tmp_path / "p.md", "T", "not callable")
    with pytest.raises(PullbackError, match="stamp: expected the key 'machine'"):
        rp.render_stamp({"command": "c", "date": "d", "versions": {}})
    with pytest.raises(PullbackError, match="name"):
        rp.publish({"stamp": _stamp()}, "sub/page", "T", render, folder=tmp_path)
    assert not (tmp_path / "p.md").exists()


def test_publish_writes_json_and_page(tmp_path):
    json_path, page = rp.publish({"stamp": _clean_stamp(), "v": 3}, "bench-y", "Bench Y", lambda r: f"v = {r['v']}", folder=tmp_path)
    assert json.loads(json_path.read_text())["v"] == 3
    assert page == tmp_path / "bench-y.md" and "v = 3" in page.read_text()


def test_a_page_from_a_changed_checkout_is_refused_unless_allowed_and_then_says_so(tmp_path):
    dirty = {"stamp": _clean_stamp("0" * 40 + " +local changes"), "v": 3}
    with pytest.raises(PullbackError, match="the checkout has local changes .*give --allow-dirty"):
        rp.publish(dirty, "dirty", "Dirty", lambda r: "body", folder=tmp_path)
    assert not (tmp_path / "dirty.json").exists() and not (tmp_path / "dirty.md").exists()
    _, page = rp.publish(dirty, "dirty", "Dirty", lambda r: "body", folder=tmp_path, allow_dirty=True)
    lines = page.read_text().splitlines()
    assert rp.DIRTY_NOTE in lines and lines.index(rp.DIRTY_NOTE) < lines.index("body")  # under the header, before the figures
    _, clean = rp.publish({"stamp": _clean_stamp(), "v": 3}, "clean", "Clean", lambda r: "body", folder=tmp_path)
    assert "local changes" not in clean.read_text()
    rp.refuse_dirty(False, "0" * 40)
    rp.refuse_dirty(True, "0" * 40 + " +local changes")
    with pytest.raises(PullbackError, match="local changes"):
        rp.refuse_dirty(False, "0" * 40 + " +local changes")


def _bench(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmark_pages_render_their_json(tmp_path):
    head = {"model": "vit_small_patch16_224@112", "N": 50, "D": 384, "batch": 16, "head_parameters": 1000,
            "head_seconds_per_image": 1e-3, "imp_star_seconds_per_image": 2.0, "imp_star_images": 1, "speedup_vs_imp_star": 2000.0,
            "backbone_forward_seconds_per_batch": 0.5, "head_fraction_of_forward": 0.03}
    kernels = [{"op": "token_importance", "B": 1, "k": None, "kernel_s": 1e-3, "eager_s": 2e-3, "speedup": 2.0, "compiled": True}]
    metric = _bench("bench_metric").render({"head": head, "kernels": kernels})
    assert "| head speed-up over imp* | 2,000 |" in metric and "| token_importance | 1 | – | 1 | 2 | 2 | True |" in metric

    run = {"seconds": 1.5, "peak_mib": 100.0, "kappa_cap": 0.0981}
    report = {"settings": {"img": 112, "rank": 20, "probes": 20, "threads": 2, "device": "cpu"},
              "probes": {"vit_cls": {"N": 65, "D": 384, "tangent_passes": 384, "single_jvp_s": 0.01, "floor_s": 3.84,
                                     "ours_over_floor": 0.4, "speedup_vs_straightforward": 5.0, "runs": {"ours_chunk8": run}}}}
    diagnose = _bench("bench_diagnose").render(report)
    assert "## ViT-S/14 CLS, layer 10 (N = 65, D = 384)" in diagnose and "| ours_chunk8 | 1.5 | 100 | 0.0981 |" in diagnose
    assert "speed-up over the straightforward algorithm 5.00×" in diagnose


def test_current_command_names_the_cli_entry_point():
    assert rp.current_command(["/some/venv/bin/pullback", "bench", "--quick"]) == "pullback bench --quick"


def test_a_changed_page_does_not_make_the_checkout_dirty_a_changed_source_does(tmp_path):
    """``make results-pareto`` writes one page before the next run starts: pages do not count."""
    import subprocess

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "docs" / "results").mkdir(parents=True)
    (tmp_path / "docs" / "results" / "page.md").write_text("old\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert not rp.git_commit(tmp_path).endswith(rp.LOCAL_CHANGES)
    (tmp_path / "docs" / "results" / "page.md").write_text("regenerated\n")
    assert re.fullmatch(r"[0-9a-f]{40}", rp.git_commit(tmp_path))
    (tmp_path / "code.py").write_text("x = 2\n")
    assert rp.git_commit(tmp_path).endswith(rp.LOCAL_CHANGES)
