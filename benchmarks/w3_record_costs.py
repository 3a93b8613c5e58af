"""W3: what recording one call costs, for the ops real models call at every
layer (the tiered-engine issue's item 5: a signature-cache hit <= 1 us,
these ops <= 300 ns), beside eager running the same call.

Each op is called on LazyTensors with the model's eager weights beside
them, CALLS times a round, ROUNDS rounds, one intra-op thread; the figure is
the best round's time per call, the Python call itself included (a user's
code pays it in eager too).  Nothing runs: the pending nodes are dropped
between rounds by mark_step().  Eager operands are read by the C++ reader
(the step executor's extension) and, in a column of their own measured in
the same rounds, by torch's getters (the fallback where the extension is
not built).

    python benchmarks/w3_record_costs.py [--out FILE]
"""
from __future__ import annotations

import argparse
import pathlib

import torch
import torch.nn.functional as F

import fastlazy
import workloads
from fastlazy import _core, step_executor

CALLS = 2000
ROUNDS = 7
TARGET_NS = 300


def _cases():
    """(name, how it is recorded, a function of the inputs (x3, x4, q, ids,
    mask) making the call) for the layer ops of W4's models."""
    w, b = torch.randn(64, 64), torch.randn(64)
    ln_w, ln_b = torch.ones(64), torch.zeros(64)
    conv_w = torch.randn(8, 8, 3, 3)
    mean, var, bn_w, bn_b = torch.zeros(8), torch.ones(8), torch.ones(8), torch.zeros(8)
    table = torch.randn(100, 64)
    return [
        ("x.view(20, 64)", "view rule", lambda x3, x4, q, ids, mask: x3.view(20, 64)),
        ("x.reshape(2, 10, 4, 16)", "view rule", lambda x3, x4, q, ids, mask: x3.reshape(2, 10, 4, 16)),
        ("x.transpose(1, 2)", "view rule", lambda x3, x4, q, ids, mask: x3.transpose(1, 2)),
        ("q.permute(0, 2, 1, 3)", "view rule", lambda x3, x4, q, ids, mask: q.permute(0, 2, 1, 3)),
        ("F.linear(x, w, b)", "C rule", lambda x3, x4, q, ids, mask: F.linear(x3, w, b)),
        ("F.layer_norm(x, (64,), w, b)", "C rule",
         lambda x3, x4, q, ids, mask: F.layer_norm(x3, (64,), ln_w, ln_b)),
        ("F.softmax(x, -1)", "C rule", lambda x3, x4, q, ids, mask: F.softmax(x3, -1)),
        ("F.gelu(x)", "C rule", lambda x3, x4, q, ids, mask: F.gelu(x3)),
        ("F.embedding(ids, table)", "C rule", lambda x3, x4, q, ids, mask: F.embedding(ids, table)),
        ("F.scaled_dot_product_attention", "C rule",
         lambda x3, x4, q, ids, mask: F.scaled_dot_product_attention(q, q, q)),
        ("F.conv2d(x, w, None, 1, 1)", "C rule",
         lambda x3, x4, q, ids, mask: F.conv2d(x4, conv_w, None, 1, 1)),
        ("F.batch_norm (inference)", "C rule",
         lambda x3, x4, q, ids, mask: F.batch_norm(x4, mean, var, bn_w, bn_b, False)),
        ("F.hardtanh(x, 0.0, 6.0) (nn.ReLU6)", "C rule",
         lambda x3, x4, q, ids, mask: F.hardtanh(x4, 0.0, 6.0)),
        ("F.max_pool2d(x, 2)", "C rule", lambda x3, x4, q, ids, mask: F.max_pool2d(x4, 2)),
        ("F.adaptive_avg_pool2d(x, 1)", "C rule",
         lambda x3, x4, q, ids, mask: F.adaptive_avg_pool2d(x4, 1)),
        ("torch.flatten(x, 1)", "view rule", lambda x3, x4, q, ids, mask: torch.flatten(x4, 1)),
        ("x.expand(2, 8, 16, 16)", "view rule",
         lambda x3, x4, q, ids, mask: x4.expand(2, 8, 16, 16)),
        ("x.masked_fill(mask, 0.0)", "signature hit",
         lambda x3, x4, q, ids, mask: x3.masked_fill(mask, 0.0)),
    ]


def _recording(fn, args, reader) -> float:
    """Seconds per recorded call, eager operands read by `reader` (None:
    the getters), the pending nodes dropped after each round."""
    _core.set_tensor_reader(reader)
    return workloads.best_per_call(fn, args, CALLS, ROUNDS, fastlazy.mark_step)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/w3_record_costs.py",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x3 = torch.randn(2, 10, 64)
    eager = (x3, torch.randn(1, 8, 16, 16), torch.randn(2, 4, 10, 16),
             torch.randint(0, 100, (2, 10)), x3 > 0)
    reader = step_executor.tensor_reader()
    lines = [f"| call | recorded by | eager's call | fastlazy records it | with torch's getters "
             f"| <= {TARGET_NS} ns |", "|---|---|---|---|---|---|"]
    with fastlazy.enabled(), torch.no_grad():
        lazy = tuple(fastlazy.lazy(t) for t in eager)
        for name, how, fn in _cases():
            for _ in range(50):
                fn(*lazy)
            fastlazy.mark_step()
            with_getters = _recording(fn, lazy, None)
            recorded = _recording(fn, lazy, reader) if reader is not None else with_getters
            # (eager's run of the op itself, for scale: its kernel runs)
            eager_time = workloads.best_per_call(fn, eager, calls=200, rounds=3)
            lines.append(f"| `{name}` | {how} | {eager_time * 1e9:,.0f} ns "
                         f"| {recorded * 1e9:,.0f} ns | {with_getters * 1e9:,.0f} ns "
                         f"| {'yes' if recorded * 1e9 <= TARGET_NS else 'no'} |")
            print(lines[-1], flush=True)
    _core.set_tensor_reader(reader)
    if reader is None:
        lines.append("")
        lines.append(f"(no C++ reader: the step executor's extension is "
                     f"{step_executor.why_not()})")
    if args.out:
        pathlib.Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
