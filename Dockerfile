# attnserve container: a Debian bookworm build stage (build dependencies only,
# scripts/install-deps.sh --build-only; CMake) and a runtime stage with only
# the shared libraries the binaries load.
#   docker build -t attnserve:0.1.0 .
#   docker run --rm -p 127.0.0.1:50051:50051 -p 127.0.0.1:9464:9464 attnserve:0.1.0 [attnserve flags]
# --build-arg PREBUILT=DIR (a folder in the build context holding attnserve and
# attn_client built on Debian 12) copies those instead of compiling: the test
# suite uses it with the binaries it has just built (docs/OPERATIONS.md).

FROM debian:bookworm AS build
ARG PREBUILT=
WORKDIR /src
# The dependency layer first, so editing the sources does not reinstall packages.
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN if [ -z "$PREBUILT" ]; then ./scripts/install-deps.sh --build-only && rm -rf /var/lib/apt/lists/*; fi
COPY . .
# install -s: the runtime image needs no debug symbols.
RUN if [ -n "$PREBUILT" ]; then \
      install -D -m 0755 "$PREBUILT/attnserve" /out/attnserve \
   && install -D -m 0755 "$PREBUILT/attn_client" /out/attn_client \
   && install -D -m 0644 -t /out/lib/attnserve/civetweb-tls "$PREBUILT"/civetweb-tls/*.so; \
    else \
      cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
          -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCH=OFF \
   && cmake --build build --target attnserve attn_client -j "$(nproc)" \
   && install -D -s -m 0755 build/server/attnserve /out/attnserve \
   && install -D -s -m 0755 build/client/attn_client /out/attn_client \
   && install -D -s -m 0644 -t /out/lib/attnserve/civetweb-tls build/lib/civetweb-tls/*.so; \
    fi

FROM debian:bookworm
# Runtime libraries only (their own dependencies come along: libgrpc29,
# libabsl20220623, libgomp1, ocl-icd-libopencl1, libcivetweb1, ...).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libgrpc++1.51 libprotobuf32 libdnnl2 \
        libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/log/apt /var/log/dpkg.log
# A numeric user, so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --system --gid 10001 attnserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin attnserve
COPY --from=build /out/attnserve /out/attn_client /usr/local/bin/
# HTTPS's OpenSSL 3 libraries for civetweb (server/transport/civetweb_tls.h),
# where attnserve looks for them: ../lib/attnserve next to its bin/.
COPY --from=build /out/lib/attnserve /usr/local/lib/attnserve
# Fail the image build, not the first start, if a runtime library is missing.
RUN ! ldd /usr/local/bin/attnserve /usr/local/bin/attn_client \
        /usr/local/lib/attnserve/civetweb-tls/*.so | grep "not found"
# OCI annotations. VERSION follows project(VERSION) in CMakeLists.txt (a test
# checks); pass --build-arg REVISION=$(git rev-parse HEAD) and
# --build-arg SOURCE=<repository URL> when publishing (the test suite passes both).
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG SOURCE=unknown
LABEL org.opencontainers.image.title="attnserve" \
      org.opencontainers.image.description="gRPC multi-head attention server (oneDNN CPU engine)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.base.name="debian:bookworm"
USER 10001:10001
EXPOSE 50051 9464 8000
# attnserve runs as PID 1 without an init: it handles SIGTERM/SIGINT itself
# (drain, then exit 0; a second signal exits at once) and starts no children
# to reap. The default --shutdown-grace (8s) fits docker stop's 10 s.
# The listen addresses sit in the entrypoint so that arguments given to
# `docker run` or a compose `command:` add to them instead of replacing them
# (later flags win, so --address can still be overridden).
ENTRYPOINT ["/usr/local/bin/attnserve", "--address=0.0.0.0:50051", "--metrics-address=0.0.0.0:9464", "--http-address=0.0.0.0:8000"]
CMD []
# grpc.health.v1 through the bundled sample client: exit 0 when SERVING, else
# non-zero, which Docker counts as a failed check. No shell in between, so a
# check killed at its timeout leaves no orphan for PID 1 to reap.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["/usr/local/bin/attn_client", "health", "--target=127.0.0.1:50051", "--timeout-ms=3000"]
