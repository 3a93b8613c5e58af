"""DistributedDataParallel over gloo, two processes on this machine, with
lazy forward passes: losses and parameters equal single-process eager
training on the same data (the path users take when they outgrow one
machine)."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import fastlazy

WORLD = 2
STEPS = 4
BATCH = 8          # per rank


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.SiLU(),
                         nn.Linear(16, 3))


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(WORLD * BATCH, 6, generator=g),
             torch.randint(0, 3, (WORLD * BATCH,), generator=g)) for _ in range(STEPS)]


def train_rank(rank, store, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    fastlazy.enable()
    ddp = nn.parallel.DistributedDataParallel(model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches():
        shard = slice(rank * BATCH, (rank + 1) * BATCH)
        out = ddp(x[shard].to("lazy"))
        assert type(out) is fastlazy.LazyTensor
        loss = nn.functional.cross_entropy(out, y[shard])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.save({"losses": losses, "params": [p.detach() for p in ddp.module.parameters()],
                "fallbacks": dict(fastlazy.metrics.fallbacks_by_op)},
               os.path.join(out_dir, f"rank{rank}.pt"))
    # Both ranks reach here before either tears its group down: a rank that
    # closes its gloo connections while the other still holds them can make
    # the other's gloo thread throw, and the process abort ("terminate
    # called without an active exception"), about once in ten runs.
    dist.barrier()
    dist.destroy_process_group()


def eager_reference():
    """One process, the full batch: the mean of the ranks' shard losses is
    the full-batch loss, so the gradients DDP averages are these."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    shard_losses = []
    for x, y in batches():
        out = net(x)
        per_rank = [nn.functional.cross_entropy(out[r * BATCH:(r + 1) * BATCH],
                                                y[r * BATCH:(r + 1) * BATCH])
                    for r in range(WORLD)]
        opt.zero_grad()
        (sum(per_rank) / WORLD).backward()
        opt.step()
        shard_losses.append([l.item() for l in per_rank])
    return shard_losses, [p.detach() for p in net.parameters()]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not built")
def test_ddp_gloo_two_processes_match_eager(tmp_path):
    store = tmp_path / "store"
    mp.spawn(train_rank, args=(str(store), str(tmp_path)), nprocs=WORLD, join=True)
    want_losses, want_params = eager_reference()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert result["losses"] == pytest.approx([step[rank] for step in want_losses],
                                                 rel=1e-5)
        for got, want in zip(result["params"], want_params):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert not result["fallbacks"], result["fallbacks"]
