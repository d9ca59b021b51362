#!/usr/bin/env bash
# Packaging check: build the wheel, install it into a fresh environment that has the dependencies
# but not the project, and run it from a directory without the sources.
#
# The wheel reuses the objects of the in-place build (`make test` / bootstrap: build/temp.*, kept
# up to date by ninja) with the same flags, read from pullback_ext/_build_info.py, so nothing is
# compiled twice: only the link runs. The fresh environment is a venv of the base interpreter whose
# only packages are the wheel and a view of the project venv's site-packages without the project:
# `--system-site-packages` would expose the base interpreter's packages instead, and the project
# venv's own site-packages holds the editable install (its path finder would import the sources).
#
# From the wheel it runs: the import, one op against its reference, patch.auto on a timm ViT,
# `pullback --help` and `pullback diagnose` on the demo model's shipped weights (one image).
# `pullback demo --quick` takes about 2 min on 2 idle cores (over 10 when they are shared), and
# the test suite runs it already (test_demo_command.py), so it runs here only with --demo.
#   bash .ci/wheel_smoke.sh          the checks above
#   bash .ci/wheel_smoke.sh --demo   also `pullback demo --quick`
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PULLBACK_VENV:-.venv}/bin/python
run_demo=0
[ "${1:-}" = "--demo" ] && run_demo=1
WORK=$(mktemp -d "${TMPDIR:-/tmp}/pullback-wheel-smoke.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
say() { echo "[wheel-smoke] $*"; }

# --- build, with the flags of the in-place build
if [ -f pullback_ext/_build_info.py ]; then
  eval "$("$PY" - <<'EOF'
import runpy
info = runpy.run_path("pullback_ext/_build_info.py")
if info["WITH_CUDA"]:
    print(f"export FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST='{info['CUDA_ARCHS']}'")
EOF
)"
else
  say "no in-place build (pullback_ext/_build_info.py): the wheel compiles everything"
fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
rm -rf build/lib.* build/bdist.*  # link from the current objects, never reuse a previous wheel's library
say "building the wheel (FORCE_CUDA=${FORCE_CUDA:-0} ARCHS=${TORCH_CUDA_ARCH_LIST:-})"
start=$SECONDS
if ! PULLBACK_LOCAL_VERSION=auto MAX_JOBS=${MAX_JOBS:-$(nproc)} "$PY" -m pip wheel -v --no-build-isolation --no-deps \
     --disable-pip-version-check -w "$WORK/dist" . >"$WORK/build.log" 2>&1; then
  tail -n 60 "$WORK/build.log" >&2
  exit 1
fi
compiled=$(grep -cE '^\[[0-9]+/[0-9]+\] .*(c\+\+|nvcc) ' "$WORK/build.log" || true)
wheel=$(ls "$WORK"/dist/pullback_ext-*.whl)
say "built $(basename "$wheel") in $((SECONDS - start)) s ($compiled objects compiled)"
label=$("$PY" -c "import runpy, torch; print(runpy.run_path('setup.py', run_name='wheel_smoke')['local_version']('auto', torch.__version__, torch.version.cuda, getattr(torch.version, 'hip', None)))" 2>/dev/null)
case $(basename "$wheel") in
  "pullback_ext-0.1.0+$label-"*) ;;
  *) say "expected the local version +$label in the wheel's name" >&2; exit 1 ;;
esac

# --- a fresh environment: the base interpreter, the dependencies, not the project
BASE=$("$PY" -c "import sys; print(sys._base_executable)")
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$BASE" -m venv "$WORK/venv"
SMOKE=$WORK/venv/bin/python
DEPS=$WORK/deps  # the project venv's site-packages without pullback_ext (its editable finder, its metadata)
mkdir "$DEPS"
for entry in "$SITE"/*; do
  case $(basename "$entry") in pullback_ext*|__editable__*pullback_ext*|__pycache__) continue ;; esac
  ln -s "$entry" "$DEPS/"
done
SMOKE_SITE=$("$SMOKE" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$DEPS')" > "$SMOKE_SITE/zz_dependencies.pth"
"$SMOKE" -m pip install --quiet --no-deps --disable-pip-version-check "$wheel"

# --- run it from a directory without the sources
mkdir "$WORK/elsewhere"
cd "$WORK/elsewhere"
"$SMOKE" - "$SMOKE_SITE" "$ROOT" <<'EOF'
import importlib.metadata as metadata
import sys
from pathlib import Path

import torch
from packaging.requirements import Requirement

site, root = Path(sys.argv[1]), Path(sys.argv[2])
import pullback_ext
from pullback_ext import ops, reference

where = Path(pullback_ext.__file__).resolve()
assert where.is_relative_to(site.resolve()) and not where.is_relative_to(root), f"pullback_ext imported from {where}"
found = [d.metadata["Version"] for d in metadata.distributions() if d.metadata["Name"] == "pullback_ext"]
assert len(found) == 1, f"pullback_ext distributions seen: {found}"
unmet = []
for text in metadata.requires("pullback_ext"):
    requirement = Requirement(text)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": "models"}):
        continue  # other extras (test, photos) are not part of the smoke
    try:
        installed = metadata.version(requirement.name)
    except metadata.PackageNotFoundError:
        installed = None
    if installed is None or not requirement.specifier.contains(installed, prereleases=True):
        unmet.append(f"{requirement} (installed: {installed})")
assert not unmet, f"requirements not met: {unmet}"
info = pullback_ext.build_info()
assert info["compiled"], info

g = torch.Generator().manual_seed(0)
x, idx = torch.randn(2, 9, 4, generator=g), torch.tensor([[0, 3, 5], [1, 2, 8]])
assert ops.uses_compiled(x)
torch.testing.assert_close(ops.gather_tokens(x, idx), reference.gather_tokens(x, idx), rtol=0, atol=0)

import timm
import pullback_ext.patch as patch

torch.manual_seed(0)
model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2).eval()
images = torch.randn(2, 3, 32, 32, generator=g)
with torch.no_grad():
    full = model(images)
    patch.auto(model, ratio=0.0, layers=(1,), strategy="norm")
    assert torch.equal(model(images), full)
    patch.auto(model, ratio=0.5, layers=(1,), strategy="norm")
    assert model(images).shape == full.shape and not torch.allclose(model(images), full)
print(f"[wheel-smoke] pullback_ext {found[0]} from {where.parent}: requirements met, ops.gather_tokens = reference, "
      f"patch.auto on a timm ViT")
EOF
export PATH="$WORK/venv/bin:$PATH"
pullback --help >/dev/null
pullback diagnose --model demo --layer 2 --task cls --images builtin:scenes --num-images 1 --rank 3 --power 1 \
  --probes 6 --slq-steps 4 --out "$WORK/diagnose" >"$WORK/diagnose.log" 2>&1 || { tail -n 40 "$WORK/diagnose.log" >&2; exit 1; }
test -s "$WORK/diagnose/diagnosis.json"
say "pullback --help, pullback diagnose --model demo (the shipped weights, from the wheel) ok"
if [ $run_demo = 1 ]; then
  start=$SECONDS
  pullback demo --quick --out "$WORK/demo" >"$WORK/demo.log" 2>&1 || { tail -n 40 "$WORK/demo.log" >&2; exit 1; }
  say "pullback demo --quick ok in $((SECONDS - start)) s (shipped weights found in the wheel)"
fi
