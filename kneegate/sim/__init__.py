"""The simulator's parts: scenarios, the true knee, one run, goodput, the oracle, judging,
the report and tenants. `python -m kneegate.sim` runs them."""
