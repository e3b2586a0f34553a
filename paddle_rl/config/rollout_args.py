import logging
from dataclasses import dataclass
from typing import Optional

from .fields import ON_OFF, arg


# accepted spellings of kv_cache_dtype -> the name used
KV_CACHE_DTYPES = {"auto": "auto", "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
                   "float16": "float16", "fp16": "float16", "half": "float16"}

# accepted spellings of rollout_dtype -> the name used
ROLLOUT_DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}

logger = logging.getLogger("paddle_rl")


@dataclass
class RolloutArgs:
    rollout_n: int = arg(8, "Responses sampled per prompt (the group size G).")
    max_dec_len: int = arg(4096, "Maximum response length in tokens.")
    min_dec_len: int = arg(32, "EOS is banned until a response has this many tokens.")
    temperature: float = arg(0.7, "Sampling temperature; log-probs use logits / temperature.")
    top_p: float = arg(1.0, "Nucleus sampling mass.")
    top_k: int = arg(0, "Keep the k most likely tokens (0: off).")
    repetition_penalty: float = arg(1.0, "CTRL-style penalty on tokens already in the sequence.")
    stop_token_ids: list = arg([], "Extra token ids that end a response (EOS ids of the tokenizer always do).")
    rollout_max_num_seqs: int = arg(-1, "Most sequences in the running decode batch (-1: all of a batch). Finished "
                                        "sequences leave at once and waiting prompts (with their rollout_n samples) "
                                        "join as others finish (continuous batching).")
    rollout_kv_cache_tokens: int = arg(-1, "KV-cache budget of the running decode batch in token slots per layer "
                                           "(-1: unlimited): a prompt's samples join only while rows x (longest "
                                           "prompt + max_dec_len) stays within it. Bytes = slots x 2 x layers x "
                                           "kv_heads x head_dim x the bytes of kv_cache_dtype.")
    rollout_dtype: str = arg("auto", "The rollout's arithmetic: auto (bfloat16 with bf16: true, else float32) | "
                                     "float32 | bfloat16. bfloat16 packs the rollout's "
                                        "weights in bfloat16 (half the bytes) and rounds the activations to bfloat16 "
                                        "before each linear layer's product, summed in float32 (exact products, "
                                        "vdpbf16ps's order); norms, attention and log-probs stay "
                                        "float32, and the KV cache follows (kv_cache_dtype auto). Training and the "
                                        "reference pass follow bf16. verl's rollout.dtype.",
                             choices=("auto", "float32", "bfloat16"), spellings=ROLLOUT_DTYPE_NAMES)
    kv_cache_dtype: str = arg("auto", "What the rollout's KV cache stores: auto (rollout_dtype) | float32 | "
                                      "bfloat16 | float16. A 16-bit cache halves the cache's memory and the bytes "
                                      "each decode step reads; keys and values are rounded to it, so the rollout's "
                                      "log-probs drift from the trainer's (reuse_rollout_logprobs: auto then "
                                      "recomputes the old log-probs).",
                              choices=("auto", "float32", "bfloat16", "float16"), spellings=KV_CACHE_DTYPES)
    per_device_rollout_batch_size: int = arg(-1, "Prompts decoded together per process (PaddleNLP's): the running "
                                                 "decode batch holds at most this many prompts' rollout_n samples "
                                                 "(rows = it x rollout_n; with rollout_max_num_seqs the smaller "
                                                 "bound). -1: no bound of its own.")
    eval_max_dec_len: Optional[int] = arg(None, "Response length for evaluation; defaults to max_dec_len.")
    reuse_rollout_logprobs: str = arg("auto", "Use the log-probs recorded while sampling as the old-policy log-probs "
                                              "instead of a second forward pass: auto (when the update is on-policy: "
                                              "one mini-batch per step and update_iters 1) | on | off.",
                                      choices=("auto", "on", "off"), spellings=ON_OFF)
    old_logprob_pass: str = arg("auto", "The old-policy log-prob pass when the rollout's log-probs are not reused: "
                                        "auto (skipped when the update is on-policy and nothing reads them before "
                                        "it: the update's forward gives them, detached; ratio exactly 1) | on "
                                        "(always run the pass).",
                                choices=("auto", "on"), spellings=ON_OFF)
    env_plugin: str = arg("", "Multi-turn episodes: `tools` (the built-in tool environment: Hermes <tool_call> turns "
                              "answered with tool results), `agent` (a program of agent_command per sample, talking "
                              "to the policy through an OpenAI-compatible endpoint) or path/to/file.py:ClassName "
                              "(docs/multi_turn.md).",
                          aliases=("multi_turn_scheduler",))
    max_turns: int = arg(4, "With env_plugin: the most policy turns of an episode (env_plugin agent: completion "
                            "requests).")
    async_rollout: bool = arg(False, "Generate in a worker process of its own, ahead of the trainer by up to "
                                     "max_staleness policy versions (docs/algorithms.md, Asynchronous rollout).")
    max_staleness: int = arg(1, "With async_rollout: the most policy versions a trained batch may lag the trainer "
                                "(0: the worker generates each batch with the current weights, as a synchronous run).")
    async_rollout_threads: int = arg(0, "CPU threads of the rollout worker (0: as many as the trainer).")
    partial_rollout: bool = arg(False, "With async_rollout and max_staleness >= 1: weights go to the worker right "
                                       "after each update, and a batch being generated goes on under them from the "
                                       "next decode step (each token tagged with its version); not reproducible "
                                       "run to run (where the switch falls depends on timing).")
    rollout_server_urls: list = arg([], "Generate on rollout servers (`paddle-rl rollout-server`) instead of in the "
                                        "trainer: their URLs, e.g. [http://10.0.0.2:8732, http://10.0.0.3:8732]. "
                                        "Each step's prompt groups are split round-robin over the servers and the "
                                        "weights are pushed after each update (docs/rollout_server.md); ms-swift's "
                                        "vllm_server_host / vllm_server_port.")
    rollout_server_api_key: str = arg("", "API key of the rollout servers (default: $PADDLE_RL_ROLLOUT_API_KEY).")
    rollout_server_timeout: float = arg(3600.0, "Seconds to wait for one server's answer to a step's generation "
                                                "request (and for a weight push); a server past it counts as gone "
                                                "and its prompt groups go to the others.")

    @property
    def kv_cache_paddle_dtype(self) -> Optional[str]:
        """The KV cache's dtype for the engine (None: the compute dtype); auto follows rollout_dtype."""
        if self.kv_cache_dtype == "auto":
            return "bfloat16" if self.rollout_dtype == "bfloat16" else None
        return self.kv_cache_dtype

    @property
    def decode_rows(self) -> int:
        """The most rows of the running decode batch: rollout_max_num_seqs and per_device_rollout_batch_size x
        rollout_n, the smaller of those set (-1: unbounded)."""
        bounds = [b for b in (self.rollout_max_num_seqs, self.per_device_rollout_batch_size * self.rollout_n
                              if self.per_device_rollout_batch_size > 0 else -1) if b > 0]
        return min(bounds) if bounds else -1

    def _validate_rollout(self, errors):
        if self.per_device_rollout_batch_size == 0 or self.per_device_rollout_batch_size < -1:
            errors.append("per_device_rollout_batch_size: must be -1 (no bound) or >= 1, got "
                          f"{self.per_device_rollout_batch_size}")
        if self.rollout_max_num_seqs == 0 or self.rollout_max_num_seqs < -1:
            errors.append(f"rollout_max_num_seqs: must be -1 (unlimited) or >= 1, got {self.rollout_max_num_seqs}")
        elif self.rollout_max_num_seqs > 0 and self.rollout_max_num_seqs < self.rollout_n:
            errors.append(f"rollout_max_num_seqs: {self.rollout_max_num_seqs} is smaller than rollout_n "
                          f"{self.rollout_n} (the samples of one prompt are decoded together)")
        if self.rollout_kv_cache_tokens == 0 or self.rollout_kv_cache_tokens < -1:
            errors.append(f"rollout_kv_cache_tokens: must be -1 (unlimited) or >= 1, got {self.rollout_kv_cache_tokens}")
        if self.rollout_n < 1:
            errors.append(f"rollout_n: must be >= 1, got {self.rollout_n}")
        if self.max_staleness < 0:
            errors.append(f"max_staleness: must be >= 0, got {self.max_staleness}")
        if self.async_rollout_threads < 0:
            errors.append(f"async_rollout_threads: must be >= 0, got {self.async_rollout_threads}")
        if self.max_turns < 1:
            errors.append(f"max_turns: must be >= 1, got {self.max_turns}")
        if self.env_plugin and self.repetition_penalty != 1.0:
            errors.append("repetition_penalty: not with env_plugin (observation tokens would not count as seen)")
        if self.partial_rollout and not (self.async_rollout and self.max_staleness >= 1):
            errors.append("partial_rollout: needs async_rollout: true and max_staleness >= 1 (otherwise no batch is "
                          "being generated while the trainer updates)")
        if self.async_rollout:
            if self.env_plugin:
                errors.append("async_rollout: not with env_plugin yet (the environments run in the trainer)")
            if self.max_staleness > 0 and self.reuse_rollout_logprobs == "on":
                errors.append("reuse_rollout_logprobs: on would take a stale policy's log-probs as the old policy's "
                              "(async_rollout with max_staleness > 0): use auto or off")
        if self.rollout_server_urls:
            urls = [str(u) for u in self.rollout_server_urls]
            for url in urls:
                if not url.startswith(("http://", "https://")):
                    errors.append(f"rollout_server_urls: {url!r} is not an http:// or https:// URL")
            if len(set(u.rstrip("/") for u in urls)) != len(urls):
                errors.append(f"rollout_server_urls: a URL is listed twice ({', '.join(urls)})")
            if self.async_rollout:
                errors.append("rollout_server_urls: not with async_rollout (the servers generate each step's batch "
                              "with the weights of the step before; a worker process is the other way to generate)")
            if self.env_plugin:
                errors.append("rollout_server_urls: not with env_plugin yet (the environments run in the trainer)")
        if self.rollout_server_timeout <= 0:
            errors.append(f"rollout_server_timeout: must be > 0, got {self.rollout_server_timeout}")
        if self.max_dec_len < 1:
            errors.append(f"max_dec_len: must be >= 1, got {self.max_dec_len}")
        if self.min_dec_len < 0:
            errors.append(f"min_dec_len: must be >= 0, got {self.min_dec_len}")
        elif self.min_dec_len > self.max_dec_len:
            errors.append(f"min_dec_len: {self.min_dec_len} exceeds max_dec_len {self.max_dec_len}")
        if self.temperature < 0:
            errors.append(f"temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            errors.append(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            errors.append(f"top_k: must be >= 0, got {self.top_k}")
        if self.repetition_penalty <= 0:
            errors.append(f"repetition_penalty: must be > 0, got {self.repetition_penalty}")
