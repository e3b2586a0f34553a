"""Standalone HTTP reward server (FastAPI + uvicorn) for paddle-rl's rule and plugin rewards."""
from .app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
