"""Pipeline parallelism: each stage holds a consecutive range of layers (the same CausalLM restricted to it),
micro-batches move over send/recv in the 1F1B schedule of parallel/pipeline.py. Tied embeddings keep a copy of
the table on the last stage whose gradient is summed with the first stage's. Micro-batches come from the layout's
MicroBatching (rows or a token budget, each padded to its own longest; every stage of a pipeline holds the same
batch, so every stage plans the same micro-batches); packed rows (use_remove_padding) are refused at config
check."""
import paddle
import paddle.distributed as dist

from ..models import hf_state, load_model
from ..models.decoder import attention_bias_from_mask, position_ids_from_mask
from ..parallel import collectives as C
from ..parallel.pipeline import Link, forward_only, train_1f1b
from ..parallel.topology import TopologyError
from ..parallel.watchdog import watched
from .base import Layout


def _inputs(tensors):
    mask = tensors["attention_mask"]
    return (tensors["input_ids"], position_ids_from_mask(mask),
            attention_bias_from_mask(mask, tensors["input_ids"].shape[1], causal=True))


class Pipelined(Layout):
    def load_model(self, folder: str, lora=None, adapter=None):
        topo = self._topo
        return load_model(folder, tp_group=topo.group("tp"), stage=(topo.pp_rank, topo.pp_degree), lora=lora,
                          adapter=adapter)

    def load_critic(self, folder: str, lora=None):
        raise TopologyError("pipeline_parallel_degree > 1: the critic is not split into pipeline stages (its value "
                            "pass and update would need a schedule of their own); use tensor or data parallelism")

    def full_state(self, model, frozen: bool = True) -> dict:
        merged = {}
        if self._topo.group("tp") is None:
            own = hf_state(model, frozen)
        else:
            with watched("all_gather of the tensor-parallel weights", self._topo.group("tp")):  # one wait for all
                own = hf_state(model, frozen)
        for part in C.gather_objects(own, self._topo.group("pp")):
            for k, v in part.items():
                merged.setdefault(k, v)
        return merged

    def _stage_fn(self, model, parts, temperature, with_entropy, loss_fn=None, outputs=None, with_greedy=False):
        """`parts`: (micro-batch, its tensors) pairs."""
        def forward(i, x):
            part, tensors = parts[i]
            ids, pos, bias = _inputs(tensors)
            y = model.hidden_states(ids if model.is_first else x, pos, bias)
            if not model.is_last:
                return y
            response_ids, width = tensors["response_ids"], part.prompt_width
            hidden = y[:, width - 1:width - 1 + response_ids.shape[1]]
            if loss_fn is None:
                return model.head_logprobs(hidden, response_ids, temperature, with_entropy, with_greedy=with_greedy)
            logp, entropy = model.head_logprobs(hidden, response_ids, temperature, with_entropy)
            out = loss_fn(tensors, logp, entropy)
            outputs.append(out)
            return out.loss
        return forward

    def _act_shape(self, model, parts):
        return lambda i: [*parts[i][1]["input_ids"].shape, model.config.hidden_size]

    @staticmethod
    def _parts(batch, plan, keys=None):
        parts = [batch.micro(rows) for rows in plan]
        return [(part, part.tensors(keys=keys)) for part in parts]

    def _logprob_chunks(self, model, batch, plan, temperature: float, with_entropy: bool,
                        with_greedy: bool = False) -> list:
        """Forward only through the stages; the last stage broadcasts each micro-batch's log-probs (and entropy,
        and greedy choices) to its pipeline."""
        parts = self._parts(batch, plan)
        link = Link(self._topo)
        outs = forward_only(link, len(parts), self._stage_fn(model, parts, temperature, with_entropy,
                                                             with_greedy=with_greedy),
                            self._act_shape(model, parts))
        chunks = []
        for rows, (_, tensors), out in zip(plan, parts, outs):
            shape = list(tensors["response_ids"].shape)
            if out is None:
                out = (paddle.empty(shape, "float32"), paddle.empty(shape, "float32") if with_entropy else None) + \
                    ((paddle.empty(shape, "int64"),) if with_greedy else ())
            with watched(f"broadcast of log-probs from rank {link.last_rank}", link.group):
                for x in out:
                    if x is not None:
                        dist.broadcast(x, src=link.last_rank, group=link.group)
            chunks.append((rows, *(None if x is None else x.numpy() for x in out)))
        return chunks

    def forward_backward(self, model, mini, keys, micro: int, temperature: float, loss_fn) -> list:
        parts = self._parts(mini, self.micro.plan(mini, micro), keys)
        outputs = []
        train_1f1b(Link(self._topo), len(parts), self._stage_fn(model, parts, temperature, True, loss_fn, outputs),
                   self._act_shape(model, parts))
        return outputs

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        self._sync_tied_embedding(model)
        return self.grad_sync.clip_(max_norm)

    def _sync_tied_embedding(self, model) -> None:
        """Sum the gradients of the tied embedding's two copies (first and last stage)."""
        group = self._topo.group("embed")
        if not model.config.tie_word_embeddings or group is None or not (model.is_first or model.is_last):
            return
        grad = model.embed_tokens.weight.grad
        if grad is not None:
            with watched("all_reduce of the tied embedding's gradient", group):
                dist.all_reduce(grad, group=group)

    def _loss_sums(self, collected: dict, weights: list):
        sums, total = super()._loss_sums(collected, weights)
        topo = self._topo
        # only the last stage computed losses
        return C.broadcast_object((sums, total), topo.ranks_of["pp"][-1], topo.group("pp"))
