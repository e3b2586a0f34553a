"""Pre-flight checks of a run's configuration that need more than the config, before any model loads: models
named by a fetchable id resolved to their folders, each model's config.json read by its family, the tokenizer, a
LoRA adapter's settings, the data files and the first record of each as the model would see it, the reward (its
server answering, its function names and plugin files, a reward model's folder, the sandbox its programs need), an
environment plugin's file. `preflight` names every problem at once, each with what to do."""
import logging
import os

import paddle

from ..config import ConfigError
from ..config.loader import dataset_paths
from ..data.loader import DatasetError, iter_records
from ..data.records import ChatForm, RecordError, to_prompt_record
from ..models.config import ModelConfig
from ..models.decoder import stage_chunks
from ..monitor.dashboards import resolve_dashboards
from ..parallel.topology import TopologyError, resolve_degrees
from ..models.tokenizer import Tokenizer
from ..model_files.hub import resolve_model
from ..models.lora import AdapterError, lora_settings
from ..rewards import check as reward_check
from ..rewards.client import RewardServerClient
from ..rewards.plugins import PluginError
from ..rewards.sandbox import isolation_problem

logger = logging.getLogger("paddle_rl")


def check_paths(config, data: bool = True) -> None:
    """Fail before any model loads when a model or data path is missing (`data=False`: the model paths only, for
    a command that reads no data: the rollout server)."""
    problems = path_problems(config, data)
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))


def preflight(config, rewards: bool = True, train: bool = True, sft: bool = False) -> None:
    """Every missing prerequisite of a run in one ConfigError, before any model loads: the paths (`train`: the
    training data is required, else only eval_datasets is read), the first record of each data file through the
    templating rule (`sft`: training records need no ground truth), with `rewards` the reward's own prerequisites,
    and the plugin files."""
    problems = path_problems(config, data=train) if train else path_problems(config, data=False) + (
        [f"eval_datasets: file not found: {p}" for p in dataset_paths(config.eval_datasets) if not os.path.isfile(p)]
        if config.eval_datasets else ["eval_datasets: required for evaluation"])
    problems += record_problems(config, train, sft)
    if rewards:
        problems += reward_problems(config)
    problems += plugin_problems(config) + grid_problems(config) + dashboard_problems(config)
    problems += memory_problems(config)
    if problems:
        raise ConfigError(f"invalid configuration ({len(problems)} problem{'s' if len(problems) > 1 else ''} to fix "
                          "before the run can start):\n  " + "\n  ".join(problems))


def path_problems(config, data: bool = True) -> list:
    """The problem lines of check_paths."""
    problems = []
    for key in ("actor_model_name_or_path", "reference_model_name_or_path", "tokenizer_name_or_path"):
        try:  # a fetchable model's name -> its cached folder (fetched the first time)
            setattr(config, key, resolve_model(getattr(config, key)))
        except (RuntimeError, ValueError) as e:
            raise ConfigError(f"{key}: {e}") from None
    model = config.actor_model_name_or_path
    if not os.path.isdir(model):
        problems.append(f"actor_model_name_or_path: folder not found: {model}")
    elif not os.path.isfile(os.path.join(model, "config.json")):
        problems.append(f"actor_model_name_or_path: {os.path.join(model, 'config.json')} not found")
    else:
        try:  # an unsupported family, rope type or setting: before any model loads
            model_config = ModelConfig.from_pretrained(model)
            windows = [w for w in model_config.family.sliding_windows(model_config) if w is not None]
        except ValueError as e:
            problems.append(f"actor_model_name_or_path: {e}")
        else:
            if windows and config.use_remove_padding:
                problems.append(f"use_remove_padding: packed micro-batches do not implement sliding-window attention "
                                f"(this model has layers with sliding_window {windows[0]}); set it to false")
            try:  # the interleaved pipeline's chunks: every virtual stage the same number of layers
                stage_chunks(model_config.num_hidden_layers, config.pipeline_parallel_degree, 0,
                             config.virtual_pp_degree)
            except ValueError as e:
                problems.append(f"{e} ({os.path.join(model, 'config.json')})")
    tokenizer = config.tokenizer_name_or_path or model
    if os.path.isdir(tokenizer) and not os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
        key = "tokenizer_name_or_path" if config.tokenizer_name_or_path else "actor_model_name_or_path"
        problems.append(f"{key}: {os.path.join(tokenizer, 'tokenizer.json')} not found (a folder written by "
                        "transformers' save_pretrained of a fast tokenizer has it)")
    for key in ("reference_model_name_or_path", "tokenizer_name_or_path"):
        value = getattr(config, key)
        if value and not os.path.isdir(value):
            problems.append(f"{key}: folder not found: {value}")
    if config.lora_path:
        try:
            lora_settings(config)
        except (AdapterError, OSError, KeyError) as e:
            problems.append(f"lora_path: {e}")
    if data and not config.train_datasets:
        problems.append("train_datasets: required")
    for key in ("train_datasets", "eval_datasets") if data else ():
        for p in dataset_paths(getattr(config, key)):
            if not os.path.isfile(p):
                problems.append(f"{key}: file not found: {p}")
    if data and config.do_eval and not config.eval_datasets:
        problems.append("eval_datasets: required when do_eval is true")
    if data and not config.do_train and not (config.do_eval and config.evaluation_strategy != "no"):
        problems.append("do_train: false leaves nothing to run without do_eval: true (and evaluation_strategy "
                        "other than no)")
    return problems


def _tokenizer(config):
    """The run's tokenizer, or None where its folder or file is missing (named by path_problems) or unreadable
    (a problem line)."""
    folder = config.tokenizer_name_or_path or config.actor_model_name_or_path
    if not os.path.isfile(os.path.join(str(folder), "tokenizer.json")):
        return None, []
    key = "tokenizer_name_or_path" if config.tokenizer_name_or_path else "actor_model_name_or_path"
    try:
        return Tokenizer.from_pretrained(folder), []
    except Exception as e:  # noqa: BLE001 - a broken tokenizer file of any kind is named here
        return None, [f"{key}: {os.path.join(folder, 'tokenizer.json')} cannot be read ({type(e).__name__}: {e}); "
                      "write it again with transformers' save_pretrained of a fast tokenizer"]


def record_problems(config, train: bool = True, sft: bool = False) -> list:
    """The first record of each data file read as the run reads it (the prompt through the chat-template rule, its
    label), so that a file the run would refuse at its first line is named now."""
    tokenizer, problems = _tokenizer(config)
    if tokenizer is None:
        return problems
    try:
        chat = ChatForm(tokenizer, config.apply_chat_template, config.system_prompt)
    except ValueError as e:
        return problems + [str(e)]
    for key in ("train_datasets", "eval_datasets") if train else ("eval_datasets",):
        for path in dataset_paths(getattr(config, key)):
            if not os.path.isfile(path):
                continue  # named by path_problems
            try:
                for location, _, raw in iter_records(path):
                    to_prompt_record(raw, config.prompt_key, config.response_key, chat,
                                     require_ground_truth=not (sft and key == "train_datasets"))
                    break
            except RecordError as e:
                problems.append(f"{key}: {location}: {e}")
            except DatasetError as e:
                problems.append(f"{key}: {e}")
    return problems


def reward_problems(config) -> list:
    """The reward's prerequisites: with use_rm_server a server answering at reward_server; in process the function
    names and plugin files (rewards.check), a reward model's folder, and the sandbox the code rule runs programs
    in."""
    if config.use_rm_server:
        problem = RewardServerClient.from_config(config).unreachable()
        return [f"reward_server: {problem}; start it (paddle-rl reward-server --port PORT --reward NAMES) or set "
                f"use_rm_server: false to score in process"] if problem else []
    try:
        problems = list(reward_check.reward_config_errors(config))
    except PluginError as e:
        problems = [f"reward_plugins: {e}"]
    path = getattr(config, "reward_model_name_or_path", "")
    if path and not os.path.isdir(path):
        problems.append(f"reward_model_name_or_path: folder not found: {path} (a *ForSequenceClassification "
                        "checkpoint folder)")
    named = [n for _, n in reward_check.named_functions(config.reward_funcs, config.reward_routes)]
    if "code" in named:
        problems += _sandbox_problems(config, "reward_funcs: the code rule")
    return problems


def _sandbox_problems(config, who: str) -> list:
    """Where untrusted programs must run isolated and this machine cannot isolate them."""
    if getattr(config, "sandbox_allow_unisolated", False):
        return []
    problem = isolation_problem()
    if not problem:
        return []
    return [f"{who} runs untrusted programs in a sandbox, and here {problem}: install bubblewrap (apt-get install "
            "bubblewrap), or set sandbox_allow_unisolated: true for programs you trust"]


def plugin_problems(config) -> list:
    """A file named by env_plugin (file.py:ClassName) that does not exist; the tool environment's python tool and
    agent programs (agent_sandbox) where programs cannot be isolated."""
    spec = getattr(config, "env_plugin", "") or ""
    if ":" in spec and not os.path.isfile(spec.rsplit(":", 1)[0]):
        return [f"env_plugin: file not found: {spec.rsplit(':', 1)[0]} (written file.py:ClassName)"]
    if spec == "tools" and "python" in (getattr(config, "env_tools", None) or ()):
        return _sandbox_problems(config, "env_tools: the python tool")
    if spec == "agent" and getattr(config, "agent_sandbox", False):
        problem = isolation_problem()
        if problem:
            return [f"agent_sandbox: agent programs run in a sandbox, and here {problem}: install bubblewrap "
                    "(apt-get install bubblewrap), or set agent_sandbox: false to run them as this user with this "
                    "machine's files and network (only for programs you trust)"]
    return []


def grid_problems(config) -> list:
    """The parallel degrees against the processes launched (a degree above 1 on one process would wait for peers
    that never come)."""
    try:
        resolve_degrees(config.tensor_parallel_degree, config.pipeline_parallel_degree,
                        config.sharding_parallel_degree, config.data_parallel_degree,
                        context=config.context_parallel_degree)
    except TopologyError as e:
        return [f"{e} (`paddle-rl train CONFIG --nproc_per_node N` launches N processes)"]
    return []


def memory_problems(config) -> list:
    """The memory keys (offload_optim, offload_level): on a GPU build offloading is not implemented, so they are
    refused; on a CPU build the states they would move are in host memory already, which is what they ask, so a
    run goes on with one warning line saying so (PaddleNLP's own grpo_argument.yaml sets offload_level)."""
    given = [(key, what) for key, what in (("offload_optim", "the optimizer states"), ("offload_level", "the named "
                                                                                    "states")) if getattr(config, key)]
    if paddle.is_compiled_with_cuda() and paddle.get_device().startswith("gpu"):
        return [f"{key}: offloading to host memory is not implemented on GPU builds yet; leave it unset"
                for key, _ in given]
    for key, what in given:
        logger.warning("%s: %r asks for %s in host memory; on a CPU build they are there already (there is no "
                       "second memory to move them to): nothing to move", key, getattr(config, key), what)
    return []


def dashboard_problems(config) -> list:
    """A dashboard report_to names whose package cannot be imported."""
    try:
        resolve_dashboards(config.report_to)
    except ConfigError as e:
        return [str(e)]
    return []
