"""The upstream side: the HTTP client that talks to engines (`client`, `connection`), the
pool of engines (`pool`, one `state.Upstream` each), its health probes and scrapes
(`probe`) and the engines' own figures (`telemetry`)."""
