"""LoRA adapters on the column and row layers of layers.py, in PEFT's conventions and files.

A linear layer y = x W gains y += (dropout(x) A) B * scaling, scaling = lora_alpha / r (lora_alpha / sqrt(r)
with rsLoRA); A starts as PEFT's (uniform in +-1/sqrt(in), here drawn from a generator seeded by the seed and the
tensor's name, so every layout starts alike), B at zero, and the base weights are frozen.

Fused projections keep one adapter per Hugging Face module: q_proj, k_proj and v_proj (gate_proj, up_proj) each
have their own A [in, r] and B [r, out_part], as PEFT puts them on the unfused modules. The fused layer runs
x [A_q | A_k | A_v] once, then each part's B on its r columns (a part without an adapter adds nothing).

Tensor parallelism follows the base layer: in a column layer A is replicated and B splits its output like the
weight (x A is computed before the group's copy, whose backward sums the gradient of x A over the ranks); in a
row layer A splits its input like the weight, x A is summed over the group, and B is replicated. Each adapter
parameter carries a `ParamSpec` with its PEFT tensor names (without PEFT's `base_model.model.` prefix), so
loading, saving, sharding and gradient norms treat it as any other parameter.

Three ways to run an adapted layer:
- adapters on (training, the old-policy pass): the base matmul plus the low-rank path;
- merged (`merged_weights`): W + A B * scaling computed once per rollout and used instead of W (one matmul per
  layer in every decode step); the copies are dropped afterwards, so the base weights never drift;
- off (`adapters_off`): the base model itself, which is the reference policy: no second copy is loaded.
"""
import contextlib
import hashlib
import json
import math
import os
import re
import zlib
from dataclasses import MISSING, dataclass, fields, replace
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import paddle
import paddle.nn as nn
import paddle.nn.functional as F

from ..model_files.safetensors_io import read_file
from ..parallel.collectives import copy_to_group, group_size, reduce_from_group
from .layers import Bf16Products, ColumnLinear, ParamSpec, RowLinear, _param

ALL_LINEAR = "all-linear"
PEFT_PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


class AdapterError(ValueError):
    """An adapter folder or LoRA setting that cannot be used (names the file or key)."""


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Tuple[str, ...] = (ALL_LINEAR,)
    use_rslora: bool = False
    seed: int = 42
    save_merged: bool = False  # checkpoints also hold the merged weights in the Hugging Face layout
    where: str = "lora_target_modules"  # the key or file the targets came from (for errors)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def peft_config(self, modules: Sequence[str], base: str = "", task_type: str = "CAUSAL_LM",
                    modules_to_save: Optional[Sequence[str]] = None) -> dict:
        """adapter_config.json for the adapted module names (short names, as PEFT writes them); a sequence
        classifier (the critic) is task_type SEQ_CLS with its head in `modules_to_save`."""
        return {"peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base, "r": self.rank,
                "lora_alpha": self.alpha, "lora_dropout": self.dropout, "use_rslora": self.use_rslora,
                "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules}), "bias": "none",
                "fan_in_fan_out": False, "init_lora_weights": True,
                "modules_to_save": list(modules_to_save) if modules_to_save else None, "use_dora": False,
                "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
                "inference_mode": False}

    @classmethod
    def from_peft(cls, folder: str, **overrides) -> "LoraSettings":
        """The settings of a PEFT adapter folder (what this implementation cannot reproduce is an error)."""
        path = os.path.join(folder, CONFIG_FILE)
        if not os.path.isfile(path):
            raise AdapterError(f"{folder}: no {CONFIG_FILE} (not a PEFT adapter folder)")
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        found = {k: cfg.get(k) for k in ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern",
                                         "alpha_pattern", "layers_to_transform", "target_parameters")}
        unsupported = [(k, v) for k, v in found.items() if v]
        unsupported += [(k, cfg[k]) for k, ok in (("peft_type", "LORA"), ("bias", "none")) if cfg.get(k, ok) != ok]
        if unsupported:
            raise AdapterError(f"{path}: {', '.join(f'{k}: {v!r}' for k, v in unsupported)} is not supported (plain "
                               "LoRA adapters on linear modules only)")
        targets = cfg.get("target_modules") or ()
        targets = (targets,) if isinstance(targets, str) else tuple(targets)
        return replace(cls(rank=int(cfg["r"]), alpha=float(cfg.get("lora_alpha", 8)),
                           dropout=float(cfg.get("lora_dropout", 0.0)), target_modules=targets,
                           use_rslora=bool(cfg.get("use_rslora", False)), where=f"{path} target_modules"), **overrides)


def lora_settings(config) -> Optional[LoraSettings]:
    """A run's LoRA settings (None without LoRA). With lora_path they are the adapter file's; a LoRA key the
    config sets to another value than the file's is an error naming both (lora_dropout, a training setting,
    may differ and acts)."""
    if not config.uses_lora:
        return None
    settings = LoraSettings(rank=config.lora_rank or 8, alpha=float(config.lora_alpha), dropout=config.lora_dropout,
                            target_modules=tuple(config.lora_target_modules), use_rslora=config.rslora,
                            seed=config.seed, save_merged=config.merge_lora)
    if not config.lora_path:
        return settings
    saved = LoraSettings.from_peft(config.lora_path, seed=config.seed, save_merged=config.merge_lora)
    defaults = {f.name: (f.default if f.default_factory is MISSING else f.default_factory())
                for f in fields(type(config))}
    checks = (("lora_rank", saved.rank, lambda v: v), ("lora_alpha", saved.alpha, float),
              ("lora_target_modules", list(saved.target_modules), list), ("rslora", saved.use_rslora, bool))
    clashes = [f"{key} {getattr(config, key)!r} (the adapter has {theirs!r})" for key, theirs, cast in checks
               if getattr(config, key) != defaults[key] and cast(getattr(config, key)) != theirs]
    if clashes:
        raise AdapterError(f"{os.path.join(config.lora_path, CONFIG_FILE)} disagrees with the config: "
                           f"{'; '.join(clashes)}. The adapter's settings are used: remove these keys")
    if config.lora_dropout != defaults["lora_dropout"]:
        saved = replace(saved, dropout=config.lora_dropout)
    return saved


# ---------------------------------------------------------------- the adapter layers
def _init_a(name: str, shape, fan_in: int, seed: int) -> np.ndarray:
    """PEFT's A: kaiming_uniform(a=sqrt(5)) = uniform(-1/sqrt(fan_in), 1/sqrt(fan_in)), from a generator of its own."""
    bound = 1.0 / math.sqrt(fan_in)
    return np.random.default_rng([seed, zlib.crc32(name.encode())]).uniform(-bound, bound, shape).astype(np.float32)


class Adapter(Bf16Products):
    """The low-rank path of one base layer: A [in_local, k r] and B [r, out_local] with their specs. With `bf16`
    (its base layer's, CausalLM.set_bf16) the products x A and (x A) B take bfloat16 operands with float32 sums,
    forward and gradients (ops.bf16_linear); the merged weight W + A B * scaling is summed in float32 either way."""

    def __init__(self, settings: LoraSettings, a_spec: ParamSpec, a_shape, b_spec: ParamSpec, b_shape, group):
        super().__init__()
        self.rank, self.scaling, self.p = settings.rank, settings.scaling, settings.dropout
        self.group = group
        self.lora_A = _param(self, a_shape, a_spec, group, init=nn.initializer.Constant(0.0))
        self.lora_B = _param(self, b_shape, b_spec, group, init=nn.initializer.Constant(0.0))
        self.merged = None    # W + A B * scaling while merged_weights is on
        self.enabled = True   # False while adapters_off is on

    def reset(self, seed: int, fan_in: int) -> None:
        """PEFT's initialisation: A random (the full tensor drawn once, this rank takes its shard), B zero."""
        spec = self.lora_A.spec
        full = np.concatenate([_init_a(n, (self.rank, fan_in), fan_in, seed) for n in spec.hf_names], axis=0)
        rank, size = (0, 1) if self.group is None else (self.group.rank, self.group.nranks)
        self.lora_A.set_value(paddle.to_tensor(spec.shard(full.T, rank, size)))
        self.lora_B.set_value(paddle.zeros_like(self.lora_B))

    def weight(self, base):
        """The weight the base layer multiplies by: its own, or the merged one."""
        return base if self.merged is None else self.merged

    def add(self, x, y, tokens=None):
        """y plus the low-rank path of x (nothing while merged or off); `tokens` (sequence parallelism) as the base
        layer's: x A runs on the tokens x holds and its r columns cross the group (decoder.py
        sequence_parallel_parameters names the adapter tensor then applied to this rank's tokens only)."""
        if self.merged is not None or not self.enabled:
            return y
        if self.p > 0 and self.training:
            x = F.dropout(x, self.p, training=True)
        return y + self.delta(self.product(x, self.lora_A) * self.scaling, tokens)  # scaled while [tokens, r]

    def merge(self, base) -> None:
        with paddle.no_grad():
            self.merged = base + self.weight_delta() * self.scaling

    def unmerge(self) -> None:
        self.merged = None


class ColumnAdapter(Adapter):
    """On a ColumnLinear: one A and one B per adapted Hugging Face module of the fused projection."""

    def __init__(self, base: ColumnLinear, adapted: List[int], settings: LoraSettings):
        group, tp, spec = base.group, group_size(base.group), base.weight.spec
        names = [base.module_names[i] for i in adapted]
        r = settings.rank
        a_spec = ParamSpec(tuple(f"{n}.lora_A.weight" for n in names), True, None, (r,) * len(names))
        b_spec = ParamSpec(tuple(f"{n}.lora_B.weight" for n in names), True, 1, tuple(spec.parts[i] for i in adapted))
        super().__init__(settings, a_spec, [base.weight.shape[0], r * len(names)], b_spec,
                         [r, b_spec.local_size(tp)], group)
        self.adapted = adapted
        self.part_sizes = [spec.local_part(p, tp) for p in spec.parts]  # this rank's output columns of each part

    def delta(self, h, tokens=None):
        """h = x A [.., k r] -> [.., out_local]; `tokens`: h of this rank's tokens, all-gathered (backward:
        reduce-scatter), so A's gradient covers this rank's tokens."""
        if tokens is not None:
            h = tokens.gather(h)
        elif self.group is not None:
            h = copy_to_group(h, self.group)  # its backward sums the gradient of x A over the ranks
        return self._through_b(h, self.product)

    def weight_delta(self):
        return self._through_b(self.lora_A, paddle.matmul)

    def _through_b(self, h, product):
        """Each adapted part's B on its r columns of h (by `product`), zeros for the parts without an adapter."""
        if len(self.part_sizes) == 1:
            return product(h, self.lora_B)
        pieces, col = [], 0
        for j, size in enumerate(self.part_sizes):
            if j in self.adapted:
                k = self.adapted.index(j)
                pieces.append(product(h[..., k * self.rank:(k + 1) * self.rank], self.lora_B[:, col:col + size]))
                col += size
            else:
                pieces.append(paddle.zeros(h.shape[:-1] + [size], dtype=h.dtype))
        return paddle.concat(pieces, axis=-1)


class RowAdapter(Adapter):
    """On a RowLinear: A split over the input like the weight, x A summed over the group, B replicated."""

    def __init__(self, base: RowLinear, settings: LoraSettings):
        group, tp, name = base.group, group_size(base.group), base.module_names[0]
        in_features = base.weight.spec.parts[0]
        r = settings.rank
        a_spec = ParamSpec((f"{name}.lora_A.weight",), True, 0, (in_features,))
        b_spec = ParamSpec((f"{name}.lora_B.weight",), True)
        super().__init__(settings, a_spec, [a_spec.local_size(tp), r], b_spec, [r, base.weight.shape[1]], group)

    def delta(self, h, tokens=None):
        """`tokens`: x A of every token reduce-scattered to this rank's tokens, so B's gradient covers those."""
        if tokens is not None:
            h = tokens.reduce_scatter(h)
        elif self.group is not None:
            h = reduce_from_group(h, self.group)
        return self.product(h, self.lora_B)

    def weight_delta(self):
        return paddle.matmul(self.lora_A, self.lora_B)  # this rank's input rows of A B


# ---------------------------------------------------------------- a model's adapters
def adaptable(model) -> Dict[str, Tuple[nn.Layer, int]]:
    """{Hugging Face module name: (layer, part index)} of every linear module an adapter can go on (the decoder's
    column and row layers; not the vocabulary head)."""
    out = {}
    for _, layer in model.named_sublayers():
        if isinstance(layer, (ColumnLinear, RowLinear)) and not layer.weight.spec.pad:
            for i, name in enumerate(layer.module_names):
                out[name] = (layer, i)
    return out


def _matches(name: str, targets: Sequence[str]) -> Optional[str]:
    """The target that selects module `name` (PEFT: a list names modules by their last components, a single
    string other than all-linear is a regular expression over the whole name)."""
    for t in targets:
        if t == ALL_LINEAR or name == t or name.endswith("." + t):
            return t
    return None


def add_adapters(model, settings: LoraSettings) -> List[str]:
    """Put adapters on the modules `settings.target_modules` names, freeze every other parameter; returns the
    adapted module names. Errors name the key (or adapter file) and the modules there are."""
    modules = adaptable(model)
    targets = tuple(settings.target_modules)
    if not targets:
        raise AdapterError(f"{settings.where}: no modules named")
    if ALL_LINEAR in targets and getattr(model, "moe", None) is not None:
        raise AdapterError(f"{settings.where}: {ALL_LINEAR} on a Mixture-of-Experts model would leave the experts "
                           "without adapters (they are not adapted here): name the modules, e.g. [q_proj, k_proj, "
                           "v_proj, o_proj]")
    regex = targets[0] if len(targets) == 1 and targets[0] != ALL_LINEAR and not _short(targets[0]) else None
    chosen = {n for n in modules if (re.fullmatch(regex, n) if regex else _matches(n, targets))}
    if regex is None:
        unused = [t for t in targets if t != ALL_LINEAR and not any(_matches(n, (t,)) for n in chosen)]
        if unused:
            short = sorted({n.rsplit(".", 1)[-1] for n in modules})
            raise AdapterError(f"{settings.where}: {', '.join(unused)} names no linear module of this model (modules: "
                               f"{', '.join(short)}, or {ALL_LINEAR})")
    if not chosen:
        raise AdapterError(f"{settings.where}: {regex!r} matches no linear module of this model")
    by_layer: Dict[int, Tuple[nn.Layer, List[int]]] = {}
    for name in sorted(chosen, key=lambda n: list(modules).index(n)):
        layer, part = modules[name]
        by_layer.setdefault(id(layer), (layer, []))[1].append(part)
    for p in model.parameters():
        p.stop_gradient = True
    for layer, parts in by_layer.values():
        adapter = ColumnAdapter(layer, sorted(parts), settings) if isinstance(layer, ColumnLinear) else \
            RowAdapter(layer, settings)
        adapter.reset(settings.seed, layer.weight.spec.parts[0] if isinstance(layer, RowLinear)
                      else layer.weight.shape[0])
        layer.lora = adapter
    model.lora = settings
    return sorted(chosen, key=lambda n: list(modules).index(n))


def _short(target: str) -> bool:
    return re.fullmatch(r"[A-Za-z0-9_.]+", target) is not None


def adapters(model) -> Iterator[Tuple[nn.Layer, Adapter]]:
    for _, layer in model.named_sublayers():
        if isinstance(layer, (ColumnLinear, RowLinear)) and layer.lora is not None:
            yield layer, layer.lora


@contextlib.contextmanager
def merged_weights(model):
    """Every adapted layer multiplies by W + A B * scaling (computed now, dropped on exit): the rollout's
    weights, one matmul per layer. Nothing happens for a model without adapters."""
    pairs = list(adapters(model))
    try:
        for layer, a in pairs:
            a.merge(layer.weight)
        yield model
    finally:
        for _, a in pairs:
            a.unmerge()


@contextlib.contextmanager
def adapters_off(model):
    """The base model (the reference policy of a LoRA run)."""
    pairs = list(adapters(model))
    try:
        for _, a in pairs:
            a.enabled = False
        yield model
    finally:
        for _, a in pairs:
            a.enabled = True


# ---------------------------------------------------------------- Hugging Face / PEFT states
def is_adapter_name(hf_name: str) -> bool:
    return ".lora_A." in hf_name or ".lora_B." in hf_name


def adapted_modules(state: Dict[str, np.ndarray]) -> List[str]:
    """The modules a state holds adapters of (`model.layers.0.self_attn.q_proj`), sorted."""
    return sorted(k[:-len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight"))


def fold_adapters(base: Dict[str, np.ndarray], adapters: Dict[str, np.ndarray], scaling: float
                  ) -> Dict[str, np.ndarray]:
    """{module.weight: W + B A * scaling} (float32, HF orientation) for each module `adapters` adapts, W from `base`
    (a KeyError names a module without its weight or its lora_B)."""
    out = {}
    for module in adapted_modules(adapters):
        w, a, b = base[f"{module}.weight"], adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"]
        out[f"{module}.weight"] = (w + scaling * (b @ a)).astype(np.float32)
    return out


def base_digest(state: Dict[str, np.ndarray], modules: Sequence[str]) -> str:
    """sha256 of the named modules' base weights (name, shape and float32 bytes, in order): an adapter-only push
    checks with it that the receiver's base is the sender's."""
    digest = hashlib.sha256()
    for module in modules:
        w = np.ascontiguousarray(state[f"{module}.weight"], dtype=np.float32)
        digest.update(f"{module}.weight{list(w.shape)}".encode())
        digest.update(memoryview(w).cast("B"))
    return digest.hexdigest()


def merge_state(state: Dict[str, np.ndarray], settings: Optional[LoraSettings]) -> Dict[str, np.ndarray]:
    """A Hugging Face state with its adapters folded in (W += B A * scaling, HF orientation) and their tensors
    removed: what transformers loads without PEFT (PEFT's merge_and_unload)."""
    if settings is None:
        return state
    out = {k: v for k, v in state.items() if not is_adapter_name(k)}
    out.update(fold_adapters(out, state, settings.scaling))
    return out


def save_adapter(folder: str, state: Dict[str, np.ndarray], settings: LoraSettings, base: str = "",
                 modules_to_save: Sequence[str] = ()) -> None:
    """adapter_config.json and adapter_model.safetensors (PEFT's names: `base_model.model.` + the module's).
    `modules_to_save` (a sequence classifier's head, ["score"]): modules trained whole, written as PEFT writes
    them (`base_model.model.score.weight`), with task_type SEQ_CLS."""
    from safetensors.numpy import save_file
    whole = tuple(m + "." for m in modules_to_save)
    adapter = {PEFT_PREFIX + k: np.ascontiguousarray(v) for k, v in state.items()
               if is_adapter_name(k) or k.startswith(whole)}
    os.makedirs(folder, exist_ok=True)
    modules = sorted({k[:-len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")})
    config = settings.peft_config(modules, base, "SEQ_CLS", modules_to_save) if modules_to_save else \
        settings.peft_config(modules, base)
    with open(os.path.join(folder, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    save_file(adapter, os.path.join(folder, WEIGHTS_FILE), metadata={"format": "pt"})


def read_adapter(folder: str) -> Dict[str, np.ndarray]:
    """The adapter tensors of a PEFT folder under the module names (`base_model.model.` and PEFT's adapter name
    `.default` removed)."""
    path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise AdapterError(f"{folder}: no {WEIGHTS_FILE} (not a PEFT adapter folder)")
    out = {}
    for key, value in read_file(path).items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        out[name.replace(".default.weight", ".weight")] = value
    return out


def has_adapter(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, CONFIG_FILE))


__all__ = ["LoraSettings", "lora_settings", "AdapterError", "add_adapters", "adapters", "merged_weights",
           "adapters_off", "merge_state", "fold_adapters", "adapted_modules", "base_digest", "save_adapter",
           "read_adapter", "has_adapter", "is_adapter_name", "ALL_LINEAR"]
