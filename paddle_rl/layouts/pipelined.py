"""Pipeline parallelism: each stage holds a consecutive range of layers (the same CausalLM restricted to it),
micro-batches move over send/recv in the 1F1B schedule of parallel/pipeline.py. Tied embeddings keep a copy of
the table on the last stage whose gradient is summed with the first stage's. A critic (PPO) is split into the
same stages on the same ranks, its value head on the last stage; its value pass and update run the same schedules
with the head's values (and the value loss) in place of the log-probs (and the policy loss). Micro-batches come
from the layout's MicroBatching (rows or a token budget, each padded to its own longest; every stage of a pipeline
holds the same batch, so every stage plans the same micro-batches); packed rows (use_remove_padding) are refused
at config check.

With `virtual_pp_degree` k > 1 each stage holds k chunks of layers (stage r: chunks r, r + stages, ...; the
embedding with chunk 0, the head with the last chunk) and the passes run the interleaved schedules of
parallel/pipeline.py (train_interleaved, forward_only_interleaved): `forward(chunk, i, x)` runs one chunk."""
import paddle
import paddle.distributed as dist

from ..models import hf_state, load_model
from ..models.critic import head_values, load_critic
from ..models.decoder import attention_bias_from_mask, position_ids_from_mask
from ..parallel import collectives as C
from ..parallel.pipeline import Link, forward_only, forward_only_interleaved, train_1f1b, train_interleaved
from ..parallel.watchdog import watched
from .base import Layout


def _inputs(tensors):
    mask = tensors["attention_mask"]
    return (tensors["input_ids"], position_ids_from_mask(mask),
            attention_bias_from_mask(mask, tensors["input_ids"].shape[1], causal=True))


class Pipelined(Layout):
    @property
    def virtual(self) -> int:
        """Chunks of layers per stage (virtual_pp_degree)."""
        return getattr(self._topo, "virtual_pp", 1)

    @property
    def _stage(self) -> tuple:
        topo = self._topo
        return (topo.pp_rank, topo.pp_degree) if self.virtual == 1 else (topo.pp_rank, topo.pp_degree, self.virtual)

    def load_model(self, folder: str, lora=None, adapter=None):
        return load_model(folder, tp_group=self._topo.group("tp"), stage=self._stage, lora=lora, adapter=adapter)

    def load_critic(self, folder: str, lora=None):
        """The critic split into the actor's stages (and tensor-parallel group), its value head on the last stage."""
        return load_critic(folder, tp_group=self._topo.group("tp"), lora=lora, stage=self._stage)

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

    def _stage_fn(self, model, parts, head):
        """`parts`: (micro-batch, its tensors) pairs; `head(i, hidden)`: the last stage's output of micro-batch i
        from the final hidden states at its response-predicting positions [b, W, hidden] (the loss in training).
        Interleaved: forward(chunk, i, x), the last stage's output after its last chunk."""
        last_chunk = self.virtual - 1

        def forward_chunk(chunk, i, x):
            part, tensors = parts[i]
            ids, pos, bias = _inputs(tensors)
            first = model.is_first and chunk in (None, 0)
            y = model.hidden_states(ids if first else x, pos, bias, chunk=chunk)
            if not (model.is_last and chunk in (None, last_chunk)):
                return y
            width = part.prompt_width
            return head(i, y[:, width - 1:width - 1 + tensors["response_ids"].shape[1]])
        return forward_chunk if self.virtual > 1 else (lambda i, x: forward_chunk(None, i, x))

    def _forward_only(self, link, parts, forward, act_shape) -> list:
        """The no-grad schedule over the micro-batches: the last stage's outputs (None elsewhere)."""
        if self.virtual > 1:
            return forward_only_interleaved(link, self.virtual, len(parts), forward, act_shape)
        return forward_only(link, len(parts), forward, act_shape)

    def _train(self, link, parts, forward, act_shape, batch_key: str) -> None:
        """Forward and backward of every micro-batch (1F1B, or interleaved with virtual stages)."""
        if self.virtual == 1:
            train_1f1b(link, len(parts), forward, act_shape)
            return
        if len(parts) % link.num_stages:
            raise ValueError(f"virtual_pp_degree {self.virtual}: a mini-batch of {len(parts)} micro-batches; the "
                             "interleaved schedule needs a multiple of pipeline_parallel_degree "
                             f"({link.num_stages}) in training (as Megatron's): set {batch_key} (or "
                             "max_tokens_per_micro_batch) so that each mini-batch splits into such a number")
        train_interleaved(link, self.virtual, len(parts), forward, act_shape)

    def _act_shape(self, model, parts):
        return lambda i: [*parts[i][1]["input_ids"].shape, model.config.hidden_size]

    @staticmethod
    def _parts(batch, plan, keys=None):
        parts = [batch.micro(rows) for rows in plan]
        return [(part, part.tensors(keys=keys)) for part in parts]

    def _from_last(self, link, out, shape, dtype: str = "float32"):
        """A tensor of `shape` the last stage computed (`out`; None elsewhere), on every stage."""
        if out is None:
            out = paddle.empty(shape, dtype)
        with watched(f"broadcast from the last stage (rank {link.last_rank})", link.group):
            dist.broadcast(out, src=link.last_rank, group=link.group)
        return out

    def _logprob_chunks(self, model, batch, plan, temperature: float, with_entropy: bool,
                        with_greedy: bool = False) -> list:
        """Forward only through the stages; the last stage broadcasts each micro-batch's log-probs (and entropy,
        and greedy choices) to its pipeline."""
        parts = self._parts(batch, plan)
        link = Link(self._topo)
        head = lambda i, hidden: model.head_logprobs(hidden, parts[i][1]["response_ids"], temperature, with_entropy,
                                                     with_greedy=with_greedy)
        outs = self._forward_only(link, parts, self._stage_fn(model, parts, head), self._act_shape(model, parts))
        chunks = []
        for rows, (_, tensors), out in zip(plan, parts, outs):
            shape = list(tensors["response_ids"].shape)
            out = out if out is not None else (None, None, None)
            logp = self._from_last(link, out[0], shape).numpy()
            ent = self._from_last(link, out[1], shape).numpy() if with_entropy else None
            greedy = (self._from_last(link, out[2], shape, "int64").numpy(),) if with_greedy else ()
            chunks.append((rows, logp, ent, *greedy))
        return chunks

    def forward_backward(self, model, mini, keys, micro: int, temperature: float, loss_fn,
                         with_greedy: bool = False) -> list:
        if with_greedy:
            raise ValueError("forward_backward: with_greedy is not supported under a pipeline (only its last stage "
                             "sees the logits)")
        parts = self._parts(mini, self.micro.plan(mini, micro), keys)
        outputs = []

        def head(i, hidden):
            tensors = parts[i][1]
            logp, entropy = model.head_logprobs(hidden, tensors["response_ids"], temperature, True)
            outputs.append(loss_fn(tensors, logp, entropy))
            return outputs[-1].loss
        self._train(Link(self._topo), parts, self._stage_fn(model, parts, head), self._act_shape(model, parts),
                    "per_device_train_batch_size")
        return outputs

    # ---------------------------------------------------------------- a critic: the value head on the last stage
    def _value_chunks(self, model, batch, plan) -> list:
        parts = self._parts(batch, plan)
        link = Link(self._topo)
        head = lambda i, hidden: head_values(model, hidden)
        outs = self._forward_only(link, parts, self._stage_fn(model, parts, head), self._act_shape(model, parts))
        return [(rows, self._from_last(link, out, list(tensors["response_ids"].shape)).numpy())
                for rows, (_, tensors), out in zip(plan, parts, outs)]

    def value_forward_backward(self, model, mini, keys, micro: int, loss_fn) -> list:
        plan = self.micro.plan(mini, micro)
        parts = self._parts(mini, plan, keys)
        outputs = []

        def head(i, hidden):
            part, tensors = parts[i]
            outputs.append(loss_fn(plan[i], part, tensors, head_values(model, hidden)))
            return outputs[-1].loss
        self._train(Link(self._topo), parts, self._stage_fn(model, parts, head), self._act_shape(model, parts),
                    "per_device_train_batch_size")
        return outputs

    def from_last_stage(self, array):
        topo = self._topo
        return C.broadcast_object(array, topo.ranks_of["pp"][-1], topo.group("pp"))

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
