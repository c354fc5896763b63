"""kneegate's gateway: a streaming reverse proxy with an adaptive admission gate."""
