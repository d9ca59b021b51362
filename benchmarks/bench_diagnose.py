"""Seconds per image for κ_cap(20) (q = 2, m = 100) on a ViT-S/14 CLS probe at layer 10 and a DPT
(ViT-S) depth probe, random weights. "ours" is ``diagnose`` with its defaults: both probes have
M ≤ 512, so the trace is exact and the spectrum comes from the same M basis products (dense SVD).
Against, in the same run:

(a) a straightforward implementation of the paper's algorithm: one JVP / VJP at a time, each
    re-running the model's own forward from layer ℓ (``torch.func.jvp`` / ``torch.autograd.grad``;
    for the CLS probe the full last block, not the library's CLS-row shortcut), Householder QR
    (``torch.linalg.qr``) between rounds, one-at-a-time trace probes;
(b) the cost floor: the number of tangent passes the diagnostic needs × the time of one
    single-tangent JVP.

Peak memory: every (probe, method, chunk size) runs in a fresh worker process, whose peak resident
memory (CPU) or peak CUDA allocation is reported.

    python benchmarks/bench_diagnose.py            # full: 224 px, m = 100
    python benchmarks/bench_diagnose.py --quick    # 112 px, m = 20, for a shared 2-core machine

``--results-page`` also writes docs/results/bench-diagnose.json and .md, stamped with the machine,
versions and command.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a source checkout without installing

from pullback_ext.results_pages import ALLOW_DIRTY_HELP, current_command, markdown_table, publish, refuse_dirty, stamp  # noqa: E402

PROBE_NAMES = {"vit_cls": "ViT-S/14 CLS, layer 10", "dpt_depth": "DPT ViT-S depth, layer 2, 16×16"}


def build_probe(name: str, img: int, device: str, full_block: bool = False):
    """The two benchmark probes with random weights; returns (probe, F[1,N,D]). ``full_block``: the
    CLS probe runs its last block in full (the model's own forward) instead of for the CLS row."""
    torch.manual_seed(0)
    if name == "vit_cls":
        import timm

        from pullback_ext.probes import from_timm

        # LayerScale at 1: its 1e-5 init would make randomly initialised blocks near-identity
        model = timm.create_model("vit_small_patch14_dinov2", pretrained=False, img_size=img, init_values=1.0).eval().to(device)
        probe = from_timm(model, 10, "cls", cls_row=not full_block)
    else:
        from transformers import DPTConfig, DPTForDepthEstimation

        from pullback_ext.probes import from_hf_dpt

        config = DPTConfig(
            hidden_size=384, num_hidden_layers=12, num_attention_heads=6, intermediate_size=1536, image_size=img,
            patch_size=16, backbone_out_indices=[2, 5, 8, 11], neck_hidden_sizes=[48, 96, 192, 384],
            fusion_hidden_size=64, head_in_index=-1, reassemble_factors=[4, 2, 1, 0.5],
        )
        model = DPTForDepthEstimation(config).eval().to(device)
        probe = from_hf_dpt(model, 2, output_size=16)
    probe.requires_grad_(False)
    images = torch.randn(1, 3, img, img, device=device)
    features = probe.features(images)
    return probe.bind(features.image(0).context), features.F


def ours(probe, F, rank: int, probes: int, chunk: int) -> dict:
    from pullback_ext.diagnostics import DiagnoseConfig, diagnose_one

    config = DiagnoseConfig(rank=rank, oversample=10, power=2, probes=probes, slq_steps=0, trace="auto", chunk_size=chunk)
    d = diagnose_one(probe, F[0], config=config)
    return {"kappa_cap": d.kappa_cap, "passes": d.tangent_passes, "trace_method": d.trace_method}


def straightforward(probe, F, rank: int, probes: int) -> dict:
    """The paper's algorithm written plainly: per-vector JVP / VJP, Householder QR, per-probe trace."""
    from pullback_ext.linalg import EXACT_TRACE_MAX
    from pullback_ext.linalg.operator import math_attention

    f0 = F[0].detach()
    N, D = f0.shape
    P = N * D
    g = torch.Generator().manual_seed(0)

    def psi(f):
        return probe(f.unsqueeze(0)).reshape(-1)

    def jvp(v):
        with math_attention():
            return torch.func.jvp(psi, (f0,), (v.reshape(N, D),))[1]

    def vjp(u):
        f = f0.clone().requires_grad_(True)
        with math_attention():
            (grad,) = torch.autograd.grad(psi(f), f, grad_outputs=u)
        return grad.reshape(-1)

    r0 = rank + 10
    Q = torch.linalg.qr(torch.randn(P, r0, generator=g).to(f0)).Q
    for _ in range(2):
        Z = torch.stack([vjp(jvp(Q[:, j])) for j in range(r0)], 1)
        Q = torch.linalg.qr(Z).Q
    B = torch.stack([jvp(Q[:, j]) for j in range(r0)], 1)
    S = torch.linalg.svdvals(B.double())
    M = B.shape[0]
    if min(M, P) <= EXACT_TRACE_MAX:
        T = sum(float(vjp(torch.nn.functional.one_hot(torch.tensor(i), M).to(f0)).double().square().sum()) for i in range(M))
    else:
        Z = (torch.randint(0, 2, (P, probes), generator=g) * 2 - 1).to(f0)
        T = sum(float(jvp(Z[:, i]).double().square().sum()) for i in range(probes)) / probes
    return {"kappa_cap": float((S[:rank] ** 2).sum()) / T}


def single_jvp_seconds(probe, F, repeats: int = 3) -> float:
    from pullback_ext.linalg import JacobianOperator

    op = JacobianOperator(probe, F[0], chunk_size=1)
    v = torch.randn(op.P, device=F.device, dtype=F.dtype)
    op.single_jvp(v)
    times = []
    for _ in range(repeats):
        sync(F.device)
        t = time.perf_counter()
        op.single_jvp(v)
        sync(F.device)
        times.append(time.perf_counter() - t)
    return min(times)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def warm_up(probe, F) -> None:
    """One batched JVP and VJP first, so one-off costs (allocator, kernel selection) are not timed."""
    from pullback_ext.linalg import JacobianOperator

    op = JacobianOperator(probe, F[0], chunk_size=2)
    op.jvp(torch.randn(op.P, 2, device=F.device, dtype=F.dtype))
    op.vjp(torch.randn(op.M, 2, device=F.device, dtype=F.dtype))
    op.single_jvp(torch.randn(op.P, device=F.device, dtype=F.dtype))


def worker(args) -> None:
    torch.set_num_threads(args.threads)
    probe, F = build_probe(args.probe, args.img, args.device, full_block=args.full_block or args.method == "straightforward")
    warm_up(probe, F)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    sync(args.device)
    t = time.perf_counter()
    if args.method == "ours":
        out = ours(probe, F, args.rank, args.probes, args.chunk)
    elif args.method == "straightforward":
        out = straightforward(probe, F, args.rank, args.probes)
    else:
        out = {"single_jvp_s": single_jvp_seconds(probe, F)}
    sync(args.device)
    out["seconds"] = time.perf_counter() - t
    out["N"], out["D"] = int(F.shape[1]), int(F.shape[2])
    if args.device == "cuda":
        out["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out["peak_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    print("RESULT " + json.dumps(out), flush=True)


def run_worker(probe: str, method: str, chunk: int, opts, full_block: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--probe", probe, "--method", method, "--chunk", str(chunk),
           "--img", str(opts.img), "--probes", str(opts.probes), "--rank", str(opts.rank), "--threads", str(opts.threads),
           "--device", opts.device] + (["--full-block"] if full_block else [])
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=opts.timeout)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{probe}/{method} failed:\n{proc.stderr[-2000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def render(report: dict) -> str:
    """Markdown body of the results page: one table per probe (every run, then the summary)."""
    s = report["settings"]
    parts = [f"Settings: {s['img']} px, rank {s['rank']}, q = 2, m = {s['probes']} probes, {s['threads']} thread(s), "
             f"device {s['device']}. Seconds per image; peak memory of the measuring process."]
    for probe, summary in report["probes"].items():
        rows = [(name, run["seconds"], run["peak_mib"], run["kappa_cap"]) for name, run in summary["runs"].items()]
        speedup = summary.get("speedup_vs_straightforward")
        parts += [f"## {PROBE_NAMES.get(probe, probe)} (N = {summary['N']}, D = {summary['D']})",
                  markdown_table(["run", "seconds", "peak MiB", "κ_cap"], rows, digits=4),
                  f"Tangent passes {summary['tangent_passes']:,}; one single-tangent JVP {summary['single_jvp_s']:.4f} s, "
                  f"so the floor is {summary['floor_s']:.2f} s and ours / floor = {summary['ours_over_floor']:.2f}"
                  + (f"; speed-up over the straightforward algorithm {speedup:.2f}×." if speedup else ".")]
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="112 px and m = 20 (small shared machines)")
    parser.add_argument("--img", type=int, default=None)
    parser.add_argument("--probes", type=int, default=None)
    parser.add_argument("--rank", type=int, default=20)
    parser.add_argument("--chunks", default="8,32", help="chunk sizes to compare (memory bound)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", default="vit_cls,dpt_depth")
    parser.add_argument("--skip-straightforward", action="store_true")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--results-page", action="store_true", help="also write docs/results/bench-diagnose.json and .md")
    parser.add_argument("--allow-dirty", action="store_true", help=ALLOW_DIRTY_HELP)
    # worker mode (one measurement per fresh process)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--probe", default="vit_cls", help=argparse.SUPPRESS)
    parser.add_argument("--method", default="ours", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=32, help=argparse.SUPPRESS)
    parser.add_argument("--full-block", action="store_true", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.img is None:
        opts.img = 112 if opts.quick else 224
    if opts.probes is None:
        opts.probes = 20 if opts.quick else 100
    if opts.worker:
        worker(opts)
        return

    if opts.results_page:
        refuse_dirty(opts.allow_dirty)
    chunks = [int(c) for c in opts.chunks.split(",")]
    report = {"stamp": stamp(current_command()), "settings": {k: getattr(opts, k) for k in ("quick", "img", "probes", "rank", "threads", "device")}, "probes": {}}
    for probe in opts.only.split(","):
        floor = run_worker(probe, "floor", 1, opts)
        rows = {f"ours_chunk{c}": run_worker(probe, "ours", c, opts) for c in chunks}
        if probe == "vit_cls":  # what the CLS-row last block saves, at the first chunk size
            rows[f"full_block_chunk{chunks[0]}"] = run_worker(probe, "ours", chunks[0], opts, full_block=True)
        if not opts.skip_straightforward:
            rows["straightforward"] = run_worker(probe, "straightforward", 1, opts)
        passes = next(iter(rows.values()))["passes"]
        floor_s = passes * floor["single_jvp_s"]
        summary = {"N": floor["N"], "D": floor["D"], "tangent_passes": passes, "single_jvp_s": floor["single_jvp_s"], "floor_s": floor_s, "runs": rows}
        best = min(v["seconds"] for k, v in rows.items() if k.startswith("ours"))
        summary["ours_over_floor"] = best / floor_s
        if "straightforward" in rows:
            summary["speedup_vs_straightforward"] = rows["straightforward"]["seconds"] / best
        report["probes"][probe] = summary
        print(f"\n{probe}: N={floor['N']} D={floor['D']} tangent passes={passes} single JVP={floor['single_jvp_s']:.4f}s floor={floor_s:.2f}s")
        for name, row in rows.items():
            print(f"  {name:<18} {row['seconds']:8.2f} s/image  peak {row['peak_mib']:8.1f} MiB  κ_cap={row['kappa_cap']:.4f}")
        print(f"  ours / floor = {summary['ours_over_floor']:.2f}" + (f"   speedup vs straightforward = {summary['speedup_vs_straightforward']:.2f}x" if "straightforward" in rows else ""))
    if opts.out:
        Path(opts.out).write_text(json.dumps(report, indent=1))
    if opts.results_page:
        note = ("Reduced settings (`--quick`): 112 px and m = 20 probes on a shared 2-core machine (busy when its load average is above 2); not comparable with "
                "the full-size run ([cpu-benchmarks.md](cpu-benchmarks.md#diagnostic)).") if opts.quick else ""
        if opts.only != "vit_cls,dpt_depth":
            note += f" Only the probes named by `--only` ran: {', '.join(PROBE_NAMES.get(p, p) for p in opts.only.split(','))}."
        print("wrote", *publish(report, "bench-diagnose", "Diagnostic cost (`benchmarks/bench_diagnose.py`)", render, note,
                                      allow_dirty=opts.allow_dirty))


if __name__ == "__main__":
    main()
