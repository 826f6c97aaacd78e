# Fila in a container: Debian slim, the wheel built from this checkout, runtime
# dependencies only, running as an unprivileged user with its data on a volume.
#   docker build -t fila .
#   docker run -d -p 5555:5555 -v fila-data:/var/lib/fila fila
# The broker listens on all interfaces inside the container; set FILA_BOOTSTRAP_APIKEY
# (and TLS, see README "Securing a deployment") before publishing the port beyond
# the host.

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
RUN pip install --no-cache-dir build==1.2.2
COPY pyproject.toml README.md ./
COPY fila ./fila
COPY fila_sdk ./fila_sdk
COPY fila_bench ./fila_bench
RUN python -m build --wheel --outdir /dist .

FROM python:3.11-slim-bookworm
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/fila --create-home \
      --shell /usr/sbin/nologin fila
COPY --from=build /dist/ /tmp/dist/
RUN python -m venv /opt/fila \
    && /opt/fila/bin/pip install --no-cache-dir /tmp/dist/*.whl \
    && rm -rf /tmp/dist
ENV PATH=/opt/fila/bin:$PATH \
    FILA_DATA_DIR=/var/lib/fila/data \
    FILA_LISTEN_ADDR=0.0.0.0:5555 \
    FILA_ADDR=127.0.0.1:5555 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/fila
VOLUME ["/var/lib/fila"]
EXPOSE 5555
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 CMD ["fila", "health"]
ENTRYPOINT ["fila-server"]
