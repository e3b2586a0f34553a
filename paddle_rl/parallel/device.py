"""The device each process computes on.

Under `paddle.distributed.launch` on a GPU machine the launcher gives each process its GPU in FLAGS_selected_gpus
(one index per process; all of the node's when a single process is started, of which Paddle uses the first) and
its local rank in PADDLE_LOCAL_RANK. `rank_device` reads those (a pure function of the environment, so the choice
can be checked anywhere); `select_device` makes it Paddle's device before any tensor is created. On a CPU build,
or with no GPU visible, every process computes on the CPU and the collectives run on gloo; on a CUDA build
`init_parallel_env` picks NCCL (parallel/topology.py).
"""
import logging
import os
from typing import Mapping

import paddle

from .topology import TopologyError

logger = logging.getLogger("paddle_rl")


def rank_device(env: Mapping[str, str], gpus: int) -> str:
    """'gpu:<index>' or 'cpu' for a process started with environment `env` on a machine with `gpus` visible GPUs
    (0 on a CPU build). The launcher's FLAGS_selected_gpus wins, else the local rank, else GPU 0."""
    if gpus <= 0:
        return "cpu"
    selected = str(env.get("FLAGS_selected_gpus", "") or "").strip()
    source = f"FLAGS_selected_gpus={selected}"
    try:
        if selected:
            index = int(selected.split(",")[0])
        else:
            local = str(env.get("PADDLE_LOCAL_RANK", "") or "").strip()
            index, source = (int(local), f"PADDLE_LOCAL_RANK={local}") if local else (0, "a single process")
    except ValueError:
        raise TopologyError(f"{source}: expected a GPU index") from None
    if not 0 <= index < gpus:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        raise TopologyError(f"{source} asks for gpu:{index}, but {gpus} GPU(s) are visible"
                            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
                            + "; start at most one process per GPU (--nproc_per_node)")
    return f"gpu:{index}"


def visible_gpus() -> int:
    if not paddle.is_compiled_with_cuda():
        return 0
    return paddle.device.cuda.device_count()


def select_device(env: Mapping[str, str] = None) -> str:
    """Set this process's Paddle device from its environment (rank_device); returns it."""
    device = rank_device(os.environ if env is None else env, visible_gpus())
    paddle.set_device(device)
    if device != "cpu":
        logger.info("device: %s", device)
    return device
