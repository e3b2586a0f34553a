"""The rollout server: a RolloutEngine on devices of its own, served over HTTP (`paddle-rl rollout-server`;
docs/rollout_server.md). `app.py` the FastAPI application, `cli.py` its command line."""
