"""Each process's device under paddle.distributed.launch, from the launcher's environment (parallel/device.py)."""
import os
import subprocess
import sys

import paddle
import pytest

from paddle_rl.parallel.device import rank_device, select_device
from paddle_rl.parallel.topology import TopologyError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("env,gpus,device", [
    ({"PADDLE_LOCAL_RANK": "1", "FLAGS_selected_gpus": "1"}, 4, "gpu:1"),      # the launcher, one GPU each
    ({"PADDLE_LOCAL_RANK": "0", "FLAGS_selected_gpus": "3"}, 4, "gpu:3"),      # --devices 3,2: its choice wins
    ({"PADDLE_LOCAL_RANK": "0", "FLAGS_selected_gpus": "0,1,2,3"}, 4, "gpu:0"),  # one process, all GPUs
    ({"PADDLE_LOCAL_RANK": "2"}, 4, "gpu:2"),                                  # no selection: the local rank
    ({}, 2, "gpu:0"),                                                          # a single process
    ({"PADDLE_LOCAL_RANK": "1", "FLAGS_selected_gpus": "1"}, 0, "cpu"),        # a CPU build / no GPU visible
])
def test_each_rank_takes_its_gpu(env, gpus, device):
    assert rank_device(env, gpus) == device


def test_more_processes_than_gpus_is_an_error():
    with pytest.raises(TopologyError, match=r"PADDLE_LOCAL_RANK=2 asks for gpu:2, but 2 GPU\(s\) are visible "
                                            r"\(CUDA_VISIBLE_DEVICES=0,1\)"):
        rank_device({"PADDLE_LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1"}, 2)
    with pytest.raises(TopologyError, match="FLAGS_selected_gpus=x: expected a GPU index"):
        rank_device({"FLAGS_selected_gpus": "x"}, 2)


def test_the_launchers_own_environment(tmp_path):
    """Two processes of the real launcher (a CPU machine: it selects no GPU): on a 2-GPU machine they would take
    gpu:0 and gpu:1; here, with none visible, both compute on the CPU."""
    script = ("import os\nfrom paddle_rl.parallel.device import rank_device, select_device\n"
              "print('DEVICE', os.environ['PADDLE_TRAINER_ID'], rank_device(os.environ, 2), select_device(), "
              "flush=True)\n")
    path, log_dir = tmp_path / "probe.py", tmp_path / "log"
    path.write_text(script)
    done = subprocess.run([sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", "2",
                           "--log_dir", str(log_dir), str(path)], cwd=str(tmp_path),
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = []
    for name in sorted(os.listdir(log_dir)):
        with open(log_dir / name) as f:
            lines += [line.split()[1:] for line in f if line.startswith("DEVICE ")]
    assert sorted(lines) == [["0", "gpu:0", "cpu"], ["1", "gpu:1", "cpu"]]


def test_select_device_sets_paddles_device():
    assert select_device({"PADDLE_LOCAL_RANK": "1"}) == "cpu"  # this machine: no GPU
    assert paddle.get_device() == "cpu"
