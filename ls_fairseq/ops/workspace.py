"""The gradient workspace: which parameters' gradients the ops' backwards add into ``.grad`` in place.

LightSeq2's layers write parameter gradients straight into the optimizer's
gradient workspace. autograd would compute each into a new tensor and then add
it to the existing ``.grad``: one more kernel, one more temporary and one more
autograd node per parameter and step. The contract has two sides:

- the optimizer (ls_adam) calls ``accumulate_in_place(params)`` for parameters
  whose ``.grad`` it keeps alive (views of its workspace) and whose gradients
  are taken only through ``.backward()`` in training, unless autograd hooks
  watch those gradients: torch's DistributedDataParallel learns that a gradient
  is ready from autograd's accumulation of it, so under it the optimizer leaves
  its parameters out;
- an op's backward asks ``grad_in_place(param)`` for each parameter: where it gets
  ``.grad``, it adds the parameter's gradient into it and gives autograd None
  (``for_autograd``); elsewhere the gradient goes back to autograd as usual, so
  ``torch.autograd.grad`` and other optimizers see nothing different.

A parameter stays held for as long as it lives.
"""
import weakref

_held = set()  # id() of every parameter held; each leaves the set when its parameter is freed


def accumulate_in_place(params):
    """Let the ops' backwards add the gradients of ``params`` into their ``.grad`` in place."""
    for p in params:
        if id(p) not in _held:
            _held.add(id(p))
            weakref.finalize(p, _held.discard, id(p))


def grad_in_place(param):
    """``param.grad`` when a backward should add ``param``'s gradient to it in place (``param``
    held, its ``.grad`` there with the parameter's dtype and shape, contiguous), else None."""
    grad = param.grad
    if (
        id(param) in _held
        and grad is not None
        and grad.dtype == param.dtype
        and grad.shape == param.shape
        and grad.is_contiguous()
    ):
        return grad
    return None


def for_autograd(grad, into):
    """What a backward returns for a parameter: None when its gradient went into ``into``."""
    return None if into is not None else grad
