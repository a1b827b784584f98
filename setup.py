"""Build and install ls_fairseq.

The CUDA extension ``ls_fairseq._C`` is built only when the installed torch has
CUDA (``torch.version.cuda``) and ``nvcc`` is found; otherwise, or with
``LS_FAIRSEQ_CUDA=0``, it is skipped with a one-line notice and every op runs
its PyTorch reference. ``TORCH_CUDA_ARCH_LIST`` (default "8.0;9.0") and
``MAX_JOBS`` are honoured.
"""
import glob
import os
import shutil
import sys

from setuptools import find_packages, setup


def cuda_extension():
    if os.environ.get("LS_FAIRSEQ_CUDA", "1") == "0":
        print("ls_fairseq: LS_FAIRSEQ_CUDA=0, skipping the CUDA extension", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CUDAExtension
    except ImportError:
        print("ls_fairseq: torch not importable, skipping the CUDA extension", file=sys.stderr)
        return [], {}
    nvcc = shutil.which("nvcc") or (
        os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None
    )
    if torch.version.cuda is None or nvcc is None or not os.path.exists(nvcc):
        print(
            "ls_fairseq: torch without CUDA or no nvcc, skipping the CUDA extension "
            "(ops use their PyTorch references)",
            file=sys.stderr,
        )
        return [], {}
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    # Compile and link with the C++ compiler torch's own extension builds use ($CXX, else c++),
    # not the one Python was built with (sysconfig's CC and LDSHARED): a private toolchain may link
    # its C++ runtime statically, and an extension with a runtime of its own crashes when an
    # exception (a failed input check) crosses from it into torch and pybind11.
    cxx = os.environ.setdefault("CXX", "c++")
    os.environ.setdefault("CC", cxx)
    os.environ.setdefault("LDSHARED", cxx + " -pthread -shared")
    here = os.path.dirname(os.path.abspath(__file__))
    sources = sorted(glob.glob(os.path.join("ls_fairseq", "csrc", "*.cu"))) + [
        os.path.join("ls_fairseq", "csrc", "bindings.cpp")
    ]
    ext = CUDAExtension(
        name="ls_fairseq._C",
        sources=sources,
        include_dirs=[os.path.join(here, "ls_fairseq", "csrc")],
        extra_compile_args={
            "cxx": ["-O3", "-std=c++20"],
            # no --use_fast_math: the sinusoids and gelu's erf must match fairseq's fp32 values
            "nvcc": ["-O3", "-std=c++20", "-lineinfo", "--expt-relaxed-constexpr"],
        },
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = cuda_extension()

setup(
    name="ls_fairseq",
    version="0.1.0",
    description="Fused Transformer training for fairseq (a LightSeq2 re-creation for torch 2.x and Hopper)",
    license="MIT",
    python_requires=">=3.9",
    packages=find_packages(include=["ls_fairseq", "ls_fairseq.*"]),
    package_data={"ls_fairseq": ["csrc/*.cu", "csrc/*.cpp", "csrc/*.h"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["ls-fairseq-train = ls_fairseq.train:cli_main"]},
)
