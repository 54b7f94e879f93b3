# mvproxy container image: built from the wheel, run as an unprivileged user.
# Stage 1 builds the wheel and installs it with its dependencies into a virtual
# environment; stage 2 copies only that environment, so no compiler, pip cache or
# source tree reaches the runtime image.
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY mvproxy ./mvproxy
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && python -m venv /opt/mvproxy \
 && /opt/mvproxy/bin/pip install --no-cache-dir /wheels/*.whl

FROM python:3.11-slim-bookworm
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
