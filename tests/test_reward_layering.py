"""Import layering around the rewards: config < rewards < reward_server, and algorithms apart from rewards.

Every import statement of the package is read (function-level imports included), so a lazy import counts too.
"""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imports(package: str):
    """(file relative to ROOT, absolute module name) for every import in the package's .py files."""
    out = []
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, ROOT)
            parts = rel[:-3].split(os.sep)
            own_package = parts[:-1]                  # a module's package; an __init__.py's own package
            tree = ast.parse(open(path, encoding="utf-8").read(), rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    out += [(rel, alias.name) for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        base = own_package[:len(own_package) - node.level + 1]
                        module = ".".join(base + ([node.module] if node.module else []))
                    else:
                        module = node.module or ""
                    out.append((rel, module))
                    out += [(rel, f"{module}.{alias.name}") for alias in node.names]
    return out


def _offenders(package: str, target: str, allowed=()):
    return sorted({(f, m) for f, m in _imports(package)
                   if (m == target or m.startswith(target + ".")) and f not in allowed})


def test_paddle_rl_does_not_import_the_reward_server():
    # the command line is the top layer: it may load reward_server.cli (lazily) to register `reward-server`
    assert _offenders("paddle_rl", "reward_server", allowed={os.path.join("paddle_rl", "cli.py")}) == []


def test_config_does_not_import_rewards():
    assert _offenders(os.path.join("paddle_rl", "config"), "paddle_rl.rewards") == []


def test_algorithms_do_not_import_rewards():
    assert _offenders(os.path.join("paddle_rl", "algorithms"), "paddle_rl.rewards") == []


def test_reward_server_cli_lives_in_reward_server():
    assert not os.path.exists(os.path.join(ROOT, "paddle_rl", "rewards", "server_cli.py"))
    from reward_server.cli import add_reward_server_subparser, run_reward_server  # noqa: F401


def test_imports_at_run_time():
    """Importing config loads no rewards; importing rewards loads neither the server nor Paddle (reward-server
    workers import rewards); `paddle-rl reward-server` is registered from reward_server.cli."""
    code = ("import sys\n"
            "import paddle_rl.config\n"
            "assert 'paddle_rl.rewards' not in sys.modules, 'config imported rewards'\n"
            "import paddle_rl.rewards\n"
            "bad = [m for m in ('reward_server', 'paddle', 'fastapi') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "from paddle_rl.cli import build_parser\n"
            "args = build_parser().parse_args(['reward-server', '--port', '9'])\n"
            "assert args.func.__module__ == 'reward_server.cli' and args.port == 9, args\n"
            "assert 'fastapi' not in sys.modules, 'building the parser imported FastAPI'\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
