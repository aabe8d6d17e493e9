"""Process groups of one tensor-parallel engine: which device each rank uses, the two groups it
joins, and how long a collective may wait.

* the **compute group** (``TPGroup.group``): the device's backend as ``torch.distributed`` picks it
  (``get_default_backend_for_device``: NCCL on NVIDIA, XCCL on Intel GPUs, gloo on the CPU), with
  ``PORTATTN_TP_TIMEOUT_S`` (default 300 s) as the longest a collective of the forward may wait: a
  rank that stops answering makes the others' step fail after at most that long;
* the **control group** (``TPGroup.cpu_group``): gloo, on which rank 0 broadcasts each step's batch
  and the ranks check in once loaded. Rank 0's collectives on it are bounded by the same
  ``PORTATTN_TP_TIMEOUT_S`` (a rank that stops reading makes rank 0's broadcast fail, whatever the
  step's size: a gloo send waits for the receiver to take it); the other ranks wait on it between
  requests for as long as the engine is idle (their timeout is :data:`IDLE_TIMEOUT`). A rank that
  dies closes its connections, which ends any wait at once. The check-in after loading waits up to
  :data:`START_TIMEOUT`, as loading may take long.

The default process group (joined with :data:`START_TIMEOUT`, for ranks that take a while to start)
only serves to make these two.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from ...distributed.group import TPGroup

TIMEOUT_ENV = "PORTATTN_TP_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0
IDLE_TIMEOUT = timedelta(days=7)
START_TIMEOUT = timedelta(minutes=10)


def step_timeout() -> timedelta:
    value = os.environ.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"expected {TIMEOUT_ENV} to be a positive number of seconds, got {value!r}")
    return timedelta(seconds=seconds)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of the process with ``local_rank`` on its host: the CPU for a CPU engine, else the
    ``local_rank``-th device after the configured one (``cuda`` and ``cuda:0`` both start at 0)."""
    if device.type == "cpu":
        return device
    return torch.device(device.type, (device.index or 0) + local_rank)


def use_device(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator (collectives and kernels launch there)."""
    if device.type != "cpu":
        torch.accelerator.set_device_index(device.index)


def init_groups(device: torch.device, rank: int, world_size: int, store: dist.Store | None = None) -> TPGroup:
    """Join the default process group (through ``store``, or the ``env://`` variables torchrun sets)
    and make the compute and control groups; returns this rank's :class:`TPGroup`."""
    backend = dist.get_default_backend_for_device(device)
    kwargs = dict(store=store) if store is not None else dict(init_method="env://")
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=START_TIMEOUT, **kwargs)
    return make_groups(device, rank, world_size)


def make_groups(device: torch.device, rank: int, world_size: int) -> TPGroup:
    """The compute and control groups over every rank of the default process group. One all-reduce
    on the device builds the compute group's communicator now: a captured graph cannot build it."""
    compute = dist.new_group(backend=dist.get_default_backend_for_device(device), timeout=step_timeout())
    # A group's timeout is each process's own: rank 0 never waits longer than a step may take.
    control = dist.new_group(backend="gloo", timeout=step_timeout() if rank == 0 else IDLE_TIMEOUT)
    dist.all_reduce(torch.zeros(1, device=device), group=compute)
    return TPGroup(rank, world_size, compute, control)


def check_groups(tp: TPGroup) -> None:
    """A barrier over the control group, made by each rank once its engine is built; waits up to
    :data:`START_TIMEOUT` (rank 0's error names the ranks that did not arrive)."""
    dist.monitored_barrier(group=tp.cpu_group, timeout=START_TIMEOUT, wait_all_ranks=True)


def destroy_groups() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def broadcast_message(message: object, tp: TPGroup) -> object:
    """Rank 0's ``message`` on every rank, over the control group (pickled)."""
    box = [message if tp.rank == 0 else None]
    dist.broadcast_object_list(box, src=0, group=tp.cpu_group)
    return box[0]
