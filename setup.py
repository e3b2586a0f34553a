import os
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildWithKernelSources(build_py):
    """Ship csrc/ inside the package (paddle_rl/_csrc) so an installed copy can build the fused ops."""

    def run(self):
        super().run()
        src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
        if os.path.isdir(src):
            dst = os.path.join(self.build_lib, "paddle_rl", "_csrc")
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst)

setup(
    name="paddle-rl",
    version="0.1.0",
    description="GRPO, REINFORCE++ and their family for language models on PaddlePaddle",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["paddle_rl", "paddle_rl.*", "reward_server", "reward_server.*"]),
    cmdclass={"build_py": BuildWithKernelSources},
    # Paddle is not a requirement: the CPU build (paddlepaddle) and the GPU builds (paddlepaddle-gpu, from
    # paddlepaddle.org.cn's index for each CUDA version) are different distributions that both provide the
    # `paddle` module, so requiring one would install it over the other. The CPU build is the extra `cpu`;
    # without any build, `import paddle_rl` says what to install (paddle_rl/env.py).
    install_requires=[
        "pyyaml",
        "numpy",
        "fastapi",
        "fastapi-offline",      # the reward server's /docs and /redoc assets, served without a CDN
        "uvicorn",
        "visualdl",
        "tensorboardX",         # report_to tensorboard: the event files (TFRecord framing, Event protobufs)
        "tokenizers",
        "safetensors",
        "gguf>=0.10",           # paddle-rl convert gguf / fetch: reads and dequantizes llama.cpp files
        "jinja2",
        "pyarrow",
        "math-verify",
        "tqdm",
        "requests",
        "httpx",
    ],
    extras_require={
        "cpu": ["paddlepaddle==3.3.1"],
        # parity checks against Hugging Face transformers (PyTorch CPU); torch is pinned: an unpinned torch
        # pulls a multi-GB CUDA build
        # (accelerate: transformers needs it to read a GGUF file, the independent side of the GGUF parity tests;
        # peft: the independent side of the LoRA adapter tests; tensorboard: reads back the event files written
        # for report_to tensorboard; openai: the client the rollout server's OpenAI endpoints are checked with;
        # matplotlib: paddle-rl plot's figures; playwright: drives the system's Chromium through VisualDL's pages,
        # tests/test_dashboard_browser.py, without Playwright's own browser downloads)
        "test": ["pytest", "torch==2.13.0", "transformers", "accelerate", "peft", "tensorboard", "openai",
                 "matplotlib", "playwright"],
        # paddle-rl plot
        "plot": ["matplotlib"],
    },
    entry_points={"console_scripts": ["paddle-rl=paddle_rl.cli:main"]},
)
