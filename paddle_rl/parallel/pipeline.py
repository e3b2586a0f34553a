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
order. `plan_interleaved` therefore plays the whole schedule of every rank once (forward 1 unit, backward 2)
and writes each rank's list of actions: its computations with every send and receive placed in one global
order of the play's events, so no transfer can deadlock, and a schedule that cannot finish is refused before
anything runs. A stage runs its computations in its own order and its transfers, in their planned order, on a
thread of their own (`_run_actions`): a send then never holds up the next computation (NCCL's asynchronous
sends, which Megatron's schedule assumes, do not either).
"""
import threading
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

    def _recv(self, shape, src, timed: bool = True):
        buf = paddle.empty(shape, dtype="float32")
        start = time.perf_counter()
        with watched(f"recv from rank {src}", ranks=[src]):
            dist.recv(buf, src=src, group=self._pair.get(src))
        if timed:
            self.waited += time.perf_counter() - start
        return buf

    def _send(self, tensor, dst, timed: bool = True):
        start = time.perf_counter()
        with watched(f"send to rank {dst}", ranks=[dst]):
            dist.send(tensor, dst=dst, group=self._pair.get(dst))
        if timed:
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
    # one chunk: plain 1F1B's warm-up (train_1f1b's)
    warmup = min(stages - stage - 1 if virtual == 1 else (stages - stage - 1) * 2 + (virtual - 1) * stages, total)
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
                     orders: Optional[List[List[Action]]] = None,
                     clocks: Optional[List[int]] = None) -> List[List[Action]]:
    """Every stage's actions (its computations and transfers, in order) for the interleaved schedule, from one
    play of all stages: each stage runs its `compute_order` (forward 1 time unit, backward 2), a computation
    starting once the stage is free and its input has arrived, a message arriving when the computation making it
    ends (sends do not wait: the transfer thread of `_run_actions`). Every event of the play sorted by its time
    (a transfer before a computation starting at the same time; then by stage and message) is one global order,
    and each stage's actions are that order's events it takes part in, so the transfers of every pair run in the
    same order on both sides and none can deadlock, on a transfer thread or in the computing thread itself.
    `orders` replaces the compute orders (tests); `clocks`, a list, receives each stage's finishing time (the
    play's bubble). Raises ValueError when the orders cannot finish (each stage waiting for another)."""
    if orders is None:
        orders = [compute_order(stages, virtual, num_micro, r, forward_only) for r in range(stages)]
    clock = [0] * stages
    pos = [0] * stages
    arrival: Dict[tuple, int] = {}
    events = []     # (time, 0 transfer | 1 computation, stage, message or order index, action(s))
    while any(pos[r] < len(orders[r]) for r in range(stages)):
        moved = False
        for r in range(stages):
            while pos[r] < len(orders[r]):
                op = orders[r][pos[r]]
                (need, src), (make, dst) = _messages(stages, virtual, r, op, forward_only)
                if need is not None and need not in arrival:
                    break
                start = max(clock[r], arrival[need] if need is not None else 0)
                clock[r] = start + (1 if op.kind == "F" else 2)
                events.append((start, 1, r, pos[r], op))
                if make is not None:
                    arrival[make] = clock[r]
                    events.append((clock[r], 0, r, make, (Action("send", message=make, peer=dst),
                                                          Action("recv", message=make, peer=r), dst)))
                pos[r] += 1
                moved = True
        if not moved:
            stuck = [f"stage {r} waits for {_messages(stages, virtual, r, orders[r][pos[r]], forward_only)[0][0]}"
                     for r in range(stages) if pos[r] < len(orders[r])]
            raise ValueError("pipeline schedule cannot finish: " + "; ".join(stuck))
    actions: List[List[Action]] = [[] for _ in range(stages)]
    for _, kind, r, _, what in sorted(events, key=lambda e: e[:4]):
        if kind == 1:
            actions[r].append(what)
        else:
            send, recv, dst = what
            actions[r].append(send)
            actions[dst].append(recv)
    if clocks is not None:
        clocks[:] = clock
    return actions


class _Mailbox:
    """Tensors handed between the computing thread and the transfer thread, by message."""

    def __init__(self):
        self._cond = threading.Condition()
        self._items: Dict[tuple, object] = {}
        self.error: Optional[BaseException] = None

    def put(self, message, tensor) -> None:
        with self._cond:
            self._items[message] = tensor
            self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = error
            self._cond.notify_all()

    def take(self, message):
        with self._cond:
            while message not in self._items:
                if self.error is not None:
                    raise RuntimeError(f"pipeline transfer failed: {self.error}") from self.error
                self._cond.wait(timeout=1.0)
            return self._items.pop(message)


def _transfers(link: Link, actions: List[Action], act_shape: Callable, outgoing: _Mailbox, incoming: _Mailbox):
    """The transfer thread: this stage's sends and receives in the planned order (a send as soon as the computing
    thread has made its tensor, a receive posted as soon as the previous transfer is done)."""
    try:
        for a in actions:
            if a.kind == "send":
                link._send(outgoing.take(a.message), link.ranks[a.peer], timed=False)
            else:
                incoming.put(a.message, link._recv(act_shape(a.message[2]), link.ranks[a.peer], timed=False))
    except BaseException as e:  # noqa: BLE001 - handed to the computing thread, which raises it
        incoming.fail(e)
        outgoing.fail(e)


def _run_actions(link: Link, actions: List[Action], virtual: int, forward: Callable, act_shape: Callable,
                 training: bool) -> Dict[int, object]:
    """Run this stage's actions: the computations here, the transfers on a thread of their own in their planned
    order (so a send never holds up the next computation, as NCCL's asynchronous sends do not; the planned order
    is what keeps both sides of every pair in step). `link.waited` gains the time computations waited for a
    received tensor. Returns the last virtual stage's outputs by micro-batch (empty elsewhere)."""
    stages, stage = link.num_stages, link.stage
    last = stages * virtual - 1
    outgoing, incoming = _Mailbox(), _Mailbox()
    thread = threading.Thread(target=_transfers, name="paddle_rl-pipeline-transfers", daemon=True,
                              args=(link, [a for a in actions if a.kind in ("send", "recv")], act_shape, outgoing,
                                    incoming))
    thread.start()
    saved: Dict[Tuple[int, int], tuple] = {}
    outputs: Dict[int, object] = {}

    def received(message):
        start = time.perf_counter()
        tensor = incoming.take(message)
        link.waited += time.perf_counter() - start
        return tensor

    try:
        for a in actions:
            if a.kind not in ("F", "B"):
                continue
            v = a.chunk * stages + stage
            if a.kind == "F":
                x = None
                if v > 0:
                    x = received(("act", v - 1, a.micro))
                    x.stop_gradient = not training
                y = forward(a.chunk, a.micro, x)
                if v == last:
                    outputs[a.micro] = y
                else:
                    outgoing.put(("act", v, a.micro), y.detach())
                if training:
                    saved[(a.chunk, a.micro)] = (x, y)
            else:
                x, y = saved.pop((a.chunk, a.micro))
                if v == last:
                    y.backward()
                else:
                    paddle.autograd.backward([y], [received(("grad", v + 1, a.micro))])
                if v > 0:
                    outgoing.put(("grad", v, a.micro), x.grad)
    except BaseException as e:
        outgoing.fail(e)
        raise
    start = time.perf_counter()
    thread.join()  # every transfer done before the caller's next collective
    link.waited += time.perf_counter() - start
    if incoming.error is not None:
        raise RuntimeError(f"pipeline transfer failed: {incoming.error}") from incoming.error
    assert not saved, "interleaved schedule left work behind"
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
