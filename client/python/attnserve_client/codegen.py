"""Generates the Python gRPC stubs of the attnserve API (plus grpc.health.v1 and
grpc.reflection.v1alpha) with grpc_tools.protoc, so no generated code lives in git.

    python3 -m attnserve_client.codegen OUTDIR    # write the stubs into OUTDIR

On import, attnserve_client calls ensure_stubs(), which generates them once into
a cache directory keyed by the protos' contents and puts it on sys.path.
"""

import hashlib
import os
import shutil
import sys
import tempfile

# The health and reflection protos are staged under this prefix: their own file
# paths (grpc/health/v1/...) would make the generated modules live in a package
# named `grpc`, shadowed by grpcio itself. Their proto packages, and so the
# method names on the wire, stay grpc.health.v1 and grpc.reflection.v1alpha.
EXT_PREFIX = "attnserve/grpc_ext"

_API_PROTOS = ("attnserve/v1/model_config.proto", "attnserve/v1/attention.proto")
_EXT_PROTOS = {
    # staged path: path under the grpc-proto root
    EXT_PREFIX + "/health/v1/health.proto": "grpc/health/v1/health.proto",
    EXT_PREFIX + "/reflection/v1alpha/reflection.proto": "grpc/reflection/v1alpha/reflection.proto",
}


def proto_root():
    """proto/ of the source tree (or $ATTNSERVE_PROTO_DIR)."""
    env = os.environ.get("ATTNSERVE_PROTO_DIR")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", "..", "proto"))


def grpc_proto_root():
    """Root of Debian's grpc-proto package (or $GRPC_PROTO_DIR)."""
    return os.environ.get("GRPC_PROTO_DIR", "/usr/share/grpc-proto")


def _sources():
    """(staged path, absolute source path) of every proto to compile."""
    srcs = [(p, os.path.join(proto_root(), p)) for p in _API_PROTOS]
    srcs += [(staged, os.path.join(grpc_proto_root(), orig)) for staged, orig in _EXT_PROTOS.items()]
    for _, path in srcs:
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"attnserve_client.codegen: {path} not found (set ATTNSERVE_PROTO_DIR / "
                "GRPC_PROTO_DIR, or install Debian's grpc-proto)")
    return srcs


def generate(outdir):
    """Writes the *_pb2.py and *_pb2_grpc.py modules under outdir."""
    from grpc_tools import protoc
    import grpc_tools

    srcs = _sources()
    os.makedirs(outdir, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="attnserve-protos-") as stage:
        for staged, path in srcs:
            dst = os.path.join(stage, staged)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copyfile(path, dst)
        well_known = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
        args = ["grpc_tools.protoc", f"-I{stage}", f"-I{well_known}",
                f"--python_out={outdir}", f"--grpc_python_out={outdir}"]
        args += [staged for staged, _ in srcs]
        if protoc.main(args) != 0:
            raise RuntimeError(f"grpc_tools.protoc failed: {' '.join(args)}")


def _cache_key():
    h = hashlib.sha256()
    try:
        import grpc_tools
        h.update(getattr(grpc_tools, "__version__", "").encode())
        h.update(os.path.dirname(grpc_tools.__file__).encode())
    except ImportError:
        pass
    for staged, path in _sources():
        h.update(staged.encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def cache_base():
    """$ATTNSERVE_PY_STUBS_DIR, else <build dir>/python_stubs, else a per-user tmp dir."""
    if os.environ.get("ATTNSERVE_PY_STUBS_DIR"):
        return os.environ["ATTNSERVE_PY_STUBS_DIR"]
    if os.environ.get("ATTNSERVE_BUILD_DIR"):
        return os.path.join(os.environ["ATTNSERVE_BUILD_DIR"], "python_stubs")
    return os.path.join(tempfile.gettempdir(), f"attnserve_client_stubs-{os.getuid()}")


def ensure_stubs():
    """Generates the stubs unless the cache has them; puts them on sys.path.

    Safe when several processes race: each generates into its own directory and
    renames it into place; a loser uses the winner's copy.
    """
    final = os.path.join(cache_base(), _cache_key())
    if not os.path.isfile(os.path.join(final, ".complete")):
        os.makedirs(cache_base(), exist_ok=True)
        work = tempfile.mkdtemp(prefix="gen-", dir=cache_base())
        try:
            generate(work)
            open(os.path.join(work, ".complete"), "w").close()
            try:
                os.rename(work, final)
            except OSError:
                if not os.path.isfile(os.path.join(final, ".complete")):
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if final not in sys.path:
        sys.path.insert(0, final)
    return final


def main(argv):
    if len(argv) != 2:
        print("usage: python3 -m attnserve_client.codegen OUTDIR", file=sys.stderr)
        return 2
    generate(argv[1])
    print(f"wrote attnserve stubs to {argv[1]}; add it to PYTHONPATH")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
