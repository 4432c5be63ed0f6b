# The one image for every gpufit role (controller, webhook, sidecar, hooks).
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin gpufit

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /src/target/release/gpufit /usr/local/bin/gpufit
# NVML (libnvidia-ml.so.1) is mounted by the NVIDIA container runtime on GPU nodes.
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gpufit"]
