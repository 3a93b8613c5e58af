"""Where P3's ceiling lies: W1 at n=1000, 32 ops, one thread, with inductor.

    python benchmarks/w1_ceiling.py [--threads N]

Times, side by side in one process, eager and torch.compile (the same
inductor kernels fastlazy's inductor backend gets) on three programs over
the nine 1000x1000 inputs:

- the W1 chain itself (8 of its 32 ops are divisions);
- the same chain with every division made a multiplication: what the
  fused kernel costs when division is not its bottleneck;
- the sum of the nine inputs: reading them and writing one output, the
  least any fused kernel of this workload can cost.

eager's time over the last line is the best speedup any fusion can reach.
The bench runs every contender at one intra-op thread; --threads runs both
sides here at N.
"""
import argparse

import torch

import workloads


def chain_with_muls(a, b, c, d, e, f, g, h, i):
    r = a.add(b).mul(c).mul(d).add(e).sub(f).mul(g).mul(h).add(i)
    for _ in range(3):
        r = r.sub(b).mul(c).mul(d).add(e).sub(f).mul(g).mul(h).add(i)
    return r


def read_only(a, b, c, d, e, f, g, h, i):
    return a + b + c + d + e + f + g + h + i


def best_ms(fn, args, calls=20, rounds=5):
    for _ in range(3):
        fn(*args)
    return workloads.best_per_call(fn, args, calls, rounds) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    torch.set_num_threads(parser.parse_args().threads)
    args = workloads.inputs(1000)
    eager_chain = best_ms(workloads.chain(32), args, calls=5)
    print(f"eager W1 chain, 32 ops: {eager_chain:.2f} ms")
    for name, fn in [("W1 chain, 32 ops", workloads.chain(32)),
                     ("divisions made multiplications", chain_with_muls),
                     ("sum of the 9 inputs (memory floor)", read_only)]:
        compiled = torch.compile(fn)
        ms = best_ms(compiled, args)
        print(f"torch.compile {name}: {ms:.3f} ms, eager chain / this = {eager_chain / ms:.1f}x")


if __name__ == "__main__":
    main()
