# kneegate: the gateway alone (the benchmarks package is installed but never imported by
# `kneegate serve` unless the config names no upstream).
#   docker build -t kneegate .
#   docker run -p 8080:8080 -v $PWD/examples/kneegate.yaml:/etc/kneegate/kneegate.yaml kneegate
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY kneegate ./kneegate
RUN pip install . \
    && groupadd --system --gid 10001 kneegate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home kneegate \
    && mkdir -p /etc/kneegate
COPY examples/kneegate.yaml /etc/kneegate/kneegate.yaml

# numeric, so Kubernetes' runAsNonRoot can check it (deploy/kubernetes runs as 10001 too)
USER 10001:10001
EXPOSE 8080
# /health answers while the process is alive; /ready would also need a usable engine.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request, sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/health', timeout=2).status == 200 else 1)"]
CMD ["kneegate", "serve", "--config", "/etc/kneegate/kneegate.yaml"]
