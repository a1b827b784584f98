"""ls_fairseq: LightSeq2's fused Transformer training, as a library and as a fairseq plugin.

The core needs torch alone and changes nothing when imported: ``ls_fairseq.ops`` (the fused ops),
the layers, the workspace Adam (``ls_fairseq.optim.workspace_adam.WorkspaceAdam``, a
torch.optim.Optimizer) and the fused label-smoothed cross-entropy (``ls_fairseq.loss``).

The fairseq plugin is ``ls_fairseq.fairseq_plugin``, whose ``install()`` makes (and lists) every
change to fairseq and torch. It runs when fairseq imports this package for ``--user-dir
.../ls_fairseq`` (fairseq-train, fairseq-generate, fairseq-interactive), and only then: a plain
``import ls_fairseq`` installs nothing. fairseq imports a ``--user-dir`` package only when its name
is not yet in ``sys.modules``, so a process that imported ls_fairseq before fairseq reads
``--user-dir`` calls ``ls_fairseq.fairseq_plugin.install()`` itself (ls-fairseq-train does).
"""
import os
import sys

__version__ = "0.1.0"


def _imported_for_user_dir():
    """Whether fairseq's ``import_user_module`` (its ``--user-dir`` option) is importing this package,
    directly or through a --user-dir folder of hooks that imports it."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "import_user_module" and os.path.basename(os.path.dirname(code.co_filename)) == "fairseq":
            return True
        frame = frame.f_back
    return False


if _imported_for_user_dir():
    from ls_fairseq import fairseq_plugin  # noqa: F401 (installs the plugin)
