"""paddle-rl: GRPO, REINFORCE++ and their family for language models on PaddlePaddle."""
from .env import configure_threads

configure_threads()

__version__ = "0.1.0"
