"""One process, data parallelism, sharding and tensor parallelism: each rank runs whole micro-batches through
its model (tensor-parallel layers split inside it); gradients are summed over the batch group."""
from ..models import hf_state, load_model
from ..models.logprobs import token_logprobs
from ..optim import clip_grad_norm_
from ..parallel.watchdog import watched
from .base import Layout


class Replicated(Layout):
    def load_model(self, folder: str):
        return load_model(folder, tp_group=self._topo.group("tp"))

    def full_state(self, model) -> dict:
        if self._topo.group("tp") is None:
            return hf_state(model)
        with watched("all_gather of the tensor-parallel weights", self._topo.group("tp")):  # one wait for them all
            return hf_state(model)

    def _shared(self, batch, rows):
        return batch.shared_prompts(rows) if self.share_prompts else None

    def _logprob_chunks(self, model, batch, temperature: float, micro_batch_size: int, with_entropy: bool) -> list:
        chunks = []
        for start in range(0, batch.size, micro_batch_size):
            rows = slice(start, start + micro_batch_size)
            part = batch.tensors(rows)
            logp, ent = token_logprobs(model, part["input_ids"], part["attention_mask"], batch.prompt_width,
                                       part["response_ids"], temperature, with_entropy, self._shared(batch, rows))
            chunks.append((logp.numpy(), None if ent is None else ent.numpy()))
        return chunks

    def forward_backward(self, model, mini, keys, micro: int, temperature: float, loss_fn) -> list:
        outs = []
        for start in range(0, mini.size, micro):
            rows = slice(start, start + micro)
            part = mini.tensors(rows, keys)
            logp, entropy = token_logprobs(model, part["input_ids"], part["attention_mask"], mini.prompt_width,
                                           part["response_ids"], temperature, True, self._shared(mini, rows))
            out = loss_fn(part, logp, entropy)
            out.loss.backward()
            outs.append(out)
        return outs

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        if not self.is_parallel:
            return clip_grad_norm_(model.parameters(), max_norm)
        return self.grad_sync.clip_(max_norm)
