# mvproxy container image: the daemon's runtime only, run as an unprivileged user.
# Stage 1 installs the runtime section of the lock (requirements.lock, selected by
# scripts/lock.py: no test or lint tool; every file checked against its sha256) and
# the wheel of this tree, built by the lock's pinned backend (setuptools, and mypy's
# mypyc compiling the pure core with Debian's gcc: docs/compiled.md; in a venv of its
# own that never reaches the image; no build isolation, nothing unpinned is
# downloaded), into a virtual environment, then
# prunes the simulator (scripts/prune_runtime.py); stage 2 copies only that
# environment, so no compiler, pip cache, source tree or simulator data reaches the
# runtime image.
# The base is pinned by the digest of the multi-architecture index of the
# python:3.11.14-slim-bookworm tag; the tag is kept for people, the digest decides.
FROM python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d AS build
WORKDIR /src
# The C compiler for mypyc's extensions, in this stage only. Not pinned to versions:
# libc6-dev must match the pinned base image's libc6, which Debian's updates move.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY requirements.lock pyproject.toml ./
COPY scripts/lock.py ./scripts/
RUN python scripts/lock.py select runtime --output runtime-requirements.txt \
 && python scripts/lock.py select build --output build-requirements.txt \
 && python -m venv /opt/mvproxy \
 && /opt/mvproxy/bin/pip install --no-cache-dir --no-deps --require-hashes -r runtime-requirements.txt \
 && python -m venv /opt/build \
 && /opt/build/bin/pip install --no-cache-dir --no-deps --require-hashes -r runtime-requirements.txt -r build-requirements.txt
COPY README.md setup.py ./
COPY mvproxy ./mvproxy
COPY scripts/prune_runtime.py ./scripts/
RUN /opt/build/bin/pip wheel --no-cache-dir --no-deps --no-build-isolation --wheel-dir /wheels . \
 && /opt/mvproxy/bin/pip install --no-cache-dir --no-deps /wheels/*.whl \
 && python scripts/prune_runtime.py /opt/mvproxy/lib/python3.11/site-packages

FROM python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d
LABEL org.opencontainers.image.title="mvproxy" \
      org.opencontainers.image.description="Mixed Version Proxy sidecar for kube-apiserver"
COPY --from=build /opt/mvproxy /opt/mvproxy
ENV PATH="/opt/mvproxy/bin:${PATH}" \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# 65532 is the conventional "nonroot" UID of distroless images.
USER 65532:65532
EXPOSE 6443 9443
ENTRYPOINT ["mvproxy"]
CMD ["run", "--config", "/etc/mvproxy/config.yaml"]
