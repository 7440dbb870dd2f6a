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
# Dependencies first, from the lock (hash-checked; the same pins as the suite's): a code change rebuilds
# only the last layer. requirements/image.txt is the runtime with the relay and the OTLP exporter, so
# OTEL_EXPORTER_OTLP_ENDPOINT (or [telemetry] in the config) can reach a collector.
COPY requirements/image.txt ./requirements/image.txt
RUN pip install --require-hashes -r requirements/image.txt
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY normalizer ./normalizer
COPY worker ./worker
COPY ops ./ops
RUN pip install --no-deps --no-build-isolation . \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin sluice

# A default configuration (routes to the compose fake provider); mount your own over it.
COPY ops/deploy/sluice.toml /etc/sluice/sluice.toml

WORKDIR /
USER sluice
ENTRYPOINT ["sluice"]
CMD ["worker", "--config", "/etc/sluice/sluice.toml"]
