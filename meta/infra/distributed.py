"""``torchrun`` support shared by meta-training and CHC: the process group and the few collectives they use.

Without ``torchrun`` every helper is the single-process identity; under it the group uses NCCL with CUDA, else
gloo.  Gradients are averaged by hand, not by ``DistributedDataParallel``, whose all-reduce hooks cannot take part in
the double backward of a second-order meta-gradient (pytorch/pytorch issues 47562 and 63929): each rank computes its
tasks' exact meta-gradient and :func:`average_gradients` all-reduces ``.grad`` before the one optimiser step, as
learn2learn's distributed MAML example does.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Iterable, Sequence

import torch

# Ranks wait for each other at barriers while rank 0 fits UMAP/HDBSCAN or exports: that can take hours.
TIMEOUT = datetime.timedelta(hours=48)


def env_world_size() -> int:
    """``WORLD_SIZE`` as ``torchrun`` sets it (1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def init_from_env() -> bool:
    """Join the process group ``torchrun`` describes (NCCL on ``cuda:LOCAL_RANK``, else gloo); True when this call
    created it, False without ``torchrun`` or with a group already there."""
    import torch.distributed as dist

    if env_world_size() <= 1 or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend=backend, timeout=TIMEOUT)
    return True


def shutdown(created: bool) -> None:
    """Leave the process group if :func:`init_from_env` created it."""
    import torch.distributed as dist

    if created and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return torch.distributed.get_rank() if is_distributed() else 0


def world_size() -> int:
    return torch.distributed.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    """Rank 0 (or the only process): the one that writes files."""
    return rank() == 0


def barrier() -> None:
    if is_distributed():
        torch.distributed.barrier()


def _device() -> torch.device:
    """Where collectives' scratch tensors live: this rank's GPU under NCCL, else CPU."""
    if is_distributed() and torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard(items: Sequence, world: int, r: int) -> list:
    """Rank ``r``'s contiguous block of ``items``; ``len(items)`` must be a multiple of ``world``.

    Block order = rank order, so concatenating the ranks' blocks gives ``items`` back.
    """
    if len(items) % world:
        raise ValueError(f"{len(items)} items cannot be split evenly over {world} processes")
    per = len(items) // world
    return list(items[r * per : (r + 1) * per])


def average_gradients(params: Iterable[torch.nn.Parameter]) -> None:
    """Replace every ``p.grad`` by its mean over the ranks (one all-reduce for all tensors).

    A parameter whose gradient is ``None`` on every rank keeps ``None`` (as a single process would
    leave it); a ``None`` on some ranks only counts as zeros there.  The sum runs in float32.
    """
    if not is_distributed():
        return
    params = list(params)
    if not params:
        return
    dev = _device()
    parts = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1).to(dev, torch.float32)
        for p in params
    ]
    parts.append(torch.tensor([float(p.grad is not None) for p in params], device=dev))
    flat = torch.cat(parts)
    torch.distributed.all_reduce(flat)
    world = float(world_size())
    present = flat[flat.numel() - len(params) :].tolist()
    offset = 0
    for p, has in zip(params, present):
        block = flat[offset : offset + p.numel()]
        offset += p.numel()
        if has == 0.0:
            p.grad = None
            continue
        mean = (block / world).view_as(p).to(device=p.device, dtype=p.dtype)
        if p.grad is None:
            p.grad = mean
        else:
            p.grad.copy_(mean)


def mean_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """``values`` averaged over the ranks (every rank must pass the same keys)."""
    return {k: v / world_size() for k, v in sum_over_ranks(values).items()}


def sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """``values`` summed over the ranks (every rank must pass the same keys), in float64."""
    if not is_distributed():
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is True on at least one."""
    if not is_distributed():
        return bool(flag)
    t = torch.tensor([1.0 if flag else 0.0], device=_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item() > 0)


def gather_objects(obj: Any) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (picklable objects)."""
    if not is_distributed():
        return [obj]
    out: list = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out
