"""Standalone HTTP reward server (FastAPI + uvicorn) for paddle-rl's rule and plugin rewards.

`reward_server.cli` is its command line (`paddle-rl reward-server`, `python -m reward_server`); the application
(`create_app`, `ServerSettings`) is imported on first use, so the command line's parser costs no FastAPI import.
"""

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name):
    if name in __all__:
        # FastAPI loads only when the application is asked for (the CLI parser stays light)
        from . import app
        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
