"""Where the old-policy log-probs come from: the rollout, the update's own forward, or a pass of their own."""


def reuses_rollout_logprobs(config, mini_batches_per_step: int) -> bool:
    """Whether the old-policy log-probs are the rollout's own (`reuse_rollout_logprobs`).

    The rollout samples from, and records log softmax(logits / T) of, the very weights the old-log-prob pass
    would recompute, so the two agree to float rounding (tests/test_rollout_logprobs.py bounds the gap).
    `auto` reuses them when the update is on-policy (one mini-batch per step, update_iters 1), where the
    PPO ratio is 1 up to that rounding; `on` always; `off` never. With rollout correction on (rollout_is,
    rollout_rs, the veto) never: the correction needs both; nor with an asynchronous rollout that may lag. With a
    16-bit KV cache (kv_cache_dtype) the rollout attends to rounded keys and values, and with rollout_dtype bfloat16
    or a rollout_quant_type it multiplies by rounded weights, and with bf16 the trainer does, so `auto` recomputes."""
    mode = str(getattr(config, "reuse_rollout_logprobs", "off")).lower()
    if getattr(config, "rollout_correction", False):
        return False  # the correction compares the rollout's log-probs with recomputed ones (config refuses "on")
    if getattr(config, "async_rollout", False) and config.max_staleness > 0:
        return False  # the rollout's weights may be older than the trainer's (config refuses "on")
    if mode == "on":
        return True
    if mode == "auto":
        exact = (str(getattr(config, "kv_cache_dtype", "auto")) in ("auto", "float32")
                 and str(getattr(config, "rollout_dtype", "float32")) == "float32"
                 and not getattr(config, "bf16", False)  # bf16 training against a float32 rollout
                 and not getattr(config, "rollout_quant_type", ""))
        return exact and mini_batches_per_step == 1 and config.update_iters == 1
    return False


def old_logprobs_from_update(config, mini_batches_per_step: int, uses_critic: bool) -> bool:
    """Whether the old-policy log-probs are the update's own forward's, gradient stopped, with no pass of their own
    (`old_logprob_pass: auto`). On-policy (one mini-batch per step, update_iters 1) the weights that pass would run
    are the ones the update's forward runs, so pi_old is pi_theta detached and the PPO ratio is exactly 1. Not when
    something reads them before the update: the reward KL (kl_coeff > 0), a critic's returns, rollout correction (its
    weights and rejections enter the loss), an asynchronous rollout that may lag; nor under a pipeline (only its last
    stage sees the log-probs). The trainer then logs the pass's metrics after the update (`actor/ref_kl`, the
    rollout_corr gap metrics and greedy_differs, from the update's own log-probs and argmax)."""
    if str(getattr(config, "old_logprob_pass", "on")) != "auto":
        return False
    lagging = getattr(config, "async_rollout", False) and config.max_staleness > 0
    return (mini_batches_per_step == 1 and config.update_iters == 1 and config.kl_coeff == 0 and not uses_critic
            and not getattr(config, "rollout_correction", False) and not lagging
            and config.pipeline_parallel_degree == 1)
