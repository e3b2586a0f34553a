"""Pipeline schedules over send/recv between neighbouring stages, independent of the model.

- train_1f1b: one forward and one backward in turn per stage after a warm-up of (stages - stage - 1)
  forwards (PipeDream-flush / Megatron's non-interleaved schedule). Paired exchanges are ordered so blocking
  send/recv cannot deadlock: the lower stage sends first, the higher stage receives first.
- forward_only: every micro-batch through the stages, no gradient.

The caller supplies what one stage does with one micro-batch (`forward(i, x)`: the received activation, or
None on the first stage -> this stage's output, the loss on the last stage) and the activation shape of
micro-batch i. Every stage holds the same micro-batch data, so shapes are known on both sides of each
transfer without a header.
"""
from typing import Callable, List

import paddle
import paddle.distributed as dist

from .watchdog import watched


class Link:
    """Blocking send/recv between neighbouring stages of this rank's pipeline."""

    def __init__(self, topo):
        ranks = topo.ranks_of["pp"]
        self.stage, self.num_stages = topo.pp_rank, topo.pp_degree
        self.prev = ranks[self.stage - 1] if self.stage > 0 else None
        self.next = ranks[self.stage + 1] if self.stage + 1 < len(ranks) else None
        self.last_rank = ranks[-1]
        self.group = topo.group("pp")

    @property
    def is_last(self) -> bool:
        return self.next is None

    @staticmethod
    def _recv(shape, src):
        buf = paddle.empty(shape, dtype="float32")
        with watched(f"recv from rank {src}", ranks=[src]):
            dist.recv(buf, src=src)
        return buf

    def recv_forward(self, shape):
        if self.prev is None:
            return None
        x = self._recv(shape, self.prev)
        x.stop_gradient = False
        return x

    def send_forward(self, y):
        if self.next is not None:
            with watched(f"send to rank {self.next}", ranks=[self.next]):
                dist.send(y.detach(), dst=self.next)

    def recv_backward(self, shape):
        return None if self.next is None else self._recv(shape, self.next)

    def send_backward(self, grad):
        if self.prev is not None:
            with watched(f"send to rank {self.prev}", ranks=[self.prev]):
                dist.send(grad, dst=self.prev)

    def send_forward_recv_backward(self, y, shape):
        """Lower side of an exchange: send first."""
        self.send_forward(y)
        return self.recv_backward(shape)

    def send_backward_recv_forward(self, grad, shape):
        """Higher side of an exchange: receive first."""
        x = self.recv_forward(shape)
        self.send_backward(grad)
        return x


def train_1f1b(link: Link, num_micro: int, forward: Callable, act_shape: Callable[[int], List[int]]) -> None:
    """Forward and backward of every micro-batch; gradients accumulate in the stage's parameters."""
    warmup = min(link.num_stages - link.stage - 1, num_micro)
    pending = []

    def backward(x, y, grad_y):
        if link.is_last:
            y.backward()
        else:
            paddle.autograd.backward([y], [grad_y])
        return None if x is None else x.grad

    for i in range(warmup):
        x = link.recv_forward(act_shape(i))
        y = forward(i, x)
        link.send_forward(y)
        pending.append((x, y, i))
    remaining = num_micro - warmup
    x = link.recv_forward(act_shape(warmup)) if remaining > 0 else None
    for j in range(remaining):
        i = warmup + j
        y = forward(i, x)
        pending.append((x, y, i))
        x0, y0, i0 = pending.pop(0)
        grad_y = None if link.is_last else link.send_forward_recv_backward(y, act_shape(i0))
        gx = backward(x0, y0, grad_y)
        if j == remaining - 1:
            x = None
            link.send_backward(gx)
        else:
            x = link.send_backward_recv_forward(gx, act_shape(i + 1))
    while pending:
        x0, y0, i0 = pending.pop(0)
        grad_y = link.recv_backward(act_shape(i0))
        link.send_backward(backward(x0, y0, grad_y))


@paddle.no_grad()
def forward_only(link: Link, num_micro: int, forward: Callable, act_shape: Callable[[int], List[int]]) -> list:
    """Each micro-batch through the stages; returns the last stage's outputs (None elsewhere)."""
    out = []
    for i in range(num_micro):
        y = forward(i, link.recv_forward(act_shape(i)))
        if link.is_last:
            out.append(y)
        else:
            link.send_forward(y)
            out.append(None)
    return out
