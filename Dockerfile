# kneegate: the gateway alone. The emulator and the simulator (kneegate/emulator, kneegate/sim)
# stay out of this image, as do the load tools (bench/, kneegate-bench: a distribution of their
# own, never copied here) and every optional extra.
#
#   docker build -t kneegate .
#   docker run -e KNEEGATE_UPSTREAM=http://vllm:8000 -p 8080:8080 kneegate
#   docker run -v $PWD/kneegate.yaml:/etc/kneegate/kneegate.yaml -p 8080:8080 kneegate \
#       serve --config /etc/kneegate/kneegate.yaml     # the full set (flags after the image)
#
# Configured by the environment: KNEEGATE_UPSTREAM (one URL, or several separated by commas),
# KNEEGATE_PORT (8080 here; the health check follows it), KNEEGATE_ADMIN_PORT, KNEEGATE_HOST
# (0.0.0.0 here), KNEEGATE_CONFIG (a file, e.g. /etc/kneegate/kneegate.yaml mounted); a flag
# after the image name overrides them (`kneegate serve --help`). With no upstream at all the
# gateway says so and exits 2: the built-in emulator is not in the image.
#
# BASE: any Debian-like image with Python >= 3.11 and its venv module. Where no registry
# answers, tests/container/base_image.sh makes one from Debian's packages.
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/kneegate/bin:$PATH \
    KNEEGATE_HOST=0.0.0.0 \
    KNEEGATE_PORT=8080

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kneegate ./kneegate
# .dockerignore already leaves kneegate/emulator and kneegate/sim out of the context; this line
# keeps them out for a builder that ignores that file
RUN rm -rf kneegate/emulator kneegate/sim \
    && python3 -m venv /opt/kneegate \
    && /opt/kneegate/bin/pip install . \
    && rm -rf /src \
    && groupadd --system --gid 10001 kneegate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home kneegate \
    && mkdir -p /etc/kneegate
WORKDIR /

# numeric, so Kubernetes' runAsNonRoot can check it (deploy/kubernetes runs as 10001 too)
USER 10001:10001
EXPOSE 8080
# /health answers while the process is alive (on the port KNEEGATE_PORT names); /ready would
# also need a usable engine.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python3", "-c", "import os, sys, urllib.request; port = os.environ.get('KNEEGATE_PORT') or '8080'; sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["kneegate"]
CMD ["serve"]
