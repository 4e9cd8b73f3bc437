# syntax=docker/dockerfile:1
# ncclwatch: the forwarder, the detector worker and the other `ncclwatch` commands, plus
# the NCCL profiler plugin (for copying onto GPU nodes; it runs inside training jobs,
# not in this container).
#
#   docker build -t ncclwatch:0.1.0 .
#   docker run --rm ncclwatch:0.1.0 --help
#   docker create --name nw ncclwatch:0.1.0 && docker cp nw:/opt/ncclwatch/lib . && docker rm nw
#   (lib/libncclwatch-profiler.so: NCCL_PROFILER_PLUGIN for training jobs, docs/deploy.md)

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the C plugin (gcc) and wheels for ncclwatch and its dependencies ----------
# (tests/test_compose.py runs these RUN lines on the same build context, minus the download
# of the dependencies' wheels)
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN make -C plugin \
    && mkdir -p /out/lib \
    && cp plugin/build/libncclwatch-profiler.so /out/lib/
# ncclwatch's wheel (with the plugin, setup.py) and every service's dependencies, at the
# versions CI tested (requirements/ci.lock).
RUN pip wheel --no-cache-dir --wheel-dir /out/wheels -c requirements/ci.lock ".[all]"

# ---- runtime: no compiler, no sources, a non-root user ---------------------------------
FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 10001 ncclwatch \
    && useradd --system --uid 10001 --gid ncclwatch --home-dir /var/lib/ncclwatch \
       --shell /usr/sbin/nologin ncclwatch \
    && install -d -o ncclwatch -g ncclwatch /var/lib/ncclwatch /var/spool/ncclwatch
# `pip install '.[all]'` (the image runs forwarders and workers alike), from the wheels
# built above so the image carries no build tools.
RUN --mount=type=bind,from=build,source=/out/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links /wheels "ncclwatch[all]"
COPY --from=build /out/lib/ /opt/ncclwatch/lib/
USER ncclwatch
WORKDIR /var/lib/ncclwatch
# 9465: forwarder metrics, 9466: detector metrics (watch / worker)
EXPOSE 9465 9466
ENTRYPOINT ["ncclwatch"]
CMD ["--help"]
