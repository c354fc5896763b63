"""kneegate: adaptive admission control for LLM inference engines.

One installed package, in floors that only point down (tests/test_layers.py keeps them so):

    kneegate.cli, kneegate.embedded   the top floor: the command line, the demo and the
                                      embedded engine; the only floor that imports the others
    kneegate.benchmarks               the engine emulator and the load tools (the `bench`
                                      extra holds what they need); never imported by the
                                      gateway
    kneegate.gateway                  the proxy's I/O: HTTP, relay, upstreams, metrics,
                                      config, serving
    kneegate.admission                the pure admission core: queue, wait prediction, fair
                                      shares, demand (no I/O, time as data)
    kneegate.controllers              the pure limit algorithms (no I/O, no clocks)
"""
