from dataclasses import dataclass

from .fields import arg


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
    sharding_parallel_config: str = arg("", acted=False)
    sequence_parallel: bool = arg(False, acted=False)
    virtual_pp_degree: int = arg(1, acted=False)

    def _resolve_sharding_degree(self, given) -> None:
        """PaddleNLP derives sharding_parallel_degree -1 only when a sharding stage is named; otherwise there is
        no sharding."""
        if self.sharding_parallel_degree == -1 and not self.sharding:
            self.sharding_parallel_degree = 1

    def _validate_parallel(self, errors):
        for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "virtual_pp_degree"):
            if getattr(self, key) < 1:
                errors.append(f"{key}: must be >= 1, got {getattr(self, key)}")
        for key in ("sharding_parallel_degree", "data_parallel_degree", "rollout_tensor_parallel_degree"):
            if getattr(self, key) == 0 or getattr(self, key) < -1:
                errors.append(f"{key}: must be >= 1 or -1, got {getattr(self, key)}")
        if not self.collective_timeout > 0:
            errors.append(f"collective_timeout: must be > 0 seconds, got {self.collective_timeout}")
        if self.sharding not in ("", "stage1", "stage2", "stage3"):
            errors.append(f"sharding: must be stage1, stage2 or stage3, got {self.sharding!r}")
        if self.sharding == "stage3" and self.sharding_parallel_degree == 1:  # PaddleNLP drops it there, silently
            errors.append(STAGE3_AT_DEGREE_1)
        if self.sharding == "stage3" and self.pipeline_parallel_degree > 1:
            errors.append("sharding: stage3 with pipeline_parallel_degree > 1 is not implemented (each stage already "
                          "holds only its layers); use stage2 with a pipeline")
