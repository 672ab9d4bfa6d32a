# The forgepool image, for machines with a registry:
#   docker build -t REGISTRY/forgepool:TAG .
# Without a registry, scripts/build-forgepool-image.sh builds the same image from local files.
FROM rust:1-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --locked --bin forgepool

FROM debian:bookworm-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends git ca-certificates openssh-client \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 forgepool \
 && useradd --uid 10001 --gid 10001 --home-dir /var/lib/forgepool --create-home forgepool \
 && mkdir -p /var/lib/forgepool/data /var/lib/forgepool/workspace \
 && chown -R 10001:10001 /var/lib/forgepool
COPY --from=build /src/target/release/forgepool /usr/local/bin/forgepool
USER 10001:10001
WORKDIR /var/lib/forgepool
ENV FORGEPOOL_WORKSPACE_DIR=/var/lib/forgepool/workspace \
    FORGEPOOL_DATABASE_URL=/var/lib/forgepool/data/forgepool.db
ENTRYPOINT ["/usr/local/bin/forgepool"]
CMD ["--help"]
