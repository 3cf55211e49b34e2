"""Data-parallel plumbing: the process group, rank 0 first, and what the ranks must agree on.

Launched by torchrun, a run joins the group (NCCL on GPUs, gloo on CPU); a plain `tmt train` is
rank 0 of 1, and every helper here is then a no-op.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
from dataclasses import dataclass
from typing import Any, Iterator, NoReturn

import numpy as np
import torch
import torch.distributed as dist

log = logging.getLogger("transformer_mt")

# Whether this process joined a torchrun group (init_distributed): exit_process then skips Python's
# finalization.
_joined = False


@dataclass(frozen=True)
class Dist:
    """This process's place in the group: rank, world size, local rank (its GPU on a node)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Rank 0 logs, writes events and checkpoints."""
        return self.rank == 0


def init_distributed(device: str) -> Dist:
    """Join the process group when launched by torchrun (WORLD_SIZE > 1); otherwise rank 0 of 1."""
    global _joined
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        use_cuda = torch.cuda.is_available() and device in ("auto", "cuda")
        dist.init_process_group("nccl" if use_cuda else "gloo")
        _joined = True
    if not dist.is_initialized():
        return Dist()
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def leave_distributed(clean: bool) -> None:
    """Leave the process group at the end of a run: after a clean run the ranks first wait for each
    other, so that none goes on (and exits) while rank 0 still writes or another rank still
    talks to it."""
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End the process with `code`; a process that joined a torchrun group skips Python's
    finalization. Its gloo worker threads outlive the group (DDP keeps a reference to it) and may
    still be freeing the tensors of the last collectives, which takes the GIL; a thread that takes
    the GIL while the interpreter finalizes is unwound mid-destructor and the rank aborts (SIGABRT,
    "terminate called without an active exception", in about 1 of 100 two-rank runs). The run has
    closed its files by then: only logging and stdio are flushed here."""
    if not _joined:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing to keep
            stream.flush()
    os._exit(code)


def rank_device(d: Dist, device: torch.device) -> torch.device:
    """Under DDP on GPUs, each process takes the GPU of its local rank."""
    if device.type == "cuda" and d.world > 1:
        device = torch.device("cuda", d.local_rank)
        torch.cuda.set_device(device)
    return device


@contextlib.contextmanager
def rank_zero_first(d: Dist) -> Iterator[None]:
    """Rank 0 runs the block first (e.g. writes a cache); the other ranks run it after (and read
    it)."""
    if d.world > 1 and not d.main:
        dist.barrier()
    yield
    if d.world > 1 and d.main:
        dist.barrier()


def seed_everything(seed: int, rank: int = 0) -> None:
    """Seed Python's, NumPy's and torch's generators with seed + rank: each data-parallel rank draws
    its own dropout masks (alike, they would drop the same units on every rank's batch), and rank 0
    draws what one process would. What the ranks must share does not come from these streams: the
    batch order is a function of (seed, epoch) and DDP broadcasts rank 0's initial weights."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def agree(d: Dist, device: torch.device, *flags: bool) -> tuple[bool, ...]:
    """Flags that any rank raised, seen by every rank (one tiny all-reduce under DDP, and a host
    sync: call it at log and validation steps, not every step; with one process it is free)."""
    if d.world == 1:
        return flags
    t = torch.tensor([float(f) for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(bool(x) for x in t.tolist())


def agree_min(d: Dist, device: torch.device, value: int) -> int:
    """The smallest of the ranks' values, seen by every rank (a plan that all ranks must share)."""
    if d.world == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def global_sum(d: Dist, t: torch.Tensor) -> float:
    """A device scalar summed over ranks, as a Python float (a host sync)."""
    if d.world > 1:
        t = t.clone()
        dist.all_reduce(t)
    return t.item()


def rng_state() -> dict[str, Any]:
    """Every random generator the loop touches, as plain data that weights_only loading accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def gathered_rng(d: Dist) -> Any:
    """This process's RNG states, or every rank's (a list) under DDP, for a checkpoint. Every rank
    must call it."""
    if d.world == 1:
        return rng_state()
    states: list[Any] = [None] * d.world
    dist.all_gather_object(states, rng_state())
    return states


def restore_rng(d: Dist, saved: Any) -> bool:
    """Set this rank's RNG states from a checkpoint's; False when they were saved by another number
    of processes (they are then reused round-robin, and the random streams differ from an unbroken
    run)."""
    same = True
    if isinstance(saved, list):  # saved under DDP: one state per rank
        same = len(saved) == d.world
        saved = saved[d.rank % len(saved)]
    set_rng_state(saved)
    if not same:
        log.warning(
            "resuming with %d processes from another number: random streams will differ", d.world
        )
    return same
