import logging
import os
from dataclasses import dataclass

from .fields import arg

logger = logging.getLogger("paddle_rl")

MODEL_REWARD = "reward_model"  # the neural reward model's name among reward_funcs (rewards/reward_model.py)

SERVER_PROTOCOLS = ("auto", "v1", "paddlenlp")
ON_FAILURE = ("error", "skip")


@dataclass
class RewardArgs:
    reward_funcs: list = arg(["kk"], "Reward functions to sum (with reward_weights): kk, kk_reasoning, gsm8k, "
                                     "gsm8k_flexible, "
                                     "math (alias accuracy), format, cosine, repetition, soft_overlong, or a "
                                     "function of reward_plugins.")
    reward_weights: list = arg([], "Weights of reward_funcs (default: all 1).")
    reward_plugins: list = arg([], "Python files (or module names) whose functions become reward functions "
                                   "(ms-swift or verl signature).")
    reward_routes: dict = arg({}, "data_source -> reward functions (list, or mapping name: weight) for records "
                                  "with that data_source; others use reward_funcs.")
    cosine_accuracy: str = arg("math", "Correctness behind the cosine reward: a rule with the correctness trait (math | gsm8k | gsm8k_flexible | kk).")
    use_rm_server: bool = arg(False, "Score through the HTTP reward server at reward_server.")
    use_rule_reward: bool = arg(False, "PaddleNLP's switch to rule-based rewards: true scores with the rules of "
                                       "reward_funcs / reward_routes only: reward_model_name_or_path is not "
                                       "added as a reward function, and the reward server (use_rm_server) or "
                                       "the function reward_model named with it is an error.")
    reward_server: str = arg("http://127.0.0.1:8731", "URL of the reward server.")
    reward_server_protocol: str = arg("auto", "v1 (POST /v1/score, per-function scores) | paddlenlp (POST src/tgt/"
                                              "response to the URL) | auto (v1, else paddlenlp).")
    reward_server_timeout: float = arg(60.0, "Seconds to wait for one reward request.")
    reward_server_retries: int = arg(3, "Retries of a failed reward request (connection errors, timeouts, 5xx).")
    reward_server_backoff: float = arg(1.0, "First retry delay in seconds; doubles on each retry.")
    reward_server_on_failure: str = arg("error", "error: stop with an error naming the URL | skip: mark the "
                                                 "samples skipped (dropped, counted as reward/skipped).")
    reward_server_api_key: str = arg("", "API key for the reward server (default: $PADDLE_RL_REWARD_API_KEY).")

    def _resolve_reward_model(self, given_keys) -> None:
        """PaddleNLP's switch: `use_rm_server: false` with `reward_model_name_or_path` scores with that model.
        Unless reward_funcs / reward_routes name `reward_model`, it joins reward_funcs: alone when the file and
        overrides do not give reward_funcs (its default is a rule), else as one more function, weight 1."""
        if not self.reward_model_name_or_path:
            return
        if self.use_rule_reward:
            logger.info("use_rule_reward: the rules of reward_funcs score; reward_model_name_or_path %s is not "
                        "loaded", self.reward_model_name_or_path)
            return
        if self.use_rm_server:
            logger.warning("reward_model_name_or_path is not used with use_rm_server: true (the reward server at "
                           "%s scores; start it with --reward-model to score with the model)", self.reward_server)
            return
        named = [str(n) for n in self.reward_funcs]
        for spec in self.reward_routes.values():
            named += [spec] if isinstance(spec, str) else [str(n) for n in spec]
        if MODEL_REWARD in named:
            return
        if "reward_funcs" not in given_keys:
            self.reward_funcs = [MODEL_REWARD]
            logger.info("reward: %s (reward_model_name_or_path) alone, reward_funcs not given", MODEL_REWARD)
            return
        self.reward_funcs = list(self.reward_funcs) + [MODEL_REWARD]
        if self.reward_weights:
            self.reward_weights = list(self.reward_weights) + [1.0]
        logger.info("reward: %s (reward_model_name_or_path) added to reward_funcs with weight 1: %s", MODEL_REWARD,
                    ", ".join(self.reward_funcs))

    def _validate_reward(self, errors):
        if self.use_rule_reward:
            named = [str(n) for n in self.reward_funcs] + [str(n) for spec in self.reward_routes.values()
                                                           for n in ([spec] if isinstance(spec, str) else spec)]
            if self.use_rm_server:
                errors.append("use_rule_reward: true scores with the rules, and use_rm_server: true with the reward "
                              "server; set one of them false")
            elif MODEL_REWARD in named:
                errors.append(f"use_rule_reward: true scores with the rules only, and reward_funcs / reward_routes "
                              f"name {MODEL_REWARD}; drop one of them")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            errors.append(f"reward_weights: {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs")
        for w in self.reward_weights:
            try:
                float(w)
            except (TypeError, ValueError):
                errors.append(f"reward_weights: {w!r} is not a number")
        if not self.use_rm_server:
            if not self.reward_funcs:
                errors.append("reward_funcs: at least one reward function is required")
            # whether each named function exists is checked by paddle_rl.rewards.check_reward_config (the rule
            # registry and the plugins live there), before any model loads
            for spec in self.reward_plugins:
                spec = str(spec)
                if (spec.endswith(".py") or os.sep in spec) and not os.path.isfile(spec):
                    errors.append(f"reward_plugins: file not found: {spec}")
        if self.reward_server_protocol not in SERVER_PROTOCOLS:
            errors.append(f"reward_server_protocol: {self.reward_server_protocol!r} is not one of "
                          f"{', '.join(SERVER_PROTOCOLS)}")
        if self.reward_server_on_failure not in ON_FAILURE:
            errors.append(f"reward_server_on_failure: {self.reward_server_on_failure!r} is not one of "
                          f"{', '.join(ON_FAILURE)}")
        if self.reward_server_timeout <= 0:
            errors.append(f"reward_server_timeout: must be > 0, got {self.reward_server_timeout}")
        if self.reward_server_retries < 0:
            errors.append(f"reward_server_retries: must be >= 0, got {self.reward_server_retries}")
        if self.reward_server_backoff < 0:
            errors.append(f"reward_server_backoff: must be >= 0, got {self.reward_server_backoff}")
        if self.use_rm_server and not str(self.reward_server).startswith(("http://", "https://")):
            errors.append(f"reward_server: expected an http(s):// URL, got {self.reward_server!r}")
