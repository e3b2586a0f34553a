"""checkpoint-N/: the model in the Hugging Face layout + optimizer, scheduler, sampler, objective and RNG state.

Written into a temporary folder and renamed into place, so an interrupted save leaves the
previous checkpoints untouched and every checkpoint-N folder is complete.

Under several processes every rank calls save_checkpoint: rank 0 writes the (gathered) model and the
trainer state, every rank writes its own optimizer state (optimizer.rankNNNNN.json + .safetensors: a shard under
sharding / tensor / pipeline parallelism) and its random generators' states (rng_state.rankNNNNN.json), and
rank 0 renames the folder once all have written. So every rank needs the same output_dir (on several nodes: a
file system they all mount); check_shared_folder verifies it at start-up.

The Hugging Face weights are written in save_dtype; a bfloat16 checkpoint also holds the float32 weights
(master_weights.json + .safetensors) that a resumed run continues from, so resuming is exact either way.

Nothing in a checkpoint is pickled (state_files: safetensors + JSON), so resuming one runs no code from it.
Checkpoints written before that (optimizer*.pdopt, rng_state*.pdstate, pending_rollouts.pkl: paddle.save /
pickle) still resume, with one warning that they are unpickled.
"""
import contextlib
import json
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import socket
import time
from typing import Optional

import numpy as np
import paddle

from ..config import ConfigError
from ..models.pretrained import checkpoint_state, save_model
from . import faults
from .nonfinite import NonFiniteError, first_nonfinite_array
from .state_files import has_state, read_state, state_paths, write_state

logger = logging.getLogger("paddle_rl")
STATE_FILE = "trainer_state.json"
OPTIMIZER_STEM = "optimizer"             # optimizer.json + optimizer.safetensors (state_files)
RNG_STEM = "rng_state"                   # rng_state.json
PENDING_STEM = "pending_rollouts"        # the asynchronous rollout's requested batches
MASTER_STEM = "master_weights"           # a bfloat16 checkpoint's float32 weights (master_weights.safetensors)
LEGACY_OPTIMIZER_FILE = "optimizer.pdopt"  # older checkpoints: paddle.save (pickle)
LEGACY_RNG_FILE = "rng_state.pdstate"
LEGACY_PENDING_FILE = "pending_rollouts.pkl"
PREFIX = "checkpoint-"


def checkpoint_dirs(output_dir: str):
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = re.fullmatch(rf"{PREFIX}(\d+)", name)
        if m and os.path.isfile(os.path.join(output_dir, name, STATE_FILE)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return [path for _, path in sorted(found)]


def resolve_resume(spec: Optional[str], output_dir: str) -> Optional[str]:
    if not spec:
        return None
    if spec == "auto":
        dirs = checkpoint_dirs(output_dir)
        return dirs[-1] if dirs else None
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"resume_from_checkpoint: folder not found: {spec}")
    if not os.path.isfile(os.path.join(spec, STATE_FILE)):
        raise FileNotFoundError(f"resume_from_checkpoint: {os.path.join(spec, STATE_FILE)} not found")
    return spec


def seed_rngs(seed: int) -> None:
    """Seed the generators a checkpoint keeps (Python's random, NumPy's global one, Paddle's), so that code
    drawing from them (a reward function, say) repeats from run to run."""
    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


def rng_state() -> dict:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}


def paddle_rng_state() -> list:
    """Paddle's generators (one per device) as JSON: GeneratorState's own pickle state, (device, seed, offset,
    the engine's text), which is what paddle.save stored."""
    out = []
    for generator in paddle.get_rng_state():
        state = generator.__getstate__()
        if not (isinstance(state, tuple) and len(state) == 4 and all(isinstance(v, int) for v in state[:3])
                and isinstance(state[3], list)):
            raise TypeError(f"Paddle {paddle.__version__}: unexpected GeneratorState layout "
                            f"{[type(v).__name__ for v in state]}; cannot store the random generators")
        out.append({"device": state[0], "seed": state[1], "offset": state[2], "engine": bytes(state[3]).decode()})
    return out


def set_paddle_rng_state(saved: list, where: str) -> None:
    generator_type = type(paddle.get_rng_state()[0])
    states = []
    for entry in saved:
        try:
            state = generator_type.__new__(generator_type)
            state.__setstate__((int(entry["device"]), int(entry["seed"]), int(entry["offset"]),
                                list(entry["engine"].encode())))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{where}: a Paddle generator state that cannot be restored ({e})") from None
        states.append(state)
    paddle.set_rng_state(states)


def set_rng_state(rng: dict, path: str, rank: int = 0, world_size: int = 1) -> None:
    """This rank's generators as its save left them, from its own rng file (`rng`: trainer_state.json's, rank 0's
    Python and NumPy states, which a checkpoint written before the ranks kept their own states holds alone)."""
    host, device, where = rng, None, None
    for stem in dict.fromkeys((rng_stem(rank, world_size), RNG_STEM)):
        if has_state(path, stem):
            saved, where = read_state(path, stem), state_paths(path, stem)[0]
            host, device = saved["host"], saved["paddle"]
            break
    else:
        for name in dict.fromkeys((legacy_rng_file(rank, world_size), LEGACY_RNG_FILE)):
            if os.path.isfile(os.path.join(path, name)):
                saved = paddle.load(os.path.join(path, name))  # pickle: warn_pickled named it
                host, device = (saved["host"], saved["paddle"]) if isinstance(saved, dict) else (host, saved)
                break
    version, internal, gauss = host["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = host["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if where is not None:
        set_paddle_rng_state(device, where)
    elif device is not None:
        paddle.set_rng_state(device)


def rng_stem(rank: int = 0, world_size: int = 1) -> str:
    """Each rank's generators (Python, NumPy, Paddle): a reward function or sampler drawing from the global
    generators consumes them by its rank's data, so the ranks' states differ."""
    return RNG_STEM if world_size == 1 else f"{RNG_STEM}.rank{rank:05d}"


def optimizer_stem(rank: int = 0, world_size: int = 1) -> str:
    return OPTIMIZER_STEM if world_size == 1 else f"{OPTIMIZER_STEM}.rank{rank:05d}"


def legacy_rng_file(rank: int = 0, world_size: int = 1) -> str:
    return LEGACY_RNG_FILE if world_size == 1 else f"rng_state.rank{rank:05d}.pdstate"


def legacy_optimizer_file(rank: int = 0, world_size: int = 1) -> str:
    return LEGACY_OPTIMIZER_FILE if world_size == 1 else f"optimizer.rank{rank:05d}.pdopt"


def rank_files(world_size: int, save_optimizer: bool = True) -> list:
    """The files each rank adds to a checkpoint folder (each JSON file is written after its safetensors file)."""
    return [stem + ".json" for rank in range(world_size) for stem in
            (rng_stem(rank, world_size), *((optimizer_stem(rank, world_size),) if save_optimizer else ()))]


def pickled_files(path: str, rank: int = 0, world_size: int = 1) -> list:
    """The files of an older checkpoint that resuming it on this rank unpickles (none for one written now)."""
    found = []
    if not has_state(path, optimizer_stem(rank, world_size)):
        found.append(legacy_optimizer_file(rank, world_size))
    if not any(has_state(path, stem) for stem in (rng_stem(rank, world_size), RNG_STEM)):
        found += [n for n in dict.fromkeys((legacy_rng_file(rank, world_size), LEGACY_RNG_FILE))
                  if os.path.isfile(os.path.join(path, n))][:1]
    if not has_state(path, PENDING_STEM):
        found.append(LEGACY_PENDING_FILE)
    return [os.path.join(path, name) for name in found if os.path.isfile(os.path.join(path, name))]


def warn_pickled(path: str, rank: int = 0, world_size: int = 1) -> list:
    """One warning naming the files of `path` that resuming will unpickle (an older checkpoint's format)."""
    files = pickled_files(path, rank, world_size)
    if files:
        logger.warning("%s: loaded through pickle (checkpoint written by an older paddle-rl). Unpickling a file can "
                       "run code it carries: only resume checkpoints you trust. Checkpoints written from now on hold "
                       "no pickle (safetensors + JSON).", ", ".join(files))
    return files


def load_pickle(path: str):
    """An older checkpoint's pickle file (warn_pickled names it first)."""
    with open(path, "rb") as f:
        return pickle.load(f)


# ---------------------------------------------------------------- one output_dir for every rank
SHARED_CHECK_PREFIX = ".shared-folder-check-"
SHARED_CHECK_WAIT = 5.0   # seconds a rank looks for rank 0's file (a network file system may show it late)
NOT_SHARED_HINT = "is output_dir one folder that every node shares?"


class SharedFolderError(ConfigError):
    """output_dir is not one folder for every rank (node-local folders, or different paths per node)."""


def check_shared_folder(output_dir: str, first_of_ranks, rank: int = 0, world_size: int = 1,
                        wait: float = SHARED_CHECK_WAIT) -> None:
    """Every rank of a run writes its part of each checkpoint into output_dir, and `resume_from_checkpoint:
    auto` reads it on every rank: all ranks need one folder. Rank 0 writes a file with a random name and
    content there, every other rank must read it in its own output_dir within `wait` seconds; otherwise every
    rank raises SharedFolderError naming the folders and the hosts. first_of_ranks(value): the first value
    that is not None over the ranks, on every rank (a collective). Nothing to check in a single process."""
    if world_size == 1:
        return
    host, folder = socket.gethostname(), os.path.abspath(output_dir)
    sent = None
    if rank == 0:
        token = secrets.token_hex(16)
        error = _write_error(lambda: _write_token(os.path.join(output_dir, SHARED_CHECK_PREFIX + token), token), "")
        sent = {"token": token, "host": host, "folder": folder, "error": error}
    sent = first_of_ranks(sent)  # rank 0 wrote its file before it entered this collective
    if sent["error"] is not None:
        raise SharedFolderError(f"output_dir {sent['folder']}: rank 0 (host {sent['host']}) cannot write there: "
                                f"{sent['error']}")
    path = os.path.join(output_dir, SHARED_CHECK_PREFIX + sent["token"])
    deadline = time.monotonic() + wait
    while rank != 0 and not _holds(path, sent["token"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    blind = first_of_ranks(None if rank == 0 or _holds(path, sent["token"]) else (rank, host, folder))
    if rank == 0:
        with contextlib.suppress(OSError):
            os.remove(path)
    if blind is not None:
        raise SharedFolderError(
            f"output_dir is not one folder shared by every rank: rank {blind[0]} (host {blind[1]}) does not see in "
            f"{blind[2]} the file {os.path.basename(path)} that rank 0 (host {sent['host']}) wrote into "
            f"{sent['folder']} (it looked for {wait:g} s). Every rank writes its part of each checkpoint into "
            "output_dir and resumes from it: give every node the same output_dir, on a file system that all nodes "
            "mount (NFS, a cluster file system).")


def _write_token(path: str, token: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())


def _holds(path: str, token: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read() == token
    except OSError:
        return False


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the partial folder was removed; earlier checkpoints are untouched)."""


def save_checkpoint(output_dir: str, step: int, model, tokenizer_folder: str, optimizer, scheduler,
                    trainer_state: dict, save_optimizer: bool = True, total_limit: int = -1,
                    model_state: Optional[dict] = None, rank: int = 0, world_size: int = 1, barrier=None,
                    first_error=None, extra_files: Optional[dict] = None, extra_parts=None,
                    save_dtype: str = "float32") -> str:
    """save_dtype (float32 | bfloat16): the Hugging Face weights' dtype; a bfloat16 checkpoint of a model whose
    full weights it holds also holds them in float32 (master_weights, read back by master_state), so a run
    resumes exactly from it. model_state: the full (gathered) model state when `model` holds only a shard; rank / world_size /
    barrier / first_error: the calling process among several (all of them call this; first_error(value) is the
    first non-None value over the ranks, so every rank takes the same branch). extra_parts(folder): every rank
    writes its part of a second trained model (the critic) into the temporary folder.

    Refuses (NonFiniteError, nothing written) a model with a NaN or inf weight. A failed write (a full disk, an
    I/O error on any rank) removes the temporary folder and raises CheckpointError on every rank; earlier
    checkpoints are untouched either way."""
    final = os.path.join(output_dir, f"{PREFIX}{step}")
    tmp = os.path.join(output_dir, f".tmp-{PREFIX}{step}")
    sync = barrier or (lambda: None)
    agree = first_error or (lambda value: value)
    if model_state is None:
        model_state = checkpoint_state(model)
    bad = agree(first_nonfinite_array(model_state))
    if bad is not None:
        raise NonFiniteError(f"{final} not written: weight {bad} holds NaN or inf (earlier checkpoints are "
                             "untouched)")
    state = dict(trainer_state, step=step, rng=rng_state(), has_optimizer=save_optimizer, world_size=world_size)

    def fresh_folder():
        if rank == 0:
            if os.path.isdir(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)

    def write_parts():
        if rank != 0 and not os.path.isdir(tmp):  # writing would create it: a folder rank 0 never sees
            raise FileNotFoundError(f"{tmp}, created by rank 0, is not visible to this rank ({NOT_SHARED_HINT})")
        if rank == 0:
            save_model(model, tmp, tokenizer_folder=tokenizer_folder, state=model_state, dtype=save_dtype)
            if save_dtype != "float32" and model.lora is None:
                write_state(tmp, MASTER_STEM, model_state)
        write_state(tmp, rng_stem(rank, world_size), {"host": state["rng"], "paddle": paddle_rng_state()})
        if save_optimizer:
            write_state(tmp, optimizer_stem(rank, world_size), optimizer.state_dict())
            state["scheduler"] = scheduler.state_dict()
        if extra_parts is not None:
            extra_parts(tmp)
        faults.die("save", step, rank)
        faults.fail_save(step, rank, tmp)
        if rank == 0:
            for stem, tree in (extra_files or {}).items():  # {stem: state} (the asynchronous rollout's batches)
                write_state(tmp, stem, tree)
            with open(os.path.join(tmp, STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(state, f, indent=2, sort_keys=True, default=_json_default)

    def rename():
        if rank == 0:
            missing = [name for name in rank_files(world_size, save_optimizer)
                       if not os.path.isfile(os.path.join(tmp, name))]
            if missing:
                raise FileNotFoundError(f"{', '.join(missing)} missing from {tmp} after every rank wrote its part "
                                        f"({NOT_SHARED_HINT})")
            if os.path.isdir(final):
                shutil.rmtree(final)
            os.replace(tmp, final)

    for stage in (fresh_folder, write_parts, rename):  # each ends with every rank agreeing on the outcome
        error = agree(_write_error(stage, f" (rank {rank})" if world_size > 1 else ""))
        if error is not None:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            sync()
            previous = checkpoint_dirs(output_dir)
            raise CheckpointError(f"{final} could not be written: {error}. The partial folder was removed; "
                                  + (f"the last complete checkpoint is {previous[-1]}" if previous else
                                     "there is no earlier checkpoint"))
    if rank == 0 and total_limit > 0:
        for old in checkpoint_dirs(output_dir)[:-total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    sync()
    return final


def _write_error(stage, where: str) -> Optional[str]:
    """None when stage() wrote its files, else what went wrong (a full disk, an I/O or permission error; the
    safetensors writer reports its I/O errors as its own exception type)."""
    try:
        stage()
    except Exception as e:  # noqa: BLE001 - every rank has to learn of it, and the temporary folder must go
        return f"{type(e).__name__}: {e}{where}"
    return None


def _json_default(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (np.floating, np.integer)):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def master_state(path: str):
    """The float32 weights a bfloat16 checkpoint holds beside its Hugging Face weights ({HF name: array}), or the
    folder itself when its Hugging Face weights are the float32 ones (load_weights takes either)."""
    return read_state(path, MASTER_STEM) if has_state(path, MASTER_STEM) else path


def load_trainer_state(path: str) -> dict:
    with open(os.path.join(path, STATE_FILE), encoding="utf-8") as f:
        return json.load(f)


def load_optimizer(path: str, optimizer, scheduler, state: dict, rank: int = 0, world_size: int = 1) -> None:
    if not state.get("has_optimizer"):
        raise ValueError(f"{path}: saved without optimizer state (ignore_save_lr_and_optim); cannot resume exactly")
    saved_world = int(state.get("world_size", 1))
    if saved_world != world_size:
        raise ValueError(f"{path}: optimizer state was saved by {saved_world} processes, this run has {world_size}; "
                         "resume with the same parallel layout (or set ignore_save_lr_and_optim and start fresh)")
    stem = optimizer_stem(rank, world_size)
    if has_state(path, stem):
        opt_path = state_paths(path, stem)[0]
        saved = read_state(path, stem)
    else:
        opt_path = os.path.join(path, legacy_optimizer_file(rank, world_size))
        if not os.path.isfile(opt_path):
            raise FileNotFoundError(f"checkpoint file not found: {state_paths(path, stem)[0]}")
        saved = paddle.load(opt_path)  # pickle: warn_pickled named it
    _check_optimizer_state(opt_path, optimizer, saved)
    optimizer.set_state_dict(saved)
    scheduler.set_state_dict(state["scheduler"])


def _check_optimizer_state(path: str, optimizer, saved: dict) -> None:
    """Every trained parameter has saved moments (paddle would silently skip the ones it cannot match, e.g. a
    checkpoint written by a release that named parameters differently)."""
    inner = getattr(optimizer, "inner", optimizer)
    prefixes = {k.rsplit("_moment", 1)[0] for k in saved if isinstance(k, str) and "_moment" in k}
    if not prefixes:
        return  # saved before the first optimizer step: nothing to match
    missing = [p.name for p in getattr(inner, "_parameter_list", []) if p.name not in prefixes]
    if missing:
        raise ValueError(f"{path}: no optimizer state for {len(missing)} parameter(s) (first: {missing[0]}); the "
                         "checkpoint was written by a different model layout or release. Resume its weights with "
                         "ignore_save_lr_and_optim or start from it as actor_model_name_or_path")
