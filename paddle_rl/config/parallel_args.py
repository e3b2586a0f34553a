from dataclasses import dataclass

from .fields import arg


@dataclass
class ParallelArgs:
    tensor_parallel_degree: int = arg(1, "Tensor-parallel group size.")
    pipeline_parallel_degree: int = arg(1, "Pipeline stages.")
    sharding_parallel_degree: int = arg(1, "Sharding group size.")
    sharding: str = arg("", "stage1 (optimizer states) | stage2 (+ gradients).")
    sharding_parallel_config: str = arg("", acted=False)
    sequence_parallel: bool = arg(False, acted=False)
    virtual_pp_degree: int = arg(1, acted=False)

    def _validate_parallel(self, errors):
        for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "sharding_parallel_degree", "virtual_pp_degree"):
            if getattr(self, key) < 1:
                errors.append(f"{key}: must be >= 1, got {getattr(self, key)}")
        if self.sharding not in ("", "stage1", "stage2", "stage3"):
            errors.append(f"sharding: must be stage1 or stage2, got {self.sharding!r}")
