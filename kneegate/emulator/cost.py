"""Step time from a roofline.

    step = overhead + seqs x seq_overhead + tp_sync + max(compute, memory)   # overlap: true
    step = overhead + seqs x seq_overhead + tp_sync + compute + memory       # overlap: false

    compute = FLOPs / (tp x peak x mfu)
      FLOPs = 2 (params - lm_head) per token processed      # every layer's matmuls
            + 2 lm_head per sequence sampled this step        # logits only for the last token
            + 4 layers hidden x new tokens x mean context     # QK^T and AV
    memory  = (weight bytes + KV bytes read) / (tp x bandwidth x efficiency)
      KV bytes read = sum over scheduled sequences of context x KV bytes per token

Decode is memory bound at small batches (the weights are read once per step whatever the
batch), so throughput first grows almost linearly with the batch; once the FLOPs of the batch
outweigh the weight read, compute bounds the step and throughput flattens: the plateau.

A GPU overlaps the two (the default). On a CPU (`overlap: false`) they add: the core that
streams the weights also does the arithmetic, so a step costs a fixed part (the weight read)
plus a part per sequence (its FLOPs and KV read), and throughput b / step(b) bends smoothly
towards 1 / per-sequence cost instead of turning the roofline's corner. Measured on vLLM's CPU
build (profile cpu-tiny-avx2): the max() form, fitted, missed the live tok/s curve by up to
24%; the sum fits it within 7%.

A real host's speed is not constant: on vLLM's CPU build 5-second windows held at one level
read throughputs ~6-10% apart (docs/history/benchmarks.md, "A plateau read over 1.5x"). `Wander`
models that (profile keys `jitter`, `jitter_s`): each step's time is multiplied by exp(x),
x an Ornstein-Uhlenbeck process in engine time with sd `jitter` and correlation time
`jitter_s` (a window of one correlation time averages to an sd of ~0.86 x `jitter`).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kneegate.emulator.profiles import Profile

__all__ = ["StepCost", "Wander"]


@dataclass(frozen=True, slots=True)
class StepCost:
    """Precomputed rates of one profile; `seconds(...)` prices one scheduled batch."""

    fixed_s: float  # per step: host overhead + tensor-parallel sync
    seq_s: float  # per scheduled sequence
    flop_s: float  # seconds per FLOP
    byte_s: float  # seconds per byte of HBM traffic
    token_flops: float  # FLOPs per processed token (without lm_head)
    sample_flops: float  # FLOPs per sampled token (lm_head)
    attn_flops: float  # FLOPs per (new token x context token)
    weight_bytes: float
    kv_bytes: float  # per token of context
    overlap: bool = True  # max(compute, memory); False: compute + memory

    @classmethod
    def from_profile(cls, p: Profile) -> StepCost:
        m, c = p.model, p.cost
        sync = c.tp_sync_s_per_layer * m.layers if p.tp > 1 else 0.0
        return cls(
            fixed_s=c.step_overhead_s + sync,
            seq_s=c.seq_overhead_s,
            flop_s=1.0 / (p.tp * p.gpu.bf16_tflops * 1e12 * c.mfu),
            byte_s=1.0 / (p.tp * p.gpu.bandwidth_gbs * 1e9 * c.bandwidth_efficiency),
            token_flops=2.0 * (m.params - m.lm_head_params),
            sample_flops=2.0 * m.lm_head_params,
            attn_flops=4.0 * m.layers * m.hidden,
            weight_bytes=m.weight_bytes,
            kv_bytes=float(m.kv_bytes_per_token),
            overlap=c.overlap,
        )

    def seconds(
        self, seqs: int, tokens: int, sampled: int, attn_pairs: float, context: int
    ) -> float:
        """Time of one step.

        seqs: sequences scheduled; tokens: tokens processed; sampled: sequences producing a
        token; attn_pairs: sum of new tokens x their mean context; context: KV tokens read.
        """
        if seqs == 0:
            return 0.0
        flops = (
            tokens * self.token_flops + sampled * self.sample_flops + attn_pairs * self.attn_flops
        )
        compute = flops * self.flop_s
        memory = (self.weight_bytes + context * self.kv_bytes) * self.byte_s
        roof = max(compute, memory) if self.overlap else compute + memory
        return self.fixed_s + seqs * self.seq_s + roof


class Wander:
    """The host's speed as a factor on step time: exp(x), x an Ornstein-Uhlenbeck process with
    sd `sigma` and correlation time `tau`, advanced by each step's own (engine) time. Its own
    seeded random stream, so a profile without jitter draws nothing and runs as before."""

    def __init__(self, sigma: float, tau: float, seed: int) -> None:
        if sigma < 0 or tau <= 0:
            raise ValueError(f"jitter must be >= 0 and jitter_s > 0, got {sigma} and {tau}")
        self.sigma, self.tau = sigma, tau
        self._rng = random.Random(seed)
        self._x = self._rng.gauss(0.0, sigma) if sigma > 0 else 0.0

    def factor(self, seconds: float) -> float:
        """The factor for a step that would take `seconds` at the mean speed."""
        if self.sigma == 0 or seconds <= 0:
            return 1.0
        keep = math.exp(-seconds / self.tau)
        self._x = self._x * keep + self.sigma * math.sqrt(1 - keep * keep) * self._rng.gauss(0, 1)
        return math.exp(self._x)
