# attnserve container: a Debian bookworm build stage (scripts/install-deps.sh,
# CMake) and a runtime stage with only the shared libraries the binaries load.
#   docker build -t attnserve .
#   docker run --rm -p 50051:50051 -p 9464:9464 attnserve [extra attnserve flags]

FROM debian:bookworm AS build
WORKDIR /src
# The dependency layer first, so editing the sources does not reinstall packages.
COPY scripts/install-deps.sh scripts/install-deps.sh
RUN ./scripts/install-deps.sh --build-only && rm -rf /var/lib/apt/lists/*
COPY . .
RUN cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DATTNSERVE_BUILD_TESTS=OFF -DATTNSERVE_BUILD_BENCH=OFF \
 && cmake --build build --target attnserve attn_client -j "$(nproc)" \
 && install -D -m 0755 build/server/attnserve /out/attnserve \
 && install -D -m 0755 build/client/attn_client /out/attn_client

FROM debian:bookworm
# Runtime libraries only (their own dependencies come along: libgrpc29,
# libabsl20220623, libgomp1, ocl-icd-libopencl1, libcivetweb1, ...).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        libgrpc++1.51 libprotobuf32 libdnnl2 \
        libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/attnserve /out/attn_client /usr/local/bin/
# Fail the image build, not the first start, if a runtime library is missing.
RUN ! ldd /usr/local/bin/attnserve /usr/local/bin/attn_client | grep "not found"
# A numeric user, so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --system --gid 10001 attnserve \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin attnserve
USER 10001:10001
EXPOSE 50051 9464
# The listen addresses sit in the entrypoint so that arguments given to
# `docker run` or a compose `command:` add to them instead of replacing them
# (later flags win, so --address can still be overridden).
ENTRYPOINT ["/usr/local/bin/attnserve", "--address=0.0.0.0:50051", "--metrics-address=0.0.0.0:9464"]
CMD []
# grpc.health.v1 through the bundled sample client; Docker wants exit code 1 for unhealthy.
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 \
    CMD ["/bin/sh", "-c", "/usr/local/bin/attn_client health --target=127.0.0.1:50051 --timeout-ms=3000 || exit 1"]
