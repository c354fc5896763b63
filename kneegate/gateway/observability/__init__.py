"""What the gateway shows of itself: every `kneegate_*` series (`metrics`, with the gauges
read at scrape time in `gauges`), the last ten minutes (`history`), the live page
(`livepage`, `static/`) and the log handler (`logs`). Imports nothing of the hot path."""
