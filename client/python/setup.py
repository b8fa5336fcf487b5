"""Build hook of the attnserve-client package (metadata is in pyproject.toml):
the version comes from the repository's CMakeLists.txt, the gRPC stubs are
generated from the .proto files into the wheel (attnserve_client/_proto), and an
sdist carries those .proto files and the version so it builds on its own."""

import importlib.util
import os
import re
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py as _build_py
from setuptools.command.sdist import sdist as _sdist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.normpath(os.path.join(HERE, "..", ".."))
VERSION_FILE = "VERSION"  # written into an sdist, read back when building from it


def _load_codegen():
    spec = importlib.util.spec_from_file_location(
        "_attnserve_codegen", os.path.join(HERE, "attnserve_client", "codegen.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


codegen = _load_codegen()


def version():
    """The sdist's VERSION file, else project(attnserve VERSION x.y.z) of the
    repository's CMakeLists.txt: one place for the version of everything."""
    path = os.path.join(HERE, VERSION_FILE)
    if os.path.isfile(path):
        with open(path) as f:
            return f.read().strip()
    cmake = os.path.join(REPO, "CMakeLists.txt")
    with open(cmake) as f:
        m = re.search(r"project\(\s*attnserve\s+VERSION\s+([0-9][0-9.]*)", f.read())
    if not m:
        raise RuntimeError(f"{cmake}: no project(attnserve VERSION x.y.z)")
    return m.group(1)


def _declared_minimum(dist):
    """The lower bound pyproject.toml declares for a runtime dependency."""
    with open(os.path.join(HERE, "pyproject.toml")) as f:
        m = re.search(r'^\s*"' + re.escape(dist) + r'>=([0-9.]+)', f.read(), re.MULTILINE)
    return m.group(1) if m else None


def _vtuple(v):
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def check_gencode(needs):
    """Refuses stubs that need a newer protobuf/grpcio runtime than the package
    declares (they would fail at import on a user's machine), or gencode of a
    different protobuf major (whose runtime check or APIs would not match)."""
    for dist, need in (("protobuf", needs["protobuf"]), ("grpcio", needs["grpc"])):
        declared = _declared_minimum(dist)
        if need is None or declared is None:
            if dist == "protobuf" and need is None:
                raise RuntimeError("the grpcio-tools in use writes gencode without a version "
                                   "stamp (too old): build with pyproject.toml's build-system.requires")
            continue
        if _vtuple(need) > _vtuple(declared) or (
                dist == "protobuf" and _vtuple(need)[0] != _vtuple(declared)[0]):
            raise RuntimeError(f"the generated stubs need {dist}>={need} but pyproject.toml declares "
                               f"{dist}>={declared}: build with the grpcio-tools range of "
                               "build-system.requires, or move both together")


class build_py(_build_py):
    """Also writes attnserve_client/_proto (the stubs) and _version.py."""

    def run(self):
        super().run()
        pkg = os.path.join(self.build_lib, "attnserve_client")
        out = os.path.join(pkg, "_proto")
        shutil.rmtree(out, ignore_errors=True)
        needs = codegen.generate(out, package="attnserve_client._proto")
        check_gencode(needs)
        with open(os.path.join(pkg, "_version.py"), "w") as f:
            f.write(f'"""Written by setup.py."""\n__version__ = "{version()}"\n')


class sdist(_sdist):
    """Copies the repository's .proto files and the version into the sdist."""

    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        for path in codegen.API_PROTOS:
            dst = os.path.join(base_dir, "proto", path)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if os.path.exists(dst):
                os.remove(dst)  # a hard link into the source tree
            shutil.copyfile(codegen.find_proto(path), dst)
        with open(os.path.join(base_dir, VERSION_FILE), "w") as f:
            f.write(version() + "\n")


setup(version=version(), cmdclass={"build_py": build_py, "sdist": sdist})
