"""The rollout engine: continuous batching over sequences, each finished row leaving the running batch at once.

`generate(prompts, n, params, keys)` makes one `Sequence` per sample (sample j of prompt i, in output row i * n + j)
and runs the loop
    admit waiting prompt groups (Scheduler: rollout_max_num_seqs rows, rollout_kv_cache_tokens slots)
      -> prefill them together, fan each prompt's keys and values out to its n samples (RunningBatch.relayout)
    sample one token for every running row (the fused sampling kernel; row r draws uniform number
      len(tokens) of its own key, so the draw never depends on the batch it ran in)
    drop the rows that stopped or reached max_dec_len (relayout)
    one decode step of the model for the rows left
until nothing waits or runs. Features that are not generation itself wrap the loop as stages (`stages`, each
with any of these verbs): `start(seqs, keys, params)` once per call, before decoding; `logits(seqs, logits,
generated, stop_ids) -> logits` before each sampling step (a benchmark's forced response lengths: bench.py
`ForcedLengths`); `between_steps() -> bool` between decode steps, True when the model's weights changed (the packed
copies are rebuilt; partial rollouts load new weights there: worker.py); a stage with `tags_versions` makes
every token carry `engine.version` (column token_version). A multi-turn environment (`episodes`) is given per
call. The output is a StepBatch with the rollout's columns (prompt_ids, response_ids,
response_mask, rollout_logp, lengths, truncated, group and sample: who each row is, decode_steps: how many decode
steps processed the row, rollout_greedy: the argmax of the rollout's logits at each response token, before any
sampling setting or forced length acts, -1 where nothing was sampled; the trainer compares it with its own,
rollout_corr/greedy_differs).
"""
from typing import Optional, Sequence as Seq

import numpy as np
import paddle

from .. import ops
from ..batch import StepBatch
from ..models.decoder import CausalLM, LayerCache, attention_bias_from_mask
from ..models.lora import merged_weights
from ..ops.kv_cache import kv_place
from .keys import uniforms_for
from .running import RunningBatch
from .sampling import SamplingParams
from .sequence import Scheduler, Sequence, append_samples, sequences_batch
from .settings import EngineSettings


class RolloutEngine:
    def __init__(self, model: CausalLM, *args, settings: Optional[EngineSettings] = None, stages=(), **kwargs):
        """RolloutEngine(model, settings=EngineSettings(...)), or the settings' fields directly
        (RolloutEngine(model, pad_id, eos_ids, ...)); `stages`: what wraps the loop (see above)."""
        settings = settings if settings is not None else EngineSettings(*args, **kwargs)
        ops.rollout_weight_format(settings.rollout_dtype, settings.quant_type)  # checks both
        self.model = model
        self.settings = settings
        self.pad_id = settings.pad_id
        self.eos_ids = list(settings.eos_ids)
        self.max_num_seqs = settings.max_num_seqs
        self.max_cache_tokens = settings.max_cache_tokens
        self.kv_cache_dtype = settings.kv_cache_dtype   # what the KV cache stores (None: the model's compute dtype)
        self.rollout_dtype = settings.rollout_dtype     # the packed weights' and activations' precision
        self.quant_type = settings.quant_type           # the packed weights' quantization ('' | weight_only_int8 | int4)
        self.stages = list(stages)
        self._episodes = None
        self.version = 0   # the weights' version, tagged on each token when a stage asks (tags_versions)
        self.stats = {}   # the last generate's counters: peak_rows, decode_steps, prefills, relayouts, copied_slots,
        #                   peak_slots, peak_kv_bytes

    def bind(self, model: CausalLM) -> "RolloutEngine":
        """The same settings, decoding with another model (a resharded rollout copy)."""
        return RolloutEngine(model, settings=self.settings, stages=self.stages)

    def _stages_with(self, verb: str) -> list:
        return [s for s in self.stages if hasattr(s, verb)]

    # ---------------------------------------------------------------- sequences
    def _sequences(self, prompts, n: int, params: SamplingParams, keys, groups):
        if not params.greedy and keys is None:
            raise ValueError("sampling needs one key per sample")
        uniforms = None if params.greedy else uniforms_for(keys, params.max_dec_len)
        ids = groups
        groups = []
        for i, prompt in enumerate(prompts):
            groups.append([Sequence(i * n + j, ids[i], j, list(prompt), None if uniforms is None else uniforms[i * n + j])
                           for j in range(n)])
        for stage in self._stages_with("start"):
            stage.start([s for g in groups for s in g], keys, params)
        return groups

    # ---------------------------------------------------------------- the loop
    @paddle.no_grad()
    def generate(self, prompts: Seq[Seq[int]], n: int, params: SamplingParams,
                 keys: Optional[Seq] = None, episodes=None, groups: Optional[Seq[int]] = None) -> StepBatch:
        """`keys[i * n + j]` seeds sample j of prompt i (required unless greedy); `groups[i]` is prompt i's id in
        the output's column `group` (default: i). A model with LoRA adapters decodes with its merged weights (one
        matmul per layer; dropped when the call returns), packed in the engine's rollout_dtype / quant_type.

        `episodes` (rollout/episodes.py EpisodeRunner) makes each sample a multi-turn episode: when a row stops,
        `episodes.turn_ended(seq)` returns the tokens of the environment's observation (fed in one per decode
        step, with no log-prob and out of the loss mask, the row's KV cache kept) or None to end the episode; rows
        at different turns decode together."""
        if getattr(episodes, "drives_generation", False):
            # agent programs (rollout/agents.py AgentEpisodes): the episodes ask for completions, generated here in
            # batches of the requests waiting, with the weights packed once for the whole rollout
            with merged_weights(self.model), self.model.packed_weights(self.rollout_dtype, self.quant_type) as repack:
                return episodes.run(lambda p, k, prm, ks: self._generate(p, k, prm, ks, None, repack, None),
                                    prompts, n, params, keys, groups, self.pad_id)
        if episodes is not None and params.repetition_penalty != 1.0:
            raise ValueError("repetition_penalty: not with a multi-turn environment (observation tokens would not "
                             "count as seen)")
        with merged_weights(self.model), self.model.packed_weights(self.rollout_dtype, self.quant_type) as repack:
            out = self._generate(prompts, n, params, keys, episodes, repack, groups)
        if episodes is not None:
            episodes.finish(out)
        return out

    def _generate(self, prompts, n: int, params: SamplingParams, keys, episodes, repack, ids) -> StepBatch:
        self._episodes = episodes
        model = self.model
        was_training = model.training
        model.eval()
        groups = self._sequences(prompts, n, params, keys, range(len(prompts)) if ids is None else list(ids))
        scheduler = Scheduler(groups, self.max_num_seqs, self.max_cache_tokens, params.max_dec_len)
        stop_ids = sorted(set(params.stop_token_ids) | set(self.eos_ids))
        stop_t = paddle.to_tensor(np.asarray(stop_ids, dtype=np.int64).reshape([-1]))
        compute = model.embed_tokens.weight.dtype   # the activations' (the decode step's queries)
        cached = compute if self.kv_cache_dtype is None else paddle.empty([0], self.kv_cache_dtype).dtype
        batch = RunningBatch(len(model.layers), params.max_dec_len,
                             zero_fill=not ops.decode_attention_reads_windows(compute, cached))
        between = self._stages_with("between_steps")
        stats = {"peak_rows": 0, "decode_steps": 0, "prefills": 0}
        done = []
        while not scheduler.done or len(batch):
            joining = scheduler.admit(batch.seqs)
            if joining:
                self._prefill(batch, joining, params, stats["decode_steps"])
                stats["prefills"] += 1
            stats["peak_rows"] = max(stats["peak_rows"], len(batch))
            finished = self._sample(batch, params, stop_t, stop_ids)
            if finished.any():
                for i in np.flatnonzero(finished):
                    seq = batch.seqs[i]
                    seq.decode_steps = stats["decode_steps"] - seq.joined_at
                    done.append(seq)
                batch.relayout(np.flatnonzero(~finished), decode_count=stats["decode_steps"])
            if not len(batch):
                continue
            if batch.slot >= batch.capacity:
                batch.relayout(np.arange(len(batch)), decode_count=stats["decode_steps"])
            # rows keep their KV caches, written by the weights they were decoded with
            if any([stage.between_steps() for stage in between]):
                repack()  # the packed copies follow the new weights
            last = paddle.to_tensor(batch.last)
            positions = paddle.to_tensor(batch.positions().reshape(-1, 1))
            batch.logits = model.decode_step(last, positions, batch.layers, batch.start_tensor(), batch.shared_tensor())
            stats["decode_steps"] += 1
        if was_training:
            model.train()
        stats.update(relayouts=batch.relayouts, copied_slots=batch.copied_slots, peak_slots=batch.peak_slots,
                     peak_kv_bytes=batch.peak_kv_bytes)
        self.stats = stats
        return self._output(done, n * len(prompts))

    def _prefill(self, batch: RunningBatch, joining, params: SamplingParams, decode_count: int) -> None:
        """Run the joining groups' prompts once and place n rows per prompt. Prompts of one length run together
        and none is padded, so a prompt's keys, values and first logits never depend on which prompts joined
        with it (padding would change the float rounding of its attention sums). The prompts of one length take
        consecutive rows of the prefill caches (one copy per layer), from which their samples are fanned out."""
        model = self.model
        lengths = np.array([len(g[0].prompt) for g in joining])
        width = int(lengths.max())
        caches = None
        logits = []
        row_of = np.zeros(len(joining), dtype=np.int64)   # joining group -> its row in the prefill caches
        placed = 0
        for length in np.unique(lengths):
            members = np.flatnonzero(lengths == length)
            row_of[members] = np.arange(placed, placed + len(members))
            ids = paddle.to_tensor(np.array([joining[i][0].prompt for i in members], dtype=np.int64))
            cache = model.new_cache(int(length), self.kv_cache_dtype)
            positions = paddle.arange(int(length), dtype="int64").unsqueeze(0).expand(ids.shape)
            bias = attention_bias_from_mask(paddle.ones_like(ids), int(length), causal=True)
            hidden = model.hidden_states(ids, positions, bias, cache)
            logits.append(model.logits(hidden[:, -1]))
            if caches is None:
                caches = [LayerCache() for _ in cache]
                for layer, src in zip(caches, cache):
                    shape = [len(joining), src.k.shape[1], width, src.k.shape[3]]
                    layer.k, layer.v = batch.buffer(shape, src.k.dtype), batch.buffer(shape, src.v.dtype)
            rows = paddle.arange(len(members), dtype="int64")
            for layer, src in zip(caches, cache):
                kv_place(layer.k, src.k, rows, placed, 0, width - int(length), int(length))
                kv_place(layer.v, src.v, rows, placed, 0, width - int(length), int(length))
            placed += len(members)
        seqs = [s for g in joining for s in g]
        fan = row_of[np.repeat(np.arange(len(joining)), [len(g) for g in joining])]
        logits = logits[0] if len(logits) == 1 else paddle.concat(logits)
        new = {"logits": paddle.gather(logits, paddle.to_tensor(fan))}
        if not params.greedy:
            new["uniforms"] = np.stack([s.uniforms for s in seqs])
        if params.repetition_penalty != 1.0:
            seen = np.zeros((len(seqs), new["logits"].shape[-1]), dtype=np.float32)
            for r, s in enumerate(seqs):
                seen[r, s.prompt] = 1.0
            new["seen"] = paddle.to_tensor(seen)
        batch.relayout(np.arange(len(batch)), seqs, caches, fan, width, new, decode_count)

    def _sample(self, batch: RunningBatch, params: SamplingParams, stop_t, stop_ids) -> np.ndarray:
        """One token for every running row; returns which rows finished (stop token or max_dec_len)."""
        generated = batch.lengths()
        logits = batch.logits
        greedy_np = ops.row_argmax(logits).numpy()  # the distribution's own greedy choice, per row
        for stage in self._stages_with("logits"):
            logits = stage.logits(batch.seqs, logits, generated, stop_ids)
        uniforms = None
        if batch.uniforms is not None:   # row r's draw number len(tokens) of its own stream
            uniforms = paddle.to_tensor(batch.uniforms[np.arange(len(batch)), generated])
        ban = None   # the rows whose stop tokens are banned (under min_dec_len); None: none is
        if params.min_dec_len > 0 and (generated < params.min_dec_len).any():
            ban = paddle.to_tensor(generated < params.min_dec_len)
        tokens, logp = ops.sample(logits, uniforms, batch.seen, ban, stop_t, params.temperature, params.top_k,
                                  params.top_p, params.repetition_penalty)
        if batch.seen is not None:   # every row is alive: step_update marks its token seen
            alive = paddle.zeros([len(batch)], dtype="bool")
            batch.seen = ops.step_update(tokens, logp, alive, paddle.to_tensor(generated), stop_t, batch.seen,
                                         self.pad_id, params.min_dec_len).seen
        batch.logits = None
        tokens_np, logp_np = tokens.numpy(), logp.numpy()
        stopped = np.isin(tokens_np, stop_ids)
        if self._episodes is None:   # every row appends its sample (only an environment feeds tokens in)
            append_samples(batch.seqs, tokens_np.tolist(), logp_np.tolist(), greedy_np.tolist(), stopped.tolist(),
                           self.version)
            batch.advance(tokens_np)
            return stopped | (generated + 1 >= params.max_dec_len)
        finished = np.zeros(len(batch), dtype=bool)
        for i, seq in enumerate(batch.seqs):
            seq.versions.append(self.version)
            if seq.forced:  # an observation being fed in: its next token instead of the sample
                seq.append(seq.forced.popleft(), 0.0, policy=False)
                if not seq.forced:
                    seq.turn_start = len(seq.tokens)
                finished[i] = len(seq.tokens) >= params.max_dec_len
                continue
            seq.append(int(tokens_np[i]), float(logp_np[i]), policy=True, greedy=int(greedy_np[i]))
            seq.stopped = bool(stopped[i])
            if seq.stopped and self._episodes is not None and len(seq.tokens) < params.max_dec_len:
                observation = self._episodes.turn_ended(seq)
                if observation:
                    seq.forced.extend(observation)
                    seq.stopped = False
            finished[i] = seq.stopped or len(seq.tokens) >= params.max_dec_len
        batch.advance(np.array([seq.tokens[-1] for seq in batch.seqs], dtype=np.int64))
        return finished

    def _output(self, done, rows: int) -> StepBatch:
        return sequences_batch(done, rows, self.pad_id,
                               token_versions=any(getattr(s, "tags_versions", False) for s in self.stages))
