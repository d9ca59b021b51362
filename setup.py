"""Build script for the compiled core ``pullback_ext._C``.

The CPU kernels are always built. The CUDA kernels are added when a GPU is visible and nvcc is
found, or unconditionally with ``FORCE_CUDA=1`` (wheels, and CI's compile check on machines
without a GPU). ``TORCH_CUDA_ARCH_LIST`` and ``MAX_JOBS`` are honoured; the default arch list is
``8.0;9.0+PTX``.

Build into an environment that already has the torch you will run with::

    pip install --no-build-isolation -e .

``PULLBACK_LOCAL_VERSION`` gives the wheel a local version naming the torch it was built for
(a wheel runs with that torch only): ``auto`` derives it from the torch building it, as
``0.1.0+pt2.14cu130`` (CUDA 13.0 build of torch 2.14) or ``0.1.0+pt2.13cpu`` (CPU build), in
pytorch_scatter's ``+ptXYcuZZ`` convention; any other value is used as given (``0.1.0+VALUE``);
unset or empty, the version has no local part.

The package requires the torch release it is built against (``torch==2.13.*`` when built with torch
2.13.x): the compiled extension loads with that torch only, so a wheel installed on its own must
not pull in another one.
"""

import glob
import os
import re
import sys

from setuptools import setup

try:
    import torch
    from torch.utils import cpp_extension
except ImportError:  # pragma: no cover - exercised only on a machine without torch
    sys.exit("pullback_ext needs PyTorch to build: install torch first, then "
             "`pip install --no-build-isolation .`")

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0+PTX"
# Everything but torch, whose requirement is the building torch's release (torch_requirement).
DEPENDENCIES = ["numpy>=1.24", "scipy>=1.11", "safetensors>=0.4", "tqdm>=4.66", "matplotlib>=3.8", "pillow>=10"]


def _want_cuda() -> bool:
    if os.environ.get("FORCE_CUDA", "0") == "1":
        if cpp_extension.CUDA_HOME is None:
            sys.exit("FORCE_CUDA=1 but no CUDA toolkit was found: set CUDA_HOME to the toolkit root")
        if torch.version.cuda is None:
            sys.exit(f"FORCE_CUDA=1 but the installed torch {torch.__version__} is a CPU-only build")
        return True
    return torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None


def local_version(setting: str, torch_version: str, cuda_version, hip_version=None) -> str:
    """The local version label (after the ``+``) for ``PULLBACK_LOCAL_VERSION=setting`` and the
    building torch (``torch.__version__``, ``torch.version.cuda``, ``torch.version.hip``); empty
    for no label."""
    setting = setting.strip().lstrip("+")
    if setting != "auto":
        if setting and not re.fullmatch(r"[A-Za-z0-9]+(\.[A-Za-z0-9]+)*", setting):
            sys.exit(f"PULLBACK_LOCAL_VERSION: expected 'auto' or a local version label (letters and digits, "
                     f"dot-separated, e.g. pt2.14cu130), got {setting!r}")
        return setting
    major_minor = ".".join(torch_version.split("+")[0].split(".")[:2])
    if cuda_version:
        flavour = "cu" + cuda_version.replace(".", "")
    elif hip_version:
        flavour = "rocm" + ".".join(str(hip_version).split(".")[:2])
    else:
        flavour = "cpu"
    return f"pt{major_minor}{flavour}"


def torch_requirement(torch_version: str) -> str:
    """The requirement on torch of a package built with torch ``torch_version`` (``torch.__version__``):
    its release, any patch level and build (``"2.13.0+cpu"`` -> ``"torch==2.13.*"``)."""
    release = torch_version.split("+")[0].split(".")
    if len(release) < 2 or not all(part.isdigit() for part in release[:2]):
        sys.exit(f"torch.__version__: expected MAJOR.MINOR[.PATCH][+LOCAL], got {torch_version!r}")
    return f"torch=={release[0]}.{release[1]}.*"


def _egg_info_options() -> dict:
    """setuptools options that append the local version to the project's (pyproject.toml) version."""
    label = local_version(os.environ.get("PULLBACK_LOCAL_VERSION", ""), torch.__version__, torch.version.cuda,
                          getattr(torch.version, "hip", None))
    return {"egg_info": {"tag_build": f"+{label}"}} if label else {}


def _write_build_info(with_cuda: bool, archs: str) -> None:
    path = os.path.join(ROOT, "pullback_ext", "_build_info.py")
    text = (
        "# Written by setup.py at build time; do not edit.\n"
        f"TORCH_VERSION = {torch.__version__!r}\n"
        f"CUDA_VERSION = {torch.version.cuda if with_cuda else None!r}\n"
        f"WITH_CUDA = {with_cuda!r}\n"
        f"CUDA_ARCHS = {archs if with_cuda else ''!r}\n"
    )
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _extension():
    with_cuda = _want_cuda()
    archs = ""
    cpp_sources = sorted(glob.glob(os.path.join("csrc", "**", "*.cpp"), recursive=True))
    # No kernel reads errno; not setting it lets loops over std::sqrt (merge_step's costs) vectorise.
    cxx_flags = ["-O3", "-std=c++20", "-fno-math-errno"]
    link_flags = []
    if sys.platform.startswith("linux"):
        # Some toolchains link libstdc++ statically (their lib dir holds only libstdc++.a). Its
        # symbols must then stay private to _C: exported, they mix with torch's shared libstdc++
        # (half of the iostream code from each), and formatting an error message segfaults.
        link_flags.append("-Wl,--exclude-libs,ALL")
    # at::parallel_for is an inline `#pragma omp parallel` when ATen uses OpenMP: without -fopenmp
    # the CPU kernels would silently run on one thread. The library resolves to the libgomp that
    # torch already loaded (same soname), so torch.set_num_threads governs both.
    if "OpenMP" in torch.__config__.parallel_info() and sys.platform.startswith("linux"):
        cxx_flags.append("-fopenmp")
        link_flags.append("-fopenmp")
    define_macros = []
    if with_cuda:
        archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
        os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        cu_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        define_macros.append(("WITH_CUDA", None))
        ext = cpp_extension.CUDAExtension(
            name="pullback_ext._C",
            sources=cpp_sources + cu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++20", "-lineinfo"]},
            extra_link_args=link_flags,
        )
    else:
        ext = cpp_extension.CppExtension(
            name="pullback_ext._C",
            sources=cpp_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=define_macros,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_flags,
        )
    _write_build_info(with_cuda, archs)
    return ext


if __name__ == "__main__":  # (pip runs this file as __main__ too; tests import it for local_version)
    if os.environ.get("PULLBACK_SKIP_EXTENSION") == "1":
        # The bootstrap builds the extension in place first (only when its inputs changed) and then
        # installs the package in editable mode without compiling it a second time.
        setup(install_requires=[torch_requirement(torch.__version__), *DEPENDENCIES], options=_egg_info_options())
    else:
        setup(
            install_requires=[torch_requirement(torch.__version__), *DEPENDENCIES],
            ext_modules=[_extension()],
            cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
            options=_egg_info_options(),
        )
