"""One run on several processes (DistributedDataParallel under ``torchrun``): who is who (rank 0 writes), the process
group and the wrapped model, and the reductions every rank must agree on, each returning its input on one process.
docs/running.md ("One run on several processes") describes the behaviour."""

from __future__ import annotations

import atexit
import inspect
import os
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from qtrain.errors import ConfigError

# torch is imported inside the functions: qtrain.config reads the world size (part of a run's identity) before the
# command line has been checked, when torch is not loaded yet
if TYPE_CHECKING:
    import torch
    from torch import nn

LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"the environment variable {name}={text!r} is not allowed: torchrun sets it to an "
                          "integer >= 0") from None


def world_size() -> int:
    """How many processes train this run (``WORLD_SIZE``; 1 without torchrun)."""
    return max(_env_int("WORLD_SIZE", 1), 1)


def active() -> bool:
    """True under torchrun with more than one process."""
    return world_size() > 1


def rank() -> int:
    return _env_int("RANK", 0) if active() else 0


def local_rank() -> int:
    return _env_int("LOCAL_RANK", 0) if active() else 0


def is_writer() -> bool:
    """Whether this process writes the run's files (rank 0)."""
    return rank() == 0


def check_launch(device: torch.device) -> torch.device:
    """Check torchrun's variables against ``device``; the device this rank trains on (``cuda:LOCAL_RANK`` on CUDA)."""
    if not active():
        return device
    import torch

    size = world_size()
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # what torchrun sets and the process group reads
        if name not in os.environ:
            raise ConfigError(f"WORLD_SIZE={size} is set but {name} is not: start several processes with "
                              "torchrun --nproc-per-node=N -m qtrain.cli ...")
    if not 0 <= rank() < size:
        raise ConfigError(f"the environment variable RANK={rank()} is not allowed with WORLD_SIZE={size} "
                          f"(allowed: 0 to {size - 1})")
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if local_rank() >= count:
        raise ConfigError(f"LOCAL_RANK={local_rank()} is not allowed with device=cuda: this machine has {count} CUDA "
                          f"device(s); start at most {count} processes per node (torchrun --nproc-per-node={count}), "
                          "or train on the CPU with device=cpu (gloo)")
    return torch.device("cuda", local_rank())


def setup(device: torch.device) -> None:
    """Join the process group (gloo on the CPU, nccl on CUDA) once per process; a no-op on one process."""
    if not active():
        return
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    atexit.register(dist.destroy_process_group)


def _comm_device() -> torch.device:
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def sum_floats(values: list[float]) -> list[float]:
    """Each value summed over ranks (float64); the values as given on one process."""
    if not active():
        return list(values)
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t)
    return t.tolist()


def sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place and return it (on one process: unchanged)."""
    if not active():
        return tensor
    import torch.distributed as dist

    dist.all_reduce(tensor)
    return tensor


def mean_over_samples(value: torch.Tensor, samples: int, total: int) -> torch.Tensor:
    """The mean over every rank's samples of ``value``, this rank's mean over its ``samples`` of ``total``."""
    if not active():
        return value
    return sum_(value.detach() * samples) / total


def broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (picklable)."""
    if not active():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (picklable)."""
    if not active():
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def wrap(model: nn.Module, device: torch.device, unused_parameters: bool) -> nn.Module:
    """``model`` in DistributedDataParallel (gradients averaged over ranks); ``model`` itself on one process.

    Buffers are synced from rank 0 once, not at every forward (BatchNorm statistics and running ranges stay each rank's
    until :func:`average_buffers`); ``unused_parameters`` for models whose forward may skip layers (DFQ's gates).
    """
    if not active():
        return model
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    ids = [device] if device.type == "cuda" else None
    if ddp_takes_forward_sync_buffers():
        return DistributedDataParallel(model, device_ids=ids, forward_sync_buffers=False,
                                       find_unused_parameters=unused_parameters)
    # torch before 2.13: broadcast_buffers=False also leaves the buffers out of DDP's first sync, so send them here
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    return DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False, find_unused_parameters=unused_parameters)


def ddp_takes_forward_sync_buffers() -> bool:
    """Whether this torch's DistributedDataParallel takes ``forward_sync_buffers`` (2.13 and later)."""
    from torch.nn.parallel import DistributedDataParallel

    return "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (or ``model``)."""
    return getattr(model, "module", model) if active() else model


def gradient_sync(model: nn.Module, sync: bool) -> Any:
    """A context for one backward: no gradient all-reduce where ``sync`` is False (accumulation micro-batches)."""
    return nullcontext() if sync or not hasattr(model, "no_sync") else model.no_sync()


def average_buffers(model: nn.Module) -> None:
    """Replace every floating-point buffer (BatchNorm statistics, running activation ranges) by its mean over ranks.

    Averaged in float64, so a buffer every rank holds alike (a weight density) comes back unchanged.
    """
    if not active():
        return
    import torch

    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers:
        return
    flat = sum_(torch.cat([b.detach().double().flatten() for b in buffers]).to(_comm_device())) / world_size()
    for buffer, part in zip(buffers, flat.split([b.numel() for b in buffers])):
        buffer.copy_(part.view_as(buffer))
