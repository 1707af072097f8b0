# vLLM's router (vllm-router from PyPI, the version kvxfer's tests run) for the local cluster:
# the chart's router Deployment. Built by deploy/local/images.sh with the deploy/local folder as
# its context; every package pinned with its hash.
ARG BASE_IMAGE=kvxfer-base:bookworm
FROM ${BASE_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
  && rm -rf /var/lib/apt/lists/*
COPY router-requirements.txt /tmp/
RUN --mount=type=secret,id=ca,target=/etc/ssl/certs/ca-certificates.crt \
    python3 -m venv /opt/router \
  && /opt/router/bin/pip install --no-cache-dir --disable-pip-version-check --require-hashes \
       --only-binary=:all: -r /tmp/router-requirements.txt \
  && /opt/router/bin/pip uninstall -y --disable-pip-version-check pip setuptools \
  && /opt/router/bin/vllm-router --help >/dev/null

FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update && apt-get install -y --no-install-recommends python3 \
  && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/router /opt/router
ENV PATH=/opt/router/bin:$PATH
ENTRYPOINT ["vllm-router"]
