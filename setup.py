"""Build and install ls_fairseq.

The CUDA extension ``ls_fairseq._C`` is built only when the installed torch has
CUDA (``torch.version.cuda``) and ``nvcc`` is found; otherwise, or with
``LS_FAIRSEQ_CUDA=0``, it is skipped with a one-line notice and every op runs
its PyTorch reference. ``TORCH_CUDA_ARCH_LIST`` (default "8.0;9.0") and
``MAX_JOBS`` are honoured.
"""
import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import find_packages, setup


def cxx_with_shared_runtime():
    """$CXX (default c++), else the first of c++ and g++ whose toolchain has the shared C++
    runtime (libstdc++.so) that torch and pybind11 use; None if none has. Torch's extension
    build compiles and links with $CXX, and a toolchain with only the static runtime (as a
    Python distribution's private one may be) gives the extension a runtime of its own: an
    exception thrown in it (a failed input check) then crashes the process."""
    for cxx in dict.fromkeys([os.environ.get("CXX", "c++"), "c++", "g++"]):
        try:
            found = subprocess.run(shlex.split(cxx) + ["-print-file-name=libstdc++.so"], capture_output=True,
                                   text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            continue
        if os.path.isabs(found):
            return cxx
    return None


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
    cxx = cxx_with_shared_runtime()
    if cxx is None:
        print("ls_fairseq: no C++ compiler found that links the shared C++ runtime (libstdc++.so); "
              "a failed input check may crash the process", file=sys.stderr)
    elif cxx != os.environ.get("CXX", "c++"):
        print("ls_fairseq: {} has no shared C++ runtime (libstdc++.so); building with {}".format(
            os.environ.get("CXX", "c++"), cxx), file=sys.stderr)
        os.environ["CXX"] = cxx
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
    package_data={"ls_fairseq": ["csrc/*.cu", "csrc/*.cuh", "csrc/*.cpp", "csrc/*.h"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    entry_points={"console_scripts": ["ls-fairseq-train = ls_fairseq.train:cli_main"]},
    # python -m ls_fairseq.convert to-ctranslate2; ls_fairseq.hf: the fused layers in Hugging Face models, with
    # accelerate for transformers' Trainer (its fp16/bf16 training with ls layers)
    extras_require={"ctranslate2": ["ctranslate2>=4.5"], "hf": ["transformers>=5,<6", "accelerate>=1.1,<2"]},
)
