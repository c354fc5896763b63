"""Serving the gateway: uvicorn on a bound socket in this event loop (`serving`), and the
process around it: one or N workers, signals, the embedded engine (`workers`). The top of
the gateway: it builds the app, nothing of the gateway imports it."""
