"""Generates the Python gRPC stubs of the attnserve API with grpc_tools.protoc.

Two users, one list of protos:
  * the package build (setup.py's build_py) writes them into the wheel as
    `attnserve_client._proto`, imports rewritten to that package, so an
    installed client never generates code and never needs the source tree;
  * a source checkout without an installed wheel (the repository's own tests,
    `sys.path.insert(0, "client/python")`) generates them on first import into
    a cache keyed by the protos' contents, as top-level `attnserve.*` modules.

    python3 -m attnserve_client.codegen OUTDIR    # top-level stubs into OUTDIR

This file imports nothing from its package, so setup.py can load it by path.
"""

import hashlib
import os
import re
import shutil
import sys
import tempfile

# The health proto is staged under this prefix: its usual path
# (grpc/health/v1/...) would make the generated modules live in a package named
# `grpc`, shadowed by grpcio itself. The proto package, and so the method names
# on the wire, stay grpc.health.v1 (and grpc.reflection.v1alpha).
EXT_PREFIX = "attnserve/grpc_ext"

# Compiled into the wheel (paths under a proto root).
API_PROTOS = ("attnserve/v1/model_config.proto", "attnserve/v1/attention.proto",
              EXT_PREFIX + "/health/v1/health.proto")
# Checkout only (tests call server reflection): staged path -> path under
# Debian's grpc-proto root. Skipped when that package is absent.
_DEV_PROTOS = {
    EXT_PREFIX + "/reflection/v1alpha/reflection.proto": "grpc/reflection/v1alpha/reflection.proto",
}
# Checkout only, from the repository's proto/: KServe v2's protocol (tests
# that call it without tritonclient, such as the GPU machine's, where Python
# has no grpc_tools and gets these stubs prebuilt). Skipped when absent.
_DEV_REPO_PROTOS = ("inference/grpc_service.proto",)

_HERE = os.path.dirname(os.path.abspath(__file__))


def proto_roots():
    """Where API_PROTOS are looked up, in order: $ATTNSERVE_PROTO_DIR; the
    package's own proto/ (health; in an sdist, everything); the repository's
    proto/ (a checkout)."""
    roots = []
    if os.environ.get("ATTNSERVE_PROTO_DIR"):
        roots.append(os.environ["ATTNSERVE_PROTO_DIR"])
    roots.append(os.path.normpath(os.path.join(_HERE, "..", "proto")))
    roots.append(os.path.normpath(os.path.join(_HERE, "..", "..", "..", "proto")))
    return roots


def grpc_proto_root():
    """Root of Debian's grpc-proto package (or $GRPC_PROTO_DIR)."""
    return os.environ.get("GRPC_PROTO_DIR", "/usr/share/grpc-proto")


def find_proto(path, roots=None):
    """Absolute path of `path` under the first root that has it."""
    roots = roots or proto_roots()
    for root in roots:
        candidate = os.path.join(root, path)
        if os.path.isfile(candidate):
            return candidate
    raise FileNotFoundError(f"attnserve_client.codegen: {path} not found under {roots} "
                            "(set ATTNSERVE_PROTO_DIR to the repository's proto/)")


def sources(with_dev=False):
    """[(staged path, absolute source path)] of every proto to compile."""
    srcs = [(p, find_proto(p)) for p in API_PROTOS]
    if with_dev:
        for staged, orig in _DEV_PROTOS.items():
            path = os.path.join(grpc_proto_root(), orig)
            if os.path.isfile(path):
                srcs.append((staged, path))
        for staged in _DEV_REPO_PROTOS:
            try:
                srcs.append((staged, find_proto(staged)))
            except FileNotFoundError:
                pass
    return srcs


_IMPORT = re.compile(r"^(from|import) attnserve\.", re.MULTILINE)
_GENCODE_PROTOBUF = re.compile(r"^# Protobuf Python Version: (\S+)$", re.MULTILINE)
_GENCODE_GRPC = re.compile(r"^GRPC_GENERATED_VERSION = '([^']+)'$", re.MULTILINE)


def generate(outdir, package=None, with_dev=False):
    """Writes the *_pb2.py and *_pb2_grpc.py modules under outdir.

    package: None = top-level `attnserve.*` modules (put outdir on sys.path);
    a dotted name (e.g. "attnserve_client._proto") = outdir is that package:
    the generated absolute imports are rewritten to it and __init__.py files
    are written. Returns {"protobuf": v, "grpc": v}, the runtime versions the
    generated code declares it needs (None where it declares none).
    """
    from grpc_tools import protoc
    import grpc_tools

    srcs = sources(with_dev)
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

    versions = {"protobuf": None, "grpc": None}
    for dirpath, _, files in os.walk(outdir):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            with open(path) as f:
                text = f.read()
            for key, pattern in (("protobuf", _GENCODE_PROTOBUF), ("grpc", _GENCODE_GRPC)):
                m = pattern.search(text)
                if m:
                    versions[key] = m.group(1)
            if package:
                text = _IMPORT.sub(lambda m: f"{m.group(1)} {package}.attnserve.", text)
                with open(path, "w") as f:
                    f.write(text)
        if package:
            init = os.path.join(dirpath, "__init__.py")
            if not os.path.exists(init):
                open(init, "w").close()
    return versions


def _hash_protos(h, srcs):
    for staged, path in srcs:
        h.update(staged.encode())
        with open(path, "rb") as f:
            h.update(f.read())


def _api_key():
    """Hash of the API's .proto files (those every client needs)."""
    h = hashlib.sha256()
    _hash_protos(h, sources())
    return h.hexdigest()[:16]


def _cache_key():
    """<hash of the API's .proto files>-<hash of the development protos found
    here and of the grpc_tools that compiles them all>."""
    h = hashlib.sha256()
    _hash_protos(h, sources(with_dev=True)[len(API_PROTOS):])
    try:
        import grpc_tools
        h.update(getattr(grpc_tools, "__version__", "").encode())
        h.update(os.path.dirname(grpc_tools.__file__).encode())
    except ImportError:
        h.update(b"no grpc_tools")
    return f"{_api_key()}-{h.hexdigest()[:8]}"


def _prebuilt(base):
    """Stubs of the same .proto files that another grpc_tools generated: used
    where this Python has no grpc_tools (a machine given the stubs of a build
    machine through $ATTNSERVE_PY_STUBS_DIR)."""
    try:
        import grpc_tools  # noqa: F401
        return None
    except ImportError:
        pass
    prefix = _api_key() + "-"
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return None
    for name in names:
        if name.startswith(prefix) and os.path.isfile(os.path.join(base, name, ".complete")):
            return os.path.join(base, name)
    return None


def cache_base():
    """$ATTNSERVE_PY_STUBS_DIR, else <build dir>/python_stubs, else a per-user tmp dir."""
    if os.environ.get("ATTNSERVE_PY_STUBS_DIR"):
        return os.environ["ATTNSERVE_PY_STUBS_DIR"]
    if os.environ.get("ATTNSERVE_BUILD_DIR"):
        return os.path.join(os.environ["ATTNSERVE_BUILD_DIR"], "python_stubs")
    return os.path.join(tempfile.gettempdir(), f"attnserve_client_stubs-{os.getuid()}")


def ensure_stubs():
    """Checkout mode: generates the top-level stubs unless the cache has them;
    puts them on sys.path.

    Safe when several processes race: each generates into its own directory and
    renames it into place; a loser uses the winner's copy.
    """
    final = os.path.join(cache_base(), _cache_key())
    if not os.path.isfile(os.path.join(final, ".complete")):
        final = _prebuilt(cache_base()) or final
    if not os.path.isfile(os.path.join(final, ".complete")):
        os.makedirs(cache_base(), exist_ok=True)
        work = tempfile.mkdtemp(prefix="gen-", dir=cache_base())
        try:
            generate(work, with_dev=True)
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
    generate(argv[1], with_dev=True)
    print(f"wrote attnserve stubs to {argv[1]}; add it to PYTHONPATH")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
