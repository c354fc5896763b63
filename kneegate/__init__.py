"""kneegate: adaptive admission control for LLM inference engines.

One installed package, in floors that point down:

    kneegate.cli, kneegate.embedded   the top floor: the command line, the demo and the
                                      embedded engine; the only floor that imports the others
    kneegate.gateway                  the proxy: admission, relay, metrics, config, serving
    kneegate.controllers              the pure limit algorithms (no I/O, no clocks)
    kneegate.benchmarks               the engine emulator and the load tools (the `bench`
                                      extra holds what they need); never imported by the
                                      gateway
"""
