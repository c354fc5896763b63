"""Emulator profiles: a device, a model, engine settings and cost constants, read from YAML.

The data lives in `profiles/{gpus,models,profiles}.yaml`; every constant there names its
source. A `Profile` is frozen; `load_profile(name, **overrides)` returns one with engine or
cost keys replaced (`max_num_seqs=8`, `kv_cache_tokens=3072`, `mfu=0.4`, ...).

KV-cache size, when not given, comes from the memory budget the way vLLM sizes it:
tp x memory x gpu_memory_utilization, minus the weights, minus a per-device activation
reserve, divided by the KV bytes of one token (2 x layers x kv_heads x head_dim x dtype
bytes; bf16, 2, unless the model entry says otherwise).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "CostParams",
    "EngineSettings",
    "GpuSpec",
    "ModelSpec",
    "Profile",
    "list_profiles",
    "load_profile",
]

_DATA = Path(__file__).with_name("profiles")
_GB = 1e9


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    memory_gb: float
    bandwidth_gbs: float
    bf16_tflops: float


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    params: float
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    lm_head_params: float  # vocab x hidden: computed once per sampled token, not per prompt token
    max_model_len: int
    dtype_bytes: int = 2  # per parameter and per KV element: bf16 unless the model says so

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class EngineSettings:
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    block_size: int
    kv_cache_tokens: int | None
    max_model_len: int | None
    # vLLM >= 0.32's admission valve (--max-num-queued-reqs / --max-num-queued-tokens): None is
    # no cap, vLLM's default. See EngineCore.admission for what each one counts.
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    # vLLM's automatic prefix caching (EngineCore's docstring). vLLM turns it on by default; the
    # emulator leaves it off unless asked (`--enable-prefix-caching`), because its load tools
    # send one prompt over and over and every figure measured so far was measured without it.
    enable_prefix_caching: bool = False


@dataclass(frozen=True, slots=True)
class CostParams:
    mfu: float
    bandwidth_efficiency: float
    step_overhead_s: float
    seq_overhead_s: float
    activation_reserve_gb: float
    tp_sync_s_per_layer: float
    eos_mean_tokens: float | None
    overlap: bool = True  # compute and memory overlap (GPU); False: they add (CPU)
    jitter: float = 0.0  # the host's speed wanders: sd of ln(step time), 0 = none (cost.Wander)
    jitter_s: float = 5.0  # ... its correlation time, engine-seconds


@dataclass(frozen=True, slots=True)
class Profile:
    """Everything the core and the server need to emulate one deployment."""

    name: str
    gpu: GpuSpec
    model: ModelSpec
    tp: int
    engine: EngineSettings
    cost: CostParams

    @property
    def num_blocks(self) -> int:
        """Usable KV blocks (vLLM V1 keeps one null block aside)."""
        return max(1, self.kv_cache_tokens // self.engine.block_size - 1)

    @property
    def usable_kv_tokens(self) -> int:
        """Tokens the usable blocks hold: the size vLLM reports (num_gpu_blocks x block_size)."""
        return self.num_blocks * self.engine.block_size

    @property
    def kv_cache_tokens(self) -> int:
        if self.engine.kv_cache_tokens is not None:
            return self.engine.kv_cache_tokens
        budget = self.tp * self.gpu.memory_gb * self.engine.gpu_memory_utilization
        free = (budget - self.tp * self.cost.activation_reserve_gb) * _GB - self.model.weight_bytes
        if free <= 0:
            raise ValueError(
                f"profile {self.name!r}: weights do not fit "
                f"({self.model.weight_bytes / _GB:.1f} GB on {self.tp} x {self.gpu.memory_gb} GB); "
                "raise tp or pick a bigger device"
            )
        return int(free // self.model.kv_bytes_per_token)

    @property
    def max_model_len(self) -> int:
        """The engine's context limit: configured or the model's, never above the KV cache."""
        limit = self.engine.max_model_len or self.model.max_model_len
        return min(limit, self.usable_kv_tokens)


def list_profiles() -> list[str]:
    """Names accepted by `load_profile`, sorted."""
    return sorted(_raw_profiles())


def load_profile(name: str, **overrides: Any) -> Profile:
    """The profile `name`, with engine or cost settings replaced by `overrides`."""
    raw = _resolve(name)
    profile = Profile(
        name=name,
        gpu=GpuSpec(name=raw["gpu"], **_table("gpus")[raw["gpu"]]),
        model=ModelSpec(name=raw["model"], **_table("models")[raw["model"]]),
        tp=int(raw["tp"]),
        engine=EngineSettings(**raw["engine"]),
        cost=CostParams(**raw["cost"]),
    )
    return _apply(profile, overrides) if overrides else profile


def _apply(profile: Profile, overrides: dict[str, Any]) -> Profile:
    engine_keys = {f.name for f in dataclasses.fields(EngineSettings)}
    cost_keys = {f.name for f in dataclasses.fields(CostParams)}
    unknown = set(overrides) - engine_keys - cost_keys - {"tp"}
    if unknown:
        raise ValueError(
            f"unknown profile override(s) {sorted(unknown)}; "
            f"engine keys: {sorted(engine_keys)}, cost keys: {sorted(cost_keys)}"
        )
    engine = dataclasses.replace(
        profile.engine, **{k: v for k, v in overrides.items() if k in engine_keys}
    )
    cost = dataclasses.replace(
        profile.cost, **{k: v for k, v in overrides.items() if k in cost_keys}
    )
    tp = int(overrides.get("tp", profile.tp))
    return dataclasses.replace(profile, engine=engine, cost=cost, tp=tp)


def _resolve(name: str) -> dict[str, Any]:
    profiles = _raw_profiles()
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(sorted(profiles))}")
    spec = dict(profiles[name])
    merged = _resolve(spec.pop("base")) if "base" in spec else _defaults()
    for key, value in spec.items():
        merged[key] = {**merged[key], **value} if isinstance(value, dict) else value
    return merged


def _defaults() -> dict[str, Any]:
    defaults = _load("profiles")["defaults"]
    return {k: dict(v) if isinstance(v, dict) else v for k, v in defaults.items()}


def _raw_profiles() -> dict[str, dict[str, Any]]:
    profiles: dict[str, dict[str, Any]] = _load("profiles")["profiles"]
    return profiles


def _table(name: str) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = _load(name)
    return table


@functools.cache
def _load(name: str) -> dict[str, Any]:
    with (_DATA / f"{name}.yaml").open() as f:
        data: dict[str, Any] = yaml.safe_load(f)
    return data
