"""Host time of one eager op call on a tiny CPU tensor: what dispatch costs a call (torch.compile
support must leave it as it is). For each op: the median over --repeats of the mean time per call
of --number calls, without autograd (no_grad) and with a parameter that requires a gradient
(forward only; autograd records the op).

  python scripts/bench_eager_overhead.py [--number 20000] [--repeats 7]
"""
import argparse
import statistics
import timeit

import torch

from ls_fairseq import ops


def cases():
    x = torch.randn(2, 4)
    w, b = torch.ones(4), torch.zeros(4)
    wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
    return [
        ("layer_norm", lambda: ops.layer_norm(x, w, b), lambda: ops.layer_norm(x, wg, bg)),
        ("bias_dropout_residual", lambda: ops.bias_dropout_residual(x, b, x),
         lambda: ops.bias_dropout_residual(x, bg, x)),
        ("bias_act_dropout", lambda: ops.bias_act_dropout(x, b), lambda: ops.bias_act_dropout(x, bg)),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--number", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("torch {}; us per call, median of {} repeats of {} calls".format(torch.__version__, args.repeats,
                                                                             args.number))
    print("{:<24} {:>8} {:>10}".format("op", "no_grad", "with grad"))
    for name, plain, recorded in cases():
        figures = []
        for fn, grad in ((plain, False), (recorded, True)):
            with torch.set_grad_enabled(grad):
                times = timeit.repeat(fn, number=args.number, repeat=args.repeats)
            figures.append(statistics.median(times) / args.number * 1e6)
        print("{:<24} {:>8.2f} {:>10.2f}".format(name, *figures))


if __name__ == "__main__":
    main()
