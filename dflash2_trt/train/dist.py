"""Devices, dtypes and processes for ``make-data``, ``train`` and ``eval-tau`` (docs/training.md).

One process by default; many through torchrun, the standard launcher of ``torch.distributed``::

    torchrun --nproc_per_node 8 -m dflash2_trt.cli train --device cuda --dtype bf16 ...

torchrun sets ``WORLD_SIZE`` / ``RANK`` / ``LOCAL_RANK`` (and the rendezvous); :func:`setup` reads them, joins
the process group (NCCL on CUDA, gloo on a CPU) and gives every process its device: ``cuda`` becomes
``cuda:LOCAL_RANK``. Multi-node is torchrun's own flags (``--nnodes``, ``--node_rank``, ``--rdzv_backend c10d
--rdzv_endpoint HOST:PORT --rdzv_id JOB``); nothing here is node-aware.

Vocabulary: ``vocabulary.DTYPES`` (the target's dtype; the drafter runs under autocast to it with fp32 master weights
and an fp32 loss). Importing this module needs no torch (``--help`` on a base install).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.vocabulary import DTYPES  # --dtype: the frozen target's (taps, labels); the drafter autocasts to it

_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
#: a collective waits this long for the slowest rank (rank 0 writes self-instructions, evaluates, checkpoints)
TIMEOUT = datetime.timedelta(hours=2)


def torch_dtype(name: str):  # noqa: ANN201 - torch.dtype (lazy torch)
    import torch

    if name not in _TORCH_NAMES:
        raise DFlash2Error(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, _TORCH_NAMES[name])


def check_device(spec: str):  # noqa: ANN201 - torch.device
    """``cpu`` / ``cuda`` / ``cuda:N`` -> torch.device, or one line saying why not (CUDA absent, index out of
    range)."""
    import torch

    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this PyTorch has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise DFlash2Error(f"--device {spec}: CUDA is not available ({why}; torch {torch.__version__}); "
                               f"use --device cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise DFlash2Error(f"--device {spec}: only {n} CUDA device(s) visible")
    elif dev.type != "cpu":
        raise DFlash2Error(f"--device must be cpu, cuda or cuda:N, got {spec!r}")
    return dev


@dataclass
class Dist:
    """This process's place in the run. world 1 = no process group (every collective is a no-op)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: object = None  # torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as td

            td.barrier()

    def all_reduce_sum(self, t):  # noqa: ANN001, ANN201 - torch.Tensor, in place, returned
        if self.world > 1:
            import torch.distributed as td

            td.all_reduce(t, op=td.ReduceOp.SUM)
        return t

    def gather_objects(self, obj: object) -> list:
        """Every rank's ``obj`` (picklable, small), in rank order, on every rank."""
        if self.world == 1:
            return [obj]
        import torch.distributed as td

        out: list = [None] * self.world
        td.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as td

            if td.is_initialized():
                td.destroy_process_group()


def setup(device: str = "cpu") -> Dist:
    """Join torchrun's process group when it started us (``WORLD_SIZE`` > 1), else a one-process run.

    ``--device cuda`` under torchrun takes ``cuda:LOCAL_RANK``; an explicit ``cuda:N`` with several processes
    is refused (two ranks would share one GPU)."""
    import torch

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dev = check_device(device)
    if world > 1 and dev.type == "cuda":
        if dev.index is not None:
            raise DFlash2Error(f"--device {device} under torchrun: pass --device cuda (each process takes "
                               f"cuda:LOCAL_RANK)")
        dev = check_device(f"cuda:{local}")
    if dev.type == "cuda":
        if dev.index is None:  # set_device needs an index: plain "cuda" is the current device
            dev = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(dev)
    d = Dist(rank, world, local, dev)
    if world > 1:
        import torch.distributed as td

        if not td.is_initialized():
            td.init_process_group("nccl" if dev.type == "cuda" else "gloo", timeout=TIMEOUT,
                                  **({"device_id": dev} if dev.type == "cuda" else {}))
    return d


def autocast(device, dtype_name: str):  # noqa: ANN001, ANN201 - a context manager
    """The drafter's forward under autocast to the target's dtype (fp32: none). Master weights stay fp32; the
    loss is computed in fp32 (its logits are cast up)."""
    import torch

    if dtype_name == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch_dtype(dtype_name))
