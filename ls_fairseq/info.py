"""``python -m ls_fairseq.info``: versions, the CUDA extension, and the path each op takes."""
import platform

import torch

from ls_fairseq.ops import dispatch


def main():
    print("python      {}".format(platform.python_version()))
    print("torch       {} (CUDA {})".format(torch.__version__, torch.version.cuda or "none"))
    try:
        import fairseq

        print("fairseq     {}".format(fairseq.__version__))
    except ImportError as e:
        print("fairseq     not importable ({})".format(e))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    print("gpu         {}".format(gpu))
    ext = dispatch.extension()
    print("extension   {}".format("loaded" if ext is not None else "not loaded ({})".format(dispatch.extension_error())))
    for op in dispatch.OPS:
        print("  {:<24} {}".format(op, dispatch.kernel_path(op) if torch.cuda.is_available() else "reference (no GPU)"))


if __name__ == "__main__":
    main()
