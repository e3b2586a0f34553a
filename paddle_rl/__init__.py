"""paddle-rl: GRPO, REINFORCE++ and their family for language models on PaddlePaddle."""
from .env import configure_threads, quiet_paddle_import

configure_threads()  # before Paddle is imported (where it already is: through its API, env.configure_threads)
quiet_paddle_import()  # one line saying what to install when no Paddle build is; Paddle's import notices dropped

__version__ = "0.1.0"
