"""paddle-rl: GRPO, REINFORCE++ and their family for language models on PaddlePaddle."""
from .env import configure_threads, import_paddle

configure_threads()  # before Paddle is imported: its thread count is read once
import_paddle()  # one line saying what to install when no Paddle build is; Paddle's import notices filtered

__version__ = "0.1.0"
