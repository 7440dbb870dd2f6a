# The sluice image: one image for the worker, the fake provider and the operator commands.
#   docker build -t sluice .
#   docker run --rm sluice --help
#   docker run --rm -e REDIS_URL=redis://... -v ./sluice.toml:/etc/sluice/sluice.toml:ro sluice
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY normalizer ./normalizer
COPY worker ./worker
COPY ops ./ops

# The OTLP exporter, so `OTEL_EXPORTER_OTLP_ENDPOINT` can reach a collector; empty it for a smaller image.
ARG EXTRA_PACKAGES="opentelemetry-exporter-otlp-proto-http"
RUN pip install . ${EXTRA_PACKAGES} \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin sluice

# A default configuration (routes to the compose fake provider); mount your own over it.
COPY ops/deploy/sluice.toml /etc/sluice/sluice.toml

WORKDIR /
USER sluice
ENTRYPOINT ["sluice"]
CMD ["worker", "--config", "/etc/sluice/sluice.toml"]
