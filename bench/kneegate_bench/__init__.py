"""kneegate's load tools, the `kneegate-bench` distribution: load generators (closed and
open loop), the sweep, the overload, replay and soak benchmarks, the gateway's own overhead
beside its peers, calibration against a real vLLM, and the demo. They import kneegate;
kneegate never imports them, but for `kneegate demo` and `kneegate sweep`, loaded when asked.
"""
