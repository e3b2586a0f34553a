"""The `paddle-rl` command line: overrides anywhere, subcommands that say what they miss, errors with or without
a traceback."""
import os
import subprocess
import sys

import pytest

from paddle_rl import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, *args, timeout=300, cwd=ROOT):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def run_cli(*args, timeout=300):
    return run_python("import sys; from paddle_rl.cli import main; sys.exit(main(sys.argv[1:]))", *args,
                      timeout=timeout)


# ---- h: key=value overrides before and after options
def test_overrides_after_options_are_accepted():
    args = cli.parse_args(["train", "c.yaml", "--nproc_per_node", "2", "rollout_n=4", "--log_dir", "L", "seed=3"])
    assert (args.config, args.overrides, args.nproc_per_node, args.log_dir) == ("c.yaml", ["rollout_n=4", "seed=3"],
                                                                             2, "L")
    args = cli.parse_args(["train", "a=1", "c.yaml", "b=2", "--nproc_per_node", "2", "c=3"])
    assert (args.config, args.overrides) == ("c.yaml", ["a=1", "b=2", "c=3"])
    args = cli.parse_args(["eval", "c.yaml", "k=v"])
    assert (args.config, args.overrides) == ("c.yaml", ["k=v"])


def test_launch_command_carries_every_override(monkeypatch):
    seen = []
    monkeypatch.setattr(cli.subprocess, "call", lambda cmd: seen.append(cmd) or 0)
    assert cli.main(["train", "c.yaml", "--nproc_per_node", "2", "rollout_n=4"]) == 0
    cmd = seen[0]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    assert cmd[-3].endswith("run_rl.py") and cmd[-2:] == ["c.yaml", "rollout_n=4"]


@pytest.mark.parametrize("argv,message", [
    (["train", "c.yaml", "d.yaml"], "expected a CONFIG file and / or key=value overrides and --key value flags, got "
                                    "c.yaml d.yaml"),
    (["train", "--nproc_per_node", "2"], "got nothing"),
    (["data", "kk", "x=1"], "unrecognized arguments: x=1"),
    (["data", "kk", "--people", "2", "--rollout_n=4"], "unrecognized arguments: --rollout_n=4"),
])
def test_bad_words_are_still_rejected(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_flags_a_command_does_not_declare_are_overrides():
    """train's own options stay options; other --key value flags (other frameworks' spellings) become overrides,
    and a run given by overrides alone needs no CONFIG."""
    args = cli.parse_args(["train", "c.yaml", "--nproc_per_node", "2", "--rollout_n=4", "--num_generations", "8"])
    assert (args.config, args.nproc_per_node, args.overrides) == ("c.yaml", 2, ["rollout_n=4", "num_generations=8"])
    args = cli.parse_args(["train", "--nproc_per_node", "2", "a=1"])
    assert (args.config, args.overrides) == (None, ["a=1"])


# ---- j: a subcommand whose module cannot be imported still exists and names what is missing
HIDE_AND_RUN = """
import sys
sys.modules[sys.argv[1]] = None  # the import fails as for a missing package
from paddle_rl.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("module,command,options", [
    ("paddle_rl.bench", ["bench"], ["--steps", "1"]),
    (cli.REWARD_SERVER[1], ["reward-server"], ["--port", "8999"]),
    (cli.ROLLOUT_SERVER[1], ["rollout-server"], ["config.yaml", "--port", "8999"]),
    (cli.DATA_CONVERT[1], ["data", "convert"], ["in.jsonl", "--out", "x"]),
])
def test_subcommand_with_a_missing_import_names_it(module, command, options):
    result = run_python(HIDE_AND_RUN, module, *command, *options)
    assert result.returncode == 2, result.stderr
    assert "invalid choice" not in result.stderr
    assert f"error: paddle-rl {' '.join(command)}: cannot import {module}" in result.stderr
    listed = run_python(HIDE_AND_RUN, module, *command[:-1], "--help")  # the parent command lists it
    assert listed.returncode == 0 and f"unavailable: cannot import {module}" in " ".join(listed.stdout.split())


def test_missing_third_party_package_is_named():
    error = ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
    reason = cli._unavailable_reason("reward_server.cli", error)
    assert "Python package 'fastapi' cannot be imported" in reason and "install it" in reason


# ---- k: setup errors are one line; an error during training keeps its traceback
def test_config_error_is_one_line(tmp_path):
    result = run_cli("train", os.devnull, "rollout_nn=3", f"output_dir={tmp_path}")
    assert result.returncode == 2
    assert "did you mean 'rollout_n'" in result.stderr and "Traceback" not in result.stderr


BOOM = '''
def boom(completions, **kwargs):
    raise KeyError("field_the_records_lack")
'''


def test_error_during_training_keeps_its_traceback(micro, tmp_path):
    from micro_model import micro_overrides
    plugin = tmp_path / "boom_reward.py"
    plugin.write_text(BOOM)
    overrides = micro_overrides(micro, str(tmp_path / "out"), do_eval=False, max_steps=1, report_to="none",
                                reward_funcs="[boom]", reward_plugins=f"[{plugin}]")
    result = run_cli("train", os.devnull, *overrides, timeout=600)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback (most recent call last)" in result.stderr
    assert "field_the_records_lack" in result.stderr
    assert "\nerror: " not in result.stderr


# ---- Paddle's import-time notices (OMP_NUM_THREADS, ccache) stay out of the output; other stderr lines pass
@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_prints_nothing_on_stderr(argv):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="4")  # > 1: Paddle's notice would be printed
    result = subprocess.run([sys.executable, "-m", "paddle_rl", *argv], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0 and "usage: paddle-rl" in result.stdout
    assert result.stderr == ""


# ---- the parsers of `paddle-rl` and its subcommands load no Paddle (help answers at once)
HELP_WITHOUT_PADDLE = """
import sys
from paddle_rl.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    assert e.code == 0, e.code
print("paddle imported:", "paddle" in sys.modules)
"""


@pytest.mark.parametrize("argv,shown", [
    (["--help"], "fetch"),
    (["fetch", "--help"], "HuggingFaceTB/SmolLM2-135M-Instruct"),
    (["convert", "--help"], "gguf"),
    (["convert", "gguf", "--help"], "--dtype"),
])
def test_help_imports_no_paddle(argv, shown):
    result = run_python(HELP_WITHOUT_PADDLE, *argv)
    assert result.returncode == 0, result.stderr
    assert shown in result.stdout and "unavailable" not in result.stdout
    assert result.stdout.rstrip().endswith("paddle imported: False")


def test_import_filter_drops_only_paddles_notices():
    import io

    from paddle_rl.env import PADDLE_IMPORT_NOTICES, _DropLines
    out = io.StringIO()
    stream = _DropLines(out, PADDLE_IMPORT_NOTICES)
    print("WARNING: OMP_NUM_THREADS set to 4, not 1. The computation ...", file=stream)
    print("PLEASE USE OMP_NUM_THREADS WISELY.", file=stream)
    print("W0101 a real warning", file=stream)
    stream.write("no newline yet")
    stream.flush()
    assert out.getvalue() == "W0101 a real warning\nno newline yet"


def test_train_with_an_unreachable_reward_server_stops_before_the_first_step(tmp_path):
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    result = run_cli("train", "configs/tiny_arith_grpo.yaml", "use_rm_server=true", f"reward_server={url}",
                     "reward_server_retries=0", f"output_dir={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert f"\n  reward_server: no server answers at {url}" in result.stderr
    assert "Traceback" not in result.stderr and not os.path.exists(tmp_path / "metrics.jsonl")


def test_paddlenlp_argument_file_names_every_missing_prerequisite_at_once(tmp_path):
    """PaddleNLP's own grpo_argument.yaml on a fresh machine: the reward server, the model folder and both data
    files in one error, each with what to do (not the first of them, then the next after it is fixed)."""
    import socket
    import shutil
    with socket.socket() as s:  # a port nothing listens on, for the file's reward_server
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    fixture = os.path.join(ROOT, "tests", "fixtures", "paddlenlp_grpo_argument.yaml")
    shutil.copy(fixture, tmp_path / "grpo_argument.yaml")
    result = run_python("import sys; from paddle_rl.cli import main; sys.exit(main(sys.argv[1:]))", "train",
                        "grpo_argument.yaml", f"reward_server={url}", "reward_server_retries=0", cwd=str(tmp_path))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    lines = lines[next(i for i, line in enumerate(lines) if line.startswith("error: ")):]
    assert lines[0] == "error: invalid configuration (6 problems to fix before the run can start):", lines
    assert lines[1:4] == ["  actor_model_name_or_path: folder not found: Qwen/Qwen2.5-7B-Instruct-1M",
                          "  train_datasets: file not found: ppo-kk/34567ppl/train.jsonl",
                          "  eval_datasets: file not found: ppo-kk/5ppl/test.jsonl"], lines
    assert lines[4].startswith(f"  reward_server: no server answers at {url} (") and lines[4].endswith(
        "; start it (paddle-rl reward-server --port PORT --reward NAMES) or set use_rm_server: false to score in "
        "process"), lines[4]
    assert lines[5].startswith("  tensor_parallel_degree (2) x pipeline_parallel_degree (1) x "
                               "sharding_parallel_degree (1) = 2 does not divide the world size 1"), lines[5]
    assert lines[6].startswith("  report_to: wandb needs the Python package(s) wandb"), lines[6]
