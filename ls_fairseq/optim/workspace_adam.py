"""The workspace Adam: fairseq's adam over one contiguous parameter workspace, as a
``torch.optim.Optimizer`` (no fairseq needed; ``ls_fairseq.optim.ls_adam`` wraps it as fairseq's
``--optimizer ls_adam``).

At construction every parameter's storage moves into one flat buffer (its ``.data`` becomes a view
of it) and every gradient into a second one, so a step is one ``ops.adam_step`` over the whole
model. Semantics are fairseq's adam: AdamW-style decoupled weight decay, bias correction, math in
fp32. Outside fairseq::

    opt = WorkspaceAdam(model.parameters(), lr=1e-3)
    loss.backward(); opt.step(); opt.zero_grad()

``ops.workspace.accumulate_in_place(opt.workspace.params)`` lets the ops' backwards add gradients
into the workspace themselves (fairseq's ls_adam does this unless torch's DistributedDataParallel
watches the gradients); without it autograd adds them into the workspace's views.
"""
import torch

from ls_fairseq import ops

ALIGN = 16  # elements: every parameter's view starts 32-byte aligned (fp16) or 64-byte (fp32)


def padded(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Workspace:
    """Flat parameter and gradient buffers; each parameter and its gradient become views."""

    def __init__(self, params):
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                "ls_adam: all parameters must share one dtype and device, got dtypes {} on devices {}".format(
                    sorted(str(d) for d in dtypes), sorted(str(d) for d in devices)
                )
            )
        self.params = params
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += padded(p.numel())
        dtype, device = params[0].dtype, params[0].device
        self.param = torch.zeros(total, dtype=dtype, device=device)
        self.grad = torch.zeros(total, dtype=dtype, device=device)
        with torch.no_grad():
            for p, off in zip(params, self.offsets):
                view = self.param[off : off + p.numel()].view_as(p)
                view.copy_(p.data)
                p.data = view
                if p.grad is not None:
                    self.grad[off : off + p.numel()].view_as(p).copy_(p.grad)
        self.attach_grads()

    def attach_grads(self):
        for p, off in zip(self.params, self.offsets):
            p.grad = self.grad[off : off + p.numel()].view_as(p)

    def zero_grad(self):
        self.grad.zero_()
        self.attach_grads()

    def flat_size(self):
        """The size of a workspace over one parameter, these parameters' flat concatenation (fairseq's
        FP16Optimizer hands ls_adam that one under --fp16)."""
        return padded(sum(p.numel() for p in self.params))

    def to_flat(self, t):
        """``t``, laid out as this workspace, in the layout of the workspace over the flat concatenation:
        each parameter's elements follow the previous one's, the padding comes at the end."""
        return torch.cat([t[off : off + p.numel()] for p, off in zip(self.params, self.offsets)] + [
            t.new_zeros(self.flat_size() - sum(p.numel() for p in self.params))
        ])

    def from_flat(self, t):
        """The inverse of ``to_flat``: ``t``, laid out as the flat concatenation, in this workspace's layout."""
        out = t.new_zeros(self.param.numel())
        start = 0
        for p, off in zip(self.params, self.offsets):
            out[off : off + p.numel()] = t[start : start + p.numel()]
            start += p.numel()
        return out


class WorkspaceAdam(torch.optim.Optimizer):
    supports_memory_efficient_fp16 = True
    supports_flat_params = True
    supports_step_with_scale = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fp32_master=False,
                 stochastic_rounding=False):
        params = [p for p in params if p.requires_grad]
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        if len(self.param_groups) != 1:
            raise ValueError("ls_adam: one parameter group expected, got {}".format(len(self.param_groups)))
        self.workspace = Workspace(self.param_groups[0]["params"])
        n = self.workspace.param.numel()
        device = self.workspace.param.device
        self.exp_avg = torch.zeros(n, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=torch.float32, device=device)
        self.master = None
        if fp32_master and self.workspace.param.dtype != torch.float32:
            self.master = self.workspace.param.float()
        low_precision = self.workspace.param.dtype in (torch.float16, torch.bfloat16)
        self.stochastic_rounding = stochastic_rounding and low_precision and self.master is None
        self.num_steps = 0
        self.grads_reduced = False

    def zero_grad(self, set_to_none=False):
        self.workspace.zero_grad()
        self.grads_reduced = False

    @torch.no_grad()
    def step(self, closure=None, scale=1.0, device_decision=None):
        """One update of the whole workspace; gradients are divided by ``scale`` inside it.

        ``device_decision``: (grad_scale, step, noop_flag) device scalars of a step
        decided on the device (ops.scaled_grad_norm); they replace 1 / scale, the
        host's step count and the always-taken step."""
        loss = closure() if closure is not None else None
        group = self.param_groups[0]
        self.num_steps += 1
        grad_scale, step, noop_flag = device_decision or (1.0 / scale, self.num_steps, None)
        ops.adam_step(
            self.workspace.param,
            self.workspace.grad,
            self.exp_avg,
            self.exp_avg_sq,
            lr=group["lr"],
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
            grad_scale=grad_scale,
            master=self.master,
            noop_flag=noop_flag,
            stochastic_rounding=self.stochastic_rounding,
        )
        return loss

    def state_dict(self, flat=False):
        """Adam's step count, moments and, where kept, the fp32 master copy, as flat tensors in this
        workspace's layout (one entry per parameter in ``param_groups``); ``flat``: in the layout of a
        workspace over the parameters' flat concatenation, as ls_adam under fairseq's FP16Optimizer
        (--fp16) writes them."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        groups[0]["params"] = [0] if flat else list(range(len(self.workspace.params)))
        state = {"step": self.num_steps, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        if self.master is not None:
            state["master"] = self.master
        if flat:
            state = {k: self.workspace.to_flat(v) if torch.is_tensor(v) else v for k, v in state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict):
        """Reads what ``state_dict`` writes, in either layout. A saved master copy is the parameters'
        exact value: the master copy takes it, or, where the workspace holds fp32 parameters itself
        (fairseq's FP16Optimizer's fp32 copy), the parameters. Without one a master copy is rebuilt
        from the parameters, as fairseq's FP16Optimizer builds its fp32 copy."""
        state = state_dict["state"]
        saved_params = sum(len(g["params"]) for g in state_dict["param_groups"])
        ws = self.workspace
        unknown = set(state) - {"step", "exp_avg", "exp_avg_sq", "master"}
        if unknown:
            raise ValueError(
                "ls_adam: the optimizer state in this checkpoint holds {}, which ls_adam does not write; use "
                "--reset-optimizer to start a fresh optimizer".format(", ".join(sorted(map(str, unknown))))
            )
        if saved_params == 1 < len(ws.params) and state["exp_avg"].numel() == ws.flat_size():
            state = {k: ws.from_flat(v) if torch.is_tensor(v) else v for k, v in state.items()}
        if state["exp_avg"].numel() != self.exp_avg.numel():
            raise ValueError(
                "ls_adam: the optimizer state in this checkpoint ({} elements over {} parameters) does not match "
                "this model's workspace ({} elements over {} parameters, or {} as one flat parameter); use "
                "--reset-optimizer to start a fresh optimizer".format(
                    state["exp_avg"].numel(), saved_params, self.exp_avg.numel(), len(ws.params), ws.flat_size()
                )
            )
        self.num_steps = int(state["step"])
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        if "master" in state and self.master is not None:
            self.master.copy_(state["master"])
        elif "master" in state and ws.param.dtype == torch.float32:
            ws.param.copy_(state["master"])
        elif self.master is not None:
            self.master.copy_(ws.param)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
