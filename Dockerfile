# The image deploy/hbmd-daemonset.yaml names (registry.example.com/hbmd:<version>):
#   docker build -t registry.example.com/hbmd:0.3.0 .
# libcuda and NVML are not in it: the NVIDIA container runtime mounts the
# node's driver libraries. CUDA_EXTRA picks the cuda-bindings major for the
# fleet's driver: cuda13 needs R580 or newer, cuda12 runs on R525 and newer.
FROM python:3.12-slim AS build
WORKDIR /src
COPY . .
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM python:3.12-slim
ARG CUDA_EXTRA=cuda13
ARG HBMD_UID=990
ARG HBMD_GID=990
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/hbmd-*.whl)[${CUDA_EXTRA}]" && rm -rf /wheels \
    && groupadd --system --gid "${HBMD_GID}" hbmd \
    && useradd --system --uid "${HBMD_UID}" --gid hbmd --no-create-home --shell /usr/sbin/nologin hbmd
USER ${HBMD_UID}:${HBMD_GID}
ENTRYPOINT []
CMD ["hbmd", "--help"]
