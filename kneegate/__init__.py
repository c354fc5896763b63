"""kneegate: adaptive admission control for LLM inference engines.

One installed package, in floors that only point down (tests/test_layers.py keeps them so):

    kneegate.cli, kneegate.embedded   the top floor: the command line and the embedded
                                      engine; the only floor that imports the others (and,
                                      for `kneegate demo` and `sweep`, the load tools:
                                      kneegate_bench, a distribution of their own)
    kneegate.sim                      the simulator: the admission core, the controllers
                                      and the emulator's core in virtual time
    kneegate.emulator                 the vLLM emulator; neither it nor the simulator is
                                      imported by the gateway
    kneegate.gateway                  the proxy's I/O: HTTP, relay, upstreams, metrics,
                                      config, serving
    kneegate.admission                the pure admission core: queue, wait prediction, fair
                                      shares, demand (no I/O, time as data)
    kneegate.controllers              the pure limit algorithms (no I/O, no clocks)
"""
