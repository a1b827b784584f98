"""``python -m ls_fairseq.info``: versions, the CUDA extension, and the path each op takes.

The ops are the modules of ``ls_fairseq.ops``: those that ``dispatch`` routes (kernel or
PyTorch reference) and those that have no kernel of their own and run the same torch code on
every device (the bias-free GEMM ``linear``, the gradient hand-off ``residual``).
"""
import importlib.util
import os
import pkgutil
import platform
import sys

import torch

import ls_fairseq.ops
from ls_fairseq.ops import dispatch

NO_KERNEL = "torch on every device (no kernel of its own)"
NOT_OPS = ("dispatch", "workspace")


def ops():
    """Every op: ``dispatch.OPS`` in its order, then the other modules of ``ls_fairseq.ops`` (not the
    op machinery: ``dispatch``, ``workspace``)."""
    modules = sorted(m.name for m in pkgutil.iter_modules(ls_fairseq.ops.__path__) if m.name not in NOT_OPS)
    return list(dispatch.OPS) + [m for m in modules if m not in dispatch.OPS]


def extension_state():
    """One line on ``ls_fairseq._C``: loaded (from where), not built (and why not), or built
    and not loadable (with the import error)."""
    ext = dispatch.extension()
    if ext is not None:
        return "loaded ({})".format(getattr(ext, "__file__", "built in"))
    if importlib.util.find_spec("ls_fairseq._C") is None:
        if torch.version.cuda is None:
            return "not built (this torch has no CUDA): every op runs its PyTorch reference"
        return ("not built: every op runs its PyTorch reference (setup.py builds it where nvcc is found: "
                "pip install --no-build-isolation --no-deps -e .)")
    return "built but not loadable: {}".format(dispatch.extension_error())


def op_path(op, cuda):
    """The path ``op`` takes for the tensors of a training run on this machine, and why."""
    if op not in dispatch.OPS:
        return NO_KERNEL
    if not cuda:
        return "reference (no GPU)"
    if dispatch.extension() is None:
        return "reference (no extension)"
    if dispatch.forced_reference(op):
        return "reference (forced by LS_FAIRSEQ_REFERENCE)"
    return "kernel"


def gpu_name():
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"


def report():
    """The lines ``main`` prints. Raises ValueError for an LS_FAIRSEQ_REFERENCE naming an unknown op."""
    rows = [
        ("python", platform.python_version()),
        ("torch", "{} (CUDA {})".format(torch.__version__, torch.version.cuda or "none")),
    ]
    try:
        import fairseq

        rows.append(("fairseq", fairseq.__version__))
    except ImportError as e:
        rows.append(("fairseq", "not importable ({})".format(e)))
    rows += [("gpu", gpu_name()), ("extension", extension_state())]
    forced = os.environ.get("LS_FAIRSEQ_REFERENCE", "").strip()
    if forced:
        dispatch.forced_reference(dispatch.OPS[0])  # validates the whole value
        rows.append(("forced", "LS_FAIRSEQ_REFERENCE={}".format(forced)))
    cuda = torch.cuda.is_available()
    names = ops()
    width = max(len(n) for n in names)
    lines = ["{:<11} {}".format(k, v) for k, v in rows]
    lines.append("ops (the path each takes in training here):")
    lines += ["  {:<{}}  {}".format(op, width, op_path(op, cuda)) for op in names]
    return lines


def main():
    try:
        lines = report()
    except ValueError as e:
        print("ls_fairseq.info: {}".format(e), file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
