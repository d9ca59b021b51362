"""Train the importance heads ``pullback demo`` ships, with the stage's settings, on the shipped
demo model, and write them (fp16 safetensors) with their record to the package's
``embedded/weights/heads/``:

    python -m pullback_ext.demo.ship_heads [--tasks cls,depth] [--work DIR] [--out DIR]

Seeded and deterministic on one thread count: rerunning reproduces the files (the record holds
the command, the settings, the model weights' digest and the held-out ρ measured here).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path


def main(argv=None) -> int:
    import json

    import torch

    from pullback_ext.demo import importance_stage as stage
    from pullback_ext.demo.pipeline import demo_inputs
    from pullback_ext.embedded.weights_io import save_weights
    from pullback_ext.errors import PullbackError
    from pullback_ext.fileio import atomic_write_json

    p = argparse.ArgumentParser(prog="python -m pullback_ext.demo.ship_heads", description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default=",".join(stage.SETTINGS), help="heads to train (default: cls,depth)")
    p.add_argument("--work", type=Path, default=Path("out/ship_heads"), help="targets and checkpoints (default out/ship_heads)")
    p.add_argument("--out", type=Path, default=stage.SHIPPED_DIR, help="where the heads go (default: the package's)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    inputs = demo_inputs(args.work, quick=False)
    record_path = args.out / stage.RECORD
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    tasks = args.tasks.split(",")
    if not set(tasks) <= set(stage.SETTINGS):
        raise PullbackError(f"--tasks: expected some of {', '.join(stage.SETTINGS)}, got {args.tasks!r}")
    for task in tasks:
        started = time.time()
        settings = stage.SETTINGS[task]
        head = stage.train_head(inputs.model, inputs, settings, args.work / task)
        save_weights(head, args.out / f"demo_head_{task}.safetensors", metadata={"format": "pt", "task": task})
        record[task] = {"file": f"demo_head_{task}.safetensors", "settings": asdict(settings),
                        "model_weights": stage.weights_digest(inputs.model), "layer": stage.LAYER,
                        "command": f"python -m pullback_ext.demo.ship_heads --tasks {task} --threads {args.threads}",
                        "train_seconds": time.time() - started, "torch": torch.__version__}
        atomic_write_json(record_path, record)
        # ρ of the head as shipped (fp16), on the held-out scenes of a full demo run
        rho = stage.heldout_rho(inputs.model, stage.shipped_head(inputs.model, task, settings, args.out), settings,
                                inputs.scenes["images"][: stage.EVAL_IMAGES[False]])
        record[task] |= {"heldout_spearman": rho["mean"], "heldout_spearman_per_image": rho["per_image"]}
        atomic_write_json(record_path, record)
        print(f"{task}: held-out rho {rho['mean']:.3f} ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
