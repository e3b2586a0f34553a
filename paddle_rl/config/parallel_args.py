from dataclasses import dataclass

from .fields import arg


def sequence_parallel_refusal(tensor: int, pipe: int) -> str:
    """Why `sequence_parallel: true` cannot run on this grid (the config check and the topology)."""
    if tensor == 1:
        return ("sequence_parallel: true needs tensor_parallel_degree > 1 (it splits the tensor-parallel group's "
                "activations along the sequence; PaddleNLP ignores it without tensor parallelism, this suite refuses "
                "it); set tensor_parallel_degree or sequence_parallel: false")
    return (f"sequence_parallel: true with pipeline_parallel_degree {pipe} is not implemented (the pipeline's stages "
            "exchange whole-sequence activations); use pipeline_parallel_degree 1 or sequence_parallel: false")


def context_parallel_refusal(tensor: int, pipe: int, sharding: str, rollout_tensor: int) -> str:
    """Why `context_parallel_degree` > 1 cannot run with these keys ('' where it can): the config check and the
    topology."""
    what = []
    if tensor > 1:
        what.append(f"tensor_parallel_degree {tensor} (the all-to-all splits whole heads; with tensor parallelism "
                    "the heads are split already)")
    if pipe > 1:
        what.append(f"pipeline_parallel_degree {pipe} (the stages exchange whole-sequence activations)")
    if sharding == "stage3":
        what.append("sharding: stage3 (each layer's gather would run per token slice)")
    if rollout_tensor not in (-1, 1):
        what.append(f"rollout_tensor_parallel_degree {rollout_tensor} (each context-parallel group decodes on its "
                    "first rank, on the whole model)")
    if not what:
        return ""
    return ("context_parallel_degree > 1 is not implemented with " + "; with ".join(what) +
            "; use data parallelism and sharding stage1 / stage2 beside it, or context_parallel_degree 1")


STAGE3_AT_DEGREE_1 = ("sharding: stage3 partitions the parameters over sharding_parallel_degree ranks, and at "
                      "degree 1 there is nothing to partition (PaddleNLP drops it there without a word); set "
                      "sharding_parallel_degree > 1 (or -1) or leave sharding empty")


@dataclass
class ParallelArgs:
    tensor_parallel_degree: int = arg(1, "Tensor-parallel group size (attention heads, MLP and vocabulary split).")
    pipeline_parallel_degree: int = arg(1, "Pipeline stages (decoder layers split into consecutive stages).")
    sharding_parallel_degree: int = arg(1, "Sharding group size: ranks that split the batch and partition the "
                                           "optimizer states (and with stage2 the gradients). -1 (PaddleNLP): "
                                           "with a `sharding` stage, every rank that tensor x pipeline (x "
                                           "data_parallel_degree, when given) leave; without one, 1.")
    data_parallel_degree: int = arg(-1, "Data-parallel replicas (-1: world size / (tensor x pipeline x sharding); "
                                        "1 when sharding_parallel_degree is -1, which takes those ranks).")
    sharding: str = arg("", "stage1 (optimizer states) | stage2 (+ gradients) | stage3 (+ parameters: each rank "
                            "keeps 1/sharding_parallel_degree of every tensor, each decoder layer gathered for its "
                            "forward and backward; pipeline_parallel_degree 1); empty means stage1 when "
                            "sharding_parallel_degree > 1.")
    rollout_tensor_parallel_degree: int = arg(-1, "Tensor-parallel size of the rollout (-1: tensor_parallel_degree); "
                                                  "weights are resharded in memory before and after each rollout.")
    collective_timeout: float = arg(1800.0, "Seconds a rank of a multi-process run waits inside one collective "
                                            "(all-reduce, gather, broadcast, barrier, send/recv) before it stops, "
                                            "naming the collective, the step and the state of its peers (a peer "
                                            "that died or exited stops the others at once). On CPU, gloo also "
                                            "gives up on any single wait after 30 s by itself (fixed in Paddle "
                                            "3.3.1), so only values below 30 shorten the wait there.",
                                    aliases=("ddp_timeout",))
    sharding_parallel_config: str = arg("", "PaddleNLP's sharding options, space or comma separated: "
                                            "enable_release_grads (the gradients freed after each optimizer step, "
                                            "what release_grads: true does). Its other options tune Paddle fleet's "
                                            "own sharding communication (tensor fusion, overlap, reduce_avg) and are "
                                            "refused by name: the sharding here issues its own collectives "
                                            "(parallel/sharding.py).")
    sequence_parallel: bool = arg(False, "Megatron-style sequence parallelism on the tensor-parallel group: the "
                                         "activations outside the tensor-parallel blocks (the residual stream, the "
                                         "norms, the embedding's output) hold 1/tensor_parallel_degree of the "
                                         "tokens on each rank; each block all-gathers its input and reduce-scatters "
                                         "its output instead of the all-reduce. Needs tensor_parallel_degree > 1 "
                                         "and pipeline_parallel_degree 1 (PaddleNLP ignores it without tensor "
                                         "parallelism; refused here). The rollout's decoding is unchanged.")
    context_parallel_degree: int = arg(1, "Ulysses sequence parallelism (verl's "
                                          "actor_rollout_ref.actor.ulysses_sequence_parallel_size, ms-swift's "
                                          "sequence_parallel_size): this many ranks split every sequence of the "
                                          "update and log-prob passes (actor, reference, critic) into contiguous "
                                          "token slices; around each attention core an all-to-all trades the token "
                                          "split for a split of the heads, so attention sees whole sequences; the "
                                          "norms, MLP, LM head and log-probs run on each rank's own tokens. The "
                                          "ranks of a group hold the same rows; their gradients are summed as data "
                                          "parallelism's (world = data x sharding x context). num_attention_heads "
                                          "must divide by it, and num_key_value_heads divide it or be divisible by "
                                          "it (fewer key/value heads than the degree are repeated). Needs "
                                          "tensor_parallel_degree, pipeline_parallel_degree and "
                                          "rollout_tensor_parallel_degree 1 and no stage3, and padded micro-batches "
                                          "with share_prompt_prefix: false (or use_remove_padding: true); no MoE "
                                          "models. The rollout is not split: each group's first rank decodes its "
                                          "prompts and hands the responses to the others.",
                                  aliases=("ulysses_sequence_parallel_size",))
    virtual_pp_degree: int = arg(1, "Chunks of layers per pipeline stage (interleaved 1F1B, Megatron's virtual "
                                    "pipeline): the decoder layers split into pipeline_parallel_degree x k chunks, "
                                    "stage r holding chunks r, r + pipeline_parallel_degree, ...; the schedule's "
                                    "idle time shrinks by about k for k times the transfers. Needs "
                                    "pipeline_parallel_degree > 1, num_hidden_layers divisible by "
                                    "pipeline_parallel_degree x k, and in training a number of micro-batches per "
                                    "mini-batch that is a multiple of pipeline_parallel_degree.")

    def _resolve_sharding_degree(self, given) -> None:
        """PaddleNLP derives sharding_parallel_degree -1 only when a sharding stage is named; otherwise there is
        no sharding."""
        if self.sharding_parallel_degree == -1 and not self.sharding:
            self.sharding_parallel_degree = 1

    @property
    def sharding_options(self) -> tuple:
        return tuple(w for w in str(self.sharding_parallel_config or "").replace(",", " ").split())

    def _validate_parallel(self, errors):
        other = [o for o in self.sharding_options if o != "enable_release_grads"]
        if other:
            errors.append(f"sharding_parallel_config: {', '.join(other)}: options of Paddle fleet's sharding "
                          "communication (tensor fusion, overlap, reduce_avg); the sharding here issues its own "
                          "collectives (parallel/sharding.py) and has no such switch; only enable_release_grads is "
                          "taken")
        for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "virtual_pp_degree",
                    "context_parallel_degree"):
            if getattr(self, key) < 1:
                errors.append(f"{key}: must be >= 1, got {getattr(self, key)}")
        for key in ("sharding_parallel_degree", "data_parallel_degree", "rollout_tensor_parallel_degree"):
            if getattr(self, key) == 0 or getattr(self, key) < -1:
                errors.append(f"{key}: must be >= 1 or -1, got {getattr(self, key)}")
        if not self.collective_timeout > 0:
            errors.append(f"collective_timeout: must be > 0 seconds, got {self.collective_timeout}")
        if self.virtual_pp_degree > 1 and self.pipeline_parallel_degree == 1:
            errors.append(f"virtual_pp_degree {self.virtual_pp_degree} needs pipeline_parallel_degree > 1 (it splits "
                          "each pipeline stage into chunks of layers); set it to 1 or add pipeline stages")
        if self.sharding not in ("", "stage1", "stage2", "stage3"):
            errors.append(f"sharding: must be stage1, stage2 or stage3, got {self.sharding!r}")
        if self.sequence_parallel and (self.tensor_parallel_degree == 1 or self.pipeline_parallel_degree > 1):
            errors.append(sequence_parallel_refusal(self.tensor_parallel_degree, self.pipeline_parallel_degree))
        if self.context_parallel_degree > 1:
            refusal = context_parallel_refusal(self.tensor_parallel_degree, self.pipeline_parallel_degree,
                                               self.sharding if self.sharding_parallel_degree != 1 else "",
                                               self.rollout_tensor_parallel_degree)
            if refusal:
                errors.append(refusal)
        if self.sharding == "stage3" and self.sharding_parallel_degree == 1:  # PaddleNLP drops it there, silently
            errors.append(STAGE3_AT_DEGREE_1)
        if self.sharding == "stage3" and self.pipeline_parallel_degree > 1:
            errors.append("sharding: stage3 with pipeline_parallel_degree > 1 is not implemented (each stage already "
                          "holds only its layers); use stage2 with a pipeline")
