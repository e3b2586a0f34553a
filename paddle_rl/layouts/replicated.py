"""One process, data parallelism, sharding and tensor parallelism: each rank runs whole micro-batches through
its model (tensor-parallel layers split inside it; padded or packed, by rows or a token budget: micro.py);
gradients are summed over the batch group. With sequence parallelism (the topology's `sequence_parallel`) the
models split their activations outside the tensor-parallel blocks along the tokens (models/decoder.py), and
the norms' gradients are summed over the tensor-parallel group too (GradientSync's token_partial). With context
parallelism (`context_parallel_degree`, Ulysses) every pass splits its tokens over the context group (the models'
`set_context_parallel`), each rank's gradients are its tokens' share and are summed over that group, and the rollout
runs on each group's first rank (rollout.py)."""
from ..models import hf_state, load_model
from ..models.critic import load_critic
from ..optim import clip_grad_norm_
from ..parallel.topology import TopologyError
from ..parallel.watchdog import watched
from .base import Layout


class Replicated(Layout):
    def load_model(self, folder: str, lora=None, adapter=None):
        model = load_model(folder, tp_group=self._topo.group("tp"), lora=lora, adapter=adapter)
        model.sequence_parallel = self._topo.sequence_parallel
        self._context(model)
        return model

    def load_critic(self, folder: str, lora=None):
        """The critic split over the tensor-parallel group like the actor, its value head replicated."""
        critic = load_critic(folder, tp_group=self._topo.group("tp"), lora=lora)
        critic.sequence_parallel = self._topo.sequence_parallel
        self._context(critic)
        return critic

    def _context(self, model) -> None:
        """Context parallelism (context_parallel_degree): the model's training and log-prob passes split their tokens
        over the context group (refused by name where its heads or blocks cannot split)."""
        try:
            model.set_context_parallel(self._topo.group("cp"))
        except ValueError as e:
            raise TopologyError(str(e)) from None

    def full_state(self, model, frozen: bool = True) -> dict:
        if self._topo.group("tp") is None:
            return hf_state(model, frozen)
        with watched("all_gather of the tensor-parallel weights", self._topo.group("tp")):  # one wait for them all
            return hf_state(model, frozen)

    def _logprob_chunks(self, model, batch, plan, temperature: float, with_entropy: bool,
                        with_greedy: bool = False) -> list:
        def one(rows):
            out = self.micro.logprobs(model, batch.micro(rows), temperature, with_entropy, with_greedy)
            return (rows, *(None if x is None else x.numpy() for x in out))
        return self._each_pass(model, plan, one, backward=False)

    def forward_backward(self, model, mini, keys, micro: int, temperature: float, loss_fn,
                         with_greedy: bool = False) -> list:
        def one(rows):
            part = mini.micro(rows)
            logp, entropy, *greedy = self.micro.logprobs(model, part, temperature, True, with_greedy)
            tensors = part.tensors(keys=keys)
            if with_greedy:
                tensors["greedy"] = greedy[0]
            out = loss_fn(tensors, logp, entropy)
            out.loss.backward()
            return out
        return self._each_pass(model, self.micro.plan(mini, micro), one, backward=True)

    def _value_chunks(self, model, batch, plan) -> list:
        return self._each_pass(model, plan, lambda rows: (rows, self.micro.values(model, batch.micro(rows)).numpy()),
                               backward=False)

    def value_forward_backward(self, model, mini, keys, micro: int, loss_fn) -> list:
        def one(rows):
            part = mini.micro(rows)
            out = loss_fn(rows, part, part.tensors(keys=keys), self.micro.values(model, part))
            out.loss.backward()
            return out
        return self._each_pass(model, self.micro.plan(mini, micro), one, backward=True)

    def _each_pass(self, model, plan, one, backward: bool) -> list:
        """`one(rows)` for each micro-batch of `plan` (the list of what it returned); `backward`: whether `one`
        runs a backward (a layout whose passes are collectives adds its idle ones, layouts/partitioned.py)."""
        return [one(rows) for rows in plan]

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        if not self.is_parallel:
            return clip_grad_norm_(model.parameters(), max_norm)
        return self.grad_sync.clip_(max_norm)
