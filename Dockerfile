# stoker's container image: `stoker serve` as a non-root user.
#
#   docker build -t stoker:0.1.0 .
#   docker run --rm -p 8080:8080 -e STOKER_API__ADMIN_TOKENS="$(openssl rand -hex 24)" stoker:0.1.0
#
# The builder stage builds the wheel from pyproject.toml, README.md and src/ (all the
# wheel needs; .dockerignore admits nothing else but the lock file) and installs it with
# the postgres, kubernetes and tracing extras (tracing stays off until configured), at
# the lock file's versions, into a virtual environment without pip. The final stage
# copies that environment onto a fresh slim image: no compiler, no pip, no setuptools,
# no source tree.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /build
COPY pyproject.toml README.md ./
COPY requirements/all.lock ./requirements/
COPY src ./src
# The dependencies at the versions of the lock file (as constraints, without the hashes:
# only those of the extras a Kubernetes deployment needs are installed). The target
# environment has no pip of its own: the builder's pip installs into it.
RUN sed -e '/^[[:space:]#]/d' -e 's/ *\\$//' requirements/all.lock > /tmp/constraints.txt \
 && python -m pip wheel --no-deps --wheel-dir /wheels . \
 && python -m venv --without-pip /opt/stoker \
 && set -- /wheels/stoker-*.whl \
 && python -m pip --python /opt/stoker/bin/python install \
      --constraint /tmp/constraints.txt "$1[postgres,kubernetes,tracing]"

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/stoker/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    STOKER_API__HOST=0.0.0.0 \
    STOKER_API__PORT=8080
# The same ids as the Kubernetes Deployment's securityContext (runAsUser/runAsGroup 10001).
RUN groupadd --system --gid 10001 stoker \
 && useradd --system --uid 10001 --gid stoker --home-dir /var/lib/stoker --create-home \
      --shell /usr/sbin/nologin stoker
COPY --from=builder /opt/stoker /opt/stoker
USER 10001:10001
# The default store (sqlite:///./stoker.db) lives here; mount a volume to keep it.
WORKDIR /var/lib/stoker
EXPOSE 8080
# The slim image has no curl: the environment's own Python asks /readyz, bypassing any
# proxy set in the environment, and fails on a refused connection or a non-2xx answer.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/readyz' % os.environ.get('STOKER_API__PORT', '8080'), timeout=2)"]
ENTRYPOINT ["stoker", "serve"]
