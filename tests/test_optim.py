"""optim.build_optimizer and make_state: AdamW whose state is made before its first step (Paddle makes it in it), with
the same updates as Paddle's own AdamW and a state that a fresh optimizer takes back (resume); the trainer's."""
import types

import numpy as np
import paddle
from micro_model import micro_overrides

from paddle_rl import optim
from paddle_rl.config import load_config
from paddle_rl.parallel.sharding import optimizer_state_bytes
from paddle_rl.trainer import RLTrainer

CONFIG = types.SimpleNamespace(learning_rate=1e-2, lr_scheduler_type="constant", min_lr_ratio=0.0, lr_decay_steps=0,
                               warmup_steps=0, warmup_ratio=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99,
                               adam_epsilon=1e-8)


def model(seed=0):
    """A small model, its parameters named as a fresh process would name them (a resumed run's names)."""
    paddle.seed(seed)
    with paddle.utils.unique_name.guard():
        return paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.LayerNorm(16), paddle.nn.Linear(16, 4))


def fresh_optimizer(net):
    """build_optimizer, its state's tensors named as a fresh process would name them."""
    with paddle.utils.unique_name.guard():
        optimizer, scheduler = optim.build_optimizer(net, CONFIG, 10)
        optim.make_state(optimizer)
    return optimizer, scheduler


def steps(net, optimizer, count, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        x = paddle.to_tensor(rng.standard_normal((5, 8)).astype("float32"))
        net(x).square().mean().backward()
        optimizer.step()
        optimizer.clear_grad()


def weights(net):
    return [p.numpy().copy() for p in net.parameters()]


def test_the_state_is_made_before_the_first_step():
    """Both moments of every trained parameter exist before the first step (Paddle makes them in it), so they sit
    beside the parameters rather than in the heap the first update's activations freed."""
    net = model()
    optimizer, _ = fresh_optimizer(net)
    param_bytes = sum(int(np.prod(p.shape)) * 4 for p in net.parameters())
    assert optimizer_state_bytes(optimizer)["moments"] == 2 * param_bytes
    lazy = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model().parameters())
    assert optimizer_state_bytes(lazy)["moments"] == 0   # Paddle's own: none until a step


def test_the_updates_are_paddles_and_the_state_resumes():
    """Three steps with the state made up front give the same bits as Paddle's AdamW making it in its first step;
    a fresh optimizer (its state made, zero) takes a saved state back and goes on as the first would have."""
    net, ref = model(), model()
    optimizer, _ = fresh_optimizer(net)
    no_decay = {p.name for n, p in ref.named_parameters() if "norm" in n or n.endswith("bias")}
    lazy = paddle.optimizer.AdamW(
        learning_rate=paddle.optimizer.lr.LambdaDecay(1e-2, lambda step: 1.0), parameters=ref.parameters(),
        weight_decay=0.1, beta1=0.9, beta2=0.99, epsilon=1e-8, apply_decay_param_fun=lambda n: n not in no_decay)
    steps(net, optimizer, 3)
    steps(ref, lazy, 3)
    for a, b in zip(weights(net), weights(ref)):
        np.testing.assert_array_equal(a, b)
    # resume: a new model and optimizer take the saved weights and state, then one more step on each side
    state = {k: v.numpy().copy() if hasattr(v, "numpy") else v for k, v in optimizer.state_dict().items()}
    resumed = model(seed=5)
    resumed.set_state_dict(net.state_dict())
    again, _ = fresh_optimizer(resumed)
    again.set_state_dict({k: paddle.to_tensor(v) if isinstance(v, np.ndarray) else v for k, v in state.items()})
    steps(net, optimizer, 1, seed=2)
    steps(resumed, again, 1, seed=2)
    for a, b in zip(weights(net), weights(resumed)):
        np.testing.assert_array_equal(a, b)


def test_the_trainer_makes_its_optimizers_state_before_its_first_step(micro, tmp_path):
    """The RL trainer's actor optimizer and a PPO critic's hold their moments before any step (make_state)."""
    trainer = RLTrainer(load_config(None, micro_overrides(micro, str(tmp_path / "out"), rl_algorithm="ppo")))
    try:
        for net, optimizer in ((trainer.actor, trainer.optimizer), (trainer.critic.model, trainer.critic.optimizer)):
            trained = sum(int(np.prod(p.shape)) * 4 for p in net.parameters() if not p.stop_gradient)
            assert optimizer_state_bytes(optimizer)["moments"] == 2 * trained
    finally:
        trainer.close()
