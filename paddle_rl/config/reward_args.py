from dataclasses import dataclass

from .fields import arg


@dataclass
class RewardArgs:
    reward_funcs: list = arg(["kk"], "Rule rewards to sum (with reward_weights).")
    reward_weights: list = arg([], "Weights of reward_funcs (default: all 1).")
    use_rm_server: bool = arg(False, "Score through the HTTP reward server at reward_server.")
    reward_server: str = arg("http://127.0.0.1:8731", "URL of the reward server.")

    def _validate_reward(self, errors):
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            errors.append(f"reward_weights: {len(self.reward_weights)} weights for {len(self.reward_funcs)} reward_funcs")
