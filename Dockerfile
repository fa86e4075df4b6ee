# syntax=docker/dockerfile:1
#
# migdra images. One builder compiles the binaries; each runtime stage carries one of them.
#
#   docker build --target controller     -t ghcr.io/migdra/migdra-controller:0.1.0 .
#   docker build --target kubelet-plugin -t ghcr.io/migdra/migdra-kubelet-plugin:0.1.0 .
#   docker build --target kubectl-migdra -t ghcr.io/migdra/kubectl-migdra:0.1.0 .
#
# The kubectl plugin is a client-side binary: its image exists to ship the binary built with
# the same toolchain as the release (`docker run --rm ghcr.io/migdra/kubectl-migdra:0.1.0
# --help`, or copy /usr/local/bin/kubectl-migdra out of it onto your PATH).
#
# The builders and the runtime images are the same Debian release (bookworm), so the binaries
# link against the glibc they run with. The kubelet plugin does not ship NVML: it dlopens
# libnvidia-ml.so.1 from the host's NVIDIA driver root at run time (the Helm chart mounts it
# and sets NVML_LIB_PATH). Its image carries NVIDIA's nvidia-cdi-hook (built from the
# container toolkit's Go module at the version kubelet-plugin/cdi-hook/go.mod pins) for
# hosts that have none.
#
# e2e/runtime/migdra-images.sh builds the same images without a Docker daemon: it reads this
# file and refuses any instruction of the runtime stages it does not reproduce.

ARG DEBIAN_RELEASE=bookworm

FROM rust:1.95-slim-${DEBIAN_RELEASE} AS builder
WORKDIR /src
# The whole workspace: Cargo needs every member's manifest (including e2e/) to resolve it.
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/usr/local/cargo/git,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked -p migdra-controller -p migdra-kubelet-plugin -p kubectl-migdra \
    && mkdir -p /out \
    && cp target/release/migdra-controller target/release/migdra-kubelet-plugin target/release/kubectl-migdra /out/

FROM golang:1.26-${DEBIAN_RELEASE} AS cdi-hook
WORKDIR /src
COPY kubelet-plugin/cdi-hook/ ./
RUN ./build.sh /out

FROM debian:${DEBIAN_RELEASE}-slim AS runtime-base
LABEL org.opencontainers.image.source="https://github.com/migdra/migdra" \
      org.opencontainers.image.licenses="Apache-2.0"

# Cluster controller: no host access; runs as an unprivileged user.
FROM runtime-base AS controller
LABEL org.opencontainers.image.title="migdra-controller" \
      org.opencontainers.image.description="migdra cluster controller: publishes ResourceSlices for NVIDIA MIG partitions"
COPY --from=builder /out/migdra-controller /usr/local/bin/migdra-controller
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/migdra-controller"]

# Kubelet plugin: runs privileged as root on GPU nodes (NVML, /dev/nvidia*, kubelet sockets).
FROM runtime-base AS kubelet-plugin
LABEL org.opencontainers.image.title="migdra-kubelet-plugin" \
      org.opencontainers.image.description="migdra kubelet plugin: creates and destroys NVIDIA MIG instances for DRA claims"
COPY --from=builder /out/migdra-kubelet-plugin /usr/local/bin/migdra-kubelet-plugin
COPY --from=cdi-hook /out/nvidia-cdi-hook /usr/local/bin/nvidia-cdi-hook
ENTRYPOINT ["/usr/local/bin/migdra-kubelet-plugin"]

# kubectl plugin: read-only client; runs as an unprivileged user. Mount a kubeconfig to use it
# from the image, e.g. `docker run --rm -v ~/.kube:/kube:ro -e KUBECONFIG=/kube/config ...`.
FROM runtime-base AS kubectl-migdra
LABEL org.opencontainers.image.title="kubectl-migdra" \
      org.opencontainers.image.description="kubectl migdra: MIG layouts, placement predictions and claim states of migdra's GPUs"
COPY --from=builder /out/kubectl-migdra /usr/local/bin/kubectl-migdra
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/kubectl-migdra"]
