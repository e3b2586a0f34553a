"""Pipeline schedules over send/recv between neighbouring stages, independent of the model.

- train_1f1b: one forward and one backward in turn per stage after a warm-up of (stages - stage - 1)
  forwards (PipeDream-flush / Megatron's non-interleaved schedule). Paired exchanges are ordered so blocking
  send/recv cannot deadlock: the lower stage sends first, the higher stage receives first.
- forward_only: every micro-batch through the stages, no gradient.

The caller supplies what one stage does with one micro-batch (`forward(i, x)`: the received activation, or
None on the first stage -> this stage's output, the loss on the last stage) and the activation shape of
micro-batch i. Every stage holds the same micro-batch data, so shapes are known on both sides of each
transfer without a header.

- train_interleaved / forward_only_interleaved (`virtual_pp_degree` k > 1): each rank holds k chunks of layers,
  chunk j of rank r being virtual stage j * stages + r (Megatron's interleaved assignment), so an activation
  goes round the ring of ranks k times. The order of each rank's forwards and backwards is Megatron's
  interleaved 1F1B (Narayanan et al. 2021): micro-batches in groups of `stages`, each group through chunk 0,
  1, ..., k - 1 (backwards through k - 1, ..., 0), a warm-up of (stages - rank - 1) * 2 + (k - 1) * stages
  forwards, then one forward and one backward in turn, then the remaining backwards. Its bubble is
  (stages - 1) / (micro-batches * k) of the ideal time, against (stages - 1) / micro-batches without chunks.

Transfers are blocking on both sides (a gloo send waits for its receive; gloo's isend does too), and a
group's transfers match by a per-process counter, so both sides of every pair must run their transfers in one
order. `plan_interleaved` therefore plays the whole schedule of every rank once (forward 1 unit, backward 2,
transfers when the receiver waits) and writes each rank's list of actions: its computations with every send
and receive placed where the play put it. All ranks project one global order, so no transfer can deadlock,
and a schedule that cannot finish is refused before anything runs.
"""
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import paddle
import paddle.distributed as dist

from .watchdog import watched


class Link:
    """Blocking send/recv between neighbouring stages of this rank's pipeline. `waited`: seconds spent inside
    sends and receives (waiting for the peer, and the copy itself), what the schedules' bubble is measured by.
    `ring_prev` / `ring_next`: the neighbours on the ring an interleaved pipeline goes round (the last stage's
    next is the first)."""

    def __init__(self, topo):
        ranks = topo.ranks_of["pp"]
        self.stage, self.num_stages = topo.pp_rank, topo.pp_degree
        self.prev = ranks[self.stage - 1] if self.stage > 0 else None
        self.next = ranks[self.stage + 1] if self.stage + 1 < len(ranks) else None
        self.ring_prev, self.ring_next = ranks[self.stage - 1], ranks[(self.stage + 1) % len(ranks)]
        self.ranks, self.last_rank = list(ranks), ranks[-1]
        self.group = topo.group("pp")
        # transfers with each neighbour on a group of that pair alone (more than 2 stages: a group's transfers match
        # by a counter every member advances, so a pipeline-wide group would pair transfers with other neighbours);
        # None: the default group, as with 2 stages
        self._pair = {self.ring_next: topo.group("pp_next"), self.ring_prev: topo.group("pp_prev")}
        self.waited = 0.0

    @property
    def is_last(self) -> bool:
        return self.next is None

    def _recv(self, shape, src):
        buf = paddle.empty(shape, dtype="float32")
        start = time.perf_counter()
        with watched(f"recv from rank {src}", ranks=[src]):
            dist.recv(buf, src=src, group=self._pair.get(src))
        self.waited += time.perf_counter() - start
        return buf

    def _send(self, tensor, dst):
        start = time.perf_counter()
        with watched(f"send to rank {dst}", ranks=[dst]):
            dist.send(tensor, dst=dst, group=self._pair.get(dst))
        self.waited += time.perf_counter() - start

    def recv_forward(self, shape):
        if self.prev is None:
            return None
        x = self._recv(shape, self.prev)
        x.stop_gradient = False
        return x

    def send_forward(self, y):
        if self.next is not None:
            self._send(y.detach(), self.next)

    def recv_backward(self, shape):
        return None if self.next is None else self._recv(shape, self.next)

    def send_backward(self, grad):
        if self.prev is not None:
            self._send(grad, self.prev)

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


# ------------------------------------------------------------------------------ interleaved (virtual stages)

class Action(NamedTuple):
    """One step of a rank's interleaved schedule: `kind` F (forward) / B (backward) of `chunk` on micro-batch
    `micro`, or send / recv of a message `(what, virtual stage, micro)` to / from rank `peer` of the pipeline
    (what: "act", the output of that virtual stage's forward; "grad", the gradient of its input)."""
    kind: str
    chunk: int = -1
    micro: int = -1
    message: Tuple[str, int, int] = ("", -1, -1)
    peer: int = -1


def forward_sequence(stages: int, virtual: int, num_micro: int) -> List[Tuple[int, int]]:
    """(chunk, micro-batch) in the order every rank runs its forwards: micro-batches in groups of `stages` (the
    last group may be smaller), each group through chunk 0, 1, ..., virtual - 1."""
    out = []
    for start in range(0, num_micro, stages):
        group = range(start, min(start + stages, num_micro))
        out += [(j, i) for j in range(virtual) for i in group]
    return out


def compute_order(stages: int, virtual: int, num_micro: int, stage: int, forward_only: bool = False) -> List[Action]:
    """This rank's forwards and backwards in Megatron's interleaved 1F1B order (no transfers)."""
    forwards = [Action("F", j, i) for j, i in forward_sequence(stages, virtual, num_micro)]
    if forward_only:
        return forwards
    backwards = [Action("B", virtual - 1 - j, i) for j, i in forward_sequence(stages, virtual, num_micro)]
    total = len(forwards)
    warmup = min((stages - stage - 1) * 2 + (virtual - 1) * stages, total)
    order = forwards[:warmup]
    for s in range(total - warmup):
        order += [forwards[warmup + s], backwards[s]]
    return order + backwards[total - warmup:]


def _messages(stages: int, virtual: int, stage: int, op: Action, forward_only: bool):
    """(the message `op` needs or None, its sender; the message it makes or None, its receiver) as stage ranks."""
    v, last = op.chunk * stages + stage, stages * virtual - 1
    if op.kind == "F":
        need = (("act", v - 1, op.micro), (v - 1) % stages) if v > 0 else (None, -1)
        make = (("act", v, op.micro), (v + 1) % stages) if v < last else (None, -1)
    else:
        need = (("grad", v + 1, op.micro), (v + 1) % stages) if v < last else (None, -1)
        make = (("grad", v, op.micro), (v - 1) % stages) if v > 0 else (None, -1)
    return need, make


def plan_interleaved(stages: int, virtual: int, num_micro: int, forward_only: bool = False,
                     orders: Optional[List[List[Action]]] = None) -> List[List[Action]]:
    """Every stage's actions (its computations and transfers, in order) for the interleaved schedule, from one
    play of all stages: each stage runs its `compute_order` (forward 1 time unit, backward 2); a message goes
    over when its receiver needs it and its sender is between two computations (or itself waiting, or done);
    the stage with the earliest clock moves first. `orders` replaces the compute orders (tests). Raises
    ValueError when the orders cannot finish (each stage waiting for another)."""
    if orders is None:
        orders = [compute_order(stages, virtual, num_micro, r, forward_only) for r in range(stages)]
    clock = [0.0] * stages
    pos = [0] * stages
    state = ["ready"] * stages          # ready | blocked | done
    waiting: List[Optional[tuple]] = [None] * stages
    outbox: List[Dict[tuple, int]] = [dict() for _ in range(stages)]
    have: List[set] = [set() for _ in range(stages)]
    actions: List[List[Action]] = [[] for _ in range(stages)]

    def transfer(src: int, dst: int, message, t: float) -> None:
        del outbox[src][message]
        actions[src].append(Action("send", message=message, peer=dst))
        actions[dst].append(Action("recv", message=message, peer=src))
        have[dst].add(message)
        if state[dst] == "blocked" and waiting[dst] == message:
            state[dst], waiting[dst] = "ready", None
            clock[dst] = max(clock[dst], t)

    while True:
        ready = [r for r in range(stages) if state[r] == "ready"]
        if not ready:
            if all(s == "done" for s in state) and not any(outbox):
                return actions
            stuck = [f"stage {r} waits for {waiting[r]}" for r in range(stages) if state[r] == "blocked"]
            raise ValueError("pipeline schedule cannot finish: " + "; ".join(stuck))
        r = min(ready, key=lambda s: (clock[s], s))
        t = clock[r]
        for message, dst in list(outbox[r].items()):  # between two computations: hand over what is awaited
            if state[dst] == "blocked" and waiting[dst] == message:
                transfer(r, dst, message, t)
        if pos[r] == len(orders[r]):
            state[r] = "done"
            continue
        op = orders[r][pos[r]]
        (need, src), (make, dst) = _messages(stages, virtual, r, op, forward_only)
        if need is not None and need not in have[r]:
            if need in outbox[src] and state[src] in ("blocked", "done"):
                transfer(src, r, need, max(t, clock[src]))
            else:
                state[r], waiting[r] = "blocked", need
            continue
        have[r].discard(need)
        actions[r].append(op)
        pos[r] += 1
        clock[r] = t + (1.0 if op.kind == "F" else 2.0)
        if make is not None:
            outbox[r][make] = dst


def _run_actions(link: Link, actions: List[Action], virtual: int, forward: Callable, act_shape: Callable,
                 training: bool) -> Dict[int, object]:
    """Run this stage's actions; returns the last virtual stage's outputs by micro-batch (empty elsewhere)."""
    stages, stage = link.num_stages, link.stage
    last = stages * virtual - 1
    inputs: Dict[Tuple[int, int], object] = {}
    grads: Dict[Tuple[int, int], object] = {}
    saved: Dict[Tuple[int, int], tuple] = {}
    ready: Dict[tuple, object] = {}
    outputs: Dict[int, object] = {}
    for a in actions:
        if a.kind == "F":
            v = a.chunk * stages + stage
            x = inputs.pop((a.chunk, a.micro), None)
            y = forward(a.chunk, a.micro, x)
            if v == last:
                outputs[a.micro] = y
            else:
                ready[("act", v, a.micro)] = y.detach()
            if training:
                saved[(a.chunk, a.micro)] = (x, y)
        elif a.kind == "B":
            v = a.chunk * stages + stage
            x, y = saved.pop((a.chunk, a.micro))
            if v == last:
                y.backward()
            else:
                paddle.autograd.backward([y], [grads.pop((a.chunk, a.micro))])
            if v > 0:
                ready[("grad", v, a.micro)] = x.grad
        elif a.kind == "send":
            link._send(ready.pop(a.message), link.ranks[a.peer])
        else:
            what, v, micro = a.message
            buf = link._recv(act_shape(micro), link.ranks[a.peer])
            if what == "act":
                buf.stop_gradient = not training
                inputs[((v + 1) // stages, micro)] = buf
            else:
                grads[((v - 1) // stages, micro)] = buf
    assert not saved and not ready and not inputs and not grads, "interleaved schedule left work behind"
    return outputs


def train_interleaved(link: Link, virtual: int, num_micro: int, forward: Callable,
                      act_shape: Callable[[int], List[int]], plan: Optional[List[List[Action]]] = None) -> None:
    """Forward and backward of every micro-batch through this rank's `virtual` chunks (`forward(chunk, i, x)`:
    x the received activation, None at virtual stage 0 -> the chunk's output, the loss at the last virtual
    stage); gradients accumulate in the parameters. `plan`: every stage's actions (plan_interleaved's)."""
    plan = plan or plan_interleaved(link.num_stages, virtual, num_micro)
    _run_actions(link, plan[link.stage], virtual, forward, act_shape, training=True)


@paddle.no_grad()
def forward_only_interleaved(link: Link, virtual: int, num_micro: int, forward: Callable,
                             act_shape: Callable[[int], List[int]]) -> list:
    """Each micro-batch through every virtual stage; returns the last stage's outputs (None elsewhere)."""
    plan = plan_interleaved(link.num_stages, virtual, num_micro, forward_only=True)
    outputs = _run_actions(link, plan[link.stage], virtual, forward, act_shape, training=False)
    return [outputs.get(i) for i in range(num_micro)]
