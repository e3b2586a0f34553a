"""Two nodes, simulated on one machine: two `python -m paddle.distributed.launch --nnodes 2 --master
127.0.0.1:PORT --nproc_per_node 1` commands (one rank each, gloo on CPU) train data parallel 2 like one process,
and a run whose nodes do not share output_dir stops at start-up (docs/reliability.md).

Checkpoints need one output_dir for every rank: each rank writes its part of checkpoint-N into rank 0's temporary
folder, and `resume_from_checkpoint: auto` reads the folder on every rank. RLTrainer checks it before any model
loads (checkpoint.check_shared_folder: rank 0 writes a file with a random name and content, every rank must read
it in its own output_dir).
"""
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from test_dead_rank import MARKER, marked_pids, run_marker  # noqa: F401 (a fixture)
from test_parallel import PLUGIN, assert_parity, run_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_SHARED = (r"error: output_dir is not one folder shared by every rank: rank 1 \(host [^)]+\) does not see in "
              r"(\S+) the file \.shared-folder-check-[0-9a-f]{32} that rank 0 \(host [^)]+\) wrote into (\S+) "
              r"\(it looked for 5 s\)\. Every rank writes its part of each checkpoint into output_dir and resumes "
              r"from it: give every node the same output_dir, on a file system that all nodes mount")


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("two-nodes") / "rewards.py"
    path.write_text(PLUGIN)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(micro, plugin, out_dirs, log_root, marker, timeout=300):
    """Start one launcher per node (node i writes into out_dirs[i]); wait for both: [(exit status, output)]."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, **{MARKER: marker})
    env.pop("OMP_NUM_THREADS", None)
    procs = []
    for node, out_dir in enumerate(out_dirs):
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nnodes", "2", "--master", f"127.0.0.1:{port}",
               "--nproc_per_node", "1", "--log_dir", os.path.join(log_root, f"log-node{node}"),
               os.path.join(ROOT, "paddle_rl", "run_rl.py"), "/dev/null",
               *run_overrides(micro, out_dir, plugin, data_parallel_degree=2)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    deadline = time.time() + timeout
    results = []
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"the two nodes did not end within {timeout} s")
        results.append((proc.returncode, output))
    return results


def test_two_nodes_train_like_one_process(micro, plugin, tmp_path, run_marker):
    """Data parallel 2 over two launches sharing output_dir: metrics and final weights within test_parallel's
    tolerances of one process; checkpoint-3 holds the model and both ranks' parts."""
    from paddle_rl.config import load_config
    from paddle_rl.trainer import RLTrainer
    single = str(tmp_path / "single")
    RLTrainer(load_config(None, run_overrides(micro, single, plugin))).train()
    shared = str(tmp_path / "shared")
    start = time.time()
    results = two_nodes(micro, plugin, [shared, shared], str(tmp_path), run_marker)
    for code, output in results:
        assert code == 0, output[-3000:]
    print(f"two nodes: {time.time() - start:.1f} s")
    assert_parity(single, shared)
    files = sorted(os.listdir(os.path.join(shared, "checkpoint-3")))
    assert {"model.safetensors", "trainer_state.json", "optimizer.rank00000.json", "optimizer.rank00001.json",
            "optimizer.rank00000.safetensors", "optimizer.rank00001.safetensors", "rng_state.rank00000.json",
            "rng_state.rank00001.json"} <= set(files), files
    assert not [f for f in os.listdir(shared) if f.startswith(".")]  # the check's file is gone


def test_two_nodes_without_a_shared_output_dir_stop_at_start_up(micro, plugin, tmp_path, run_marker):
    """Each node with its own output_dir: both commands exit with status 2 and the same one-line error naming
    the rank, the two folders and what to do, before any model loads (no step, no checkpoint)."""
    dirs = [str(tmp_path / "node0-out"), str(tmp_path / "node1-out")]
    start = time.time()
    results = two_nodes(micro, plugin, dirs, str(tmp_path), run_marker)
    print(f"two nodes, separate output_dir: ended after {time.time() - start:.1f} s")
    for code, output in results:
        assert code == 2, output[-3000:]
        found = re.search(NOT_SHARED, output)
        assert found, output[-3000:]
        assert sorted(found.groups()) == sorted(dirs)
        assert "step 1/" not in output and "loaded" not in output
    print(found.group(0))
    assert not marked_pids(run_marker)
    for d in dirs:  # rank 0 made its folder and removed its file; nothing else was written
        assert not os.path.exists(d) or os.listdir(d) == [], os.listdir(d)


def test_checkpoint_needs_every_rank_part_in_one_folder(micro, tmp_path):
    """The save's own guard (in process, one rank standing for its place among two): rank 1 does not write into a
    temporary folder it cannot see (paddle.save would create one), and rank 0 does not rename a folder that
    lacks another rank's part; either stops with CheckpointError and leaves no checkpoint-N."""
    from micro_model import micro_overrides
    from paddle_rl.config import load_config
    from paddle_rl.trainer import RLTrainer
    from paddle_rl.trainer.checkpoint import CheckpointError, save_checkpoint
    trainer = RLTrainer(load_config(None, micro_overrides(micro, str(tmp_path / "run"), max_steps=1,
                                                           do_eval=False)))
    args = (trainer.actor, trainer.tokenizer_dir, trainer.optimizer, trainer.scheduler, {"sampler": {}})
    out = str(tmp_path / "out")
    os.makedirs(out)
    with pytest.raises(CheckpointError, match=r"checkpoint-1 could not be written: FileNotFoundError: "
                                              r".*\.tmp-checkpoint-1, created by rank 0, is not visible to this "
                                              r"rank \(is output_dir one folder that every node shares\?\) \(rank 1\)"):
        save_checkpoint(out, 1, *args, rank=1, world_size=2)
    with pytest.raises(CheckpointError, match=r"checkpoint-1 could not be written: FileNotFoundError: "
                                              r"rng_state.rank00001.json, optimizer.rank00001.json missing from "
                                              r".*\.tmp-checkpoint-1 after every rank wrote its part"):
        save_checkpoint(out, 1, *args, rank=0, world_size=2)
    assert os.listdir(out) == []
