"""The layering docs/ARCHITECTURE.md promises, checked on the source tree.

engine/ knows nothing of gRPC or protobuf, and nothing on the request path below the transport
(server/request, server/batching, server/dispatch) reaches generated protobuf code or gRPC, not
even through a project header it includes. Walks the include graph of the project's own headers.
"""

import os
import re
import unittest

SOURCE_DIR = os.environ.get(
    "ATTNSERVE_SOURCE_DIR", os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
INCLUDE = re.compile(r'^\s*#\s*include\s+[<"]([^>"]+)[>"]', re.M)
FORBIDDEN = (re.compile(r"\.pb\.h$"), re.compile(r"^grpc(pp)?/"), re.compile(r"^google/protobuf/"))


def includes(path):
    with open(path, encoding="utf-8") as f:
        return INCLUDE.findall(f.read())


def forbidden_reach(path):
    """First chain of includes from `path` that reaches a forbidden header, or None."""
    seen = set()
    stack = [(path, [os.path.relpath(path, SOURCE_DIR)])]
    while stack:
        current, chain = stack.pop()
        for inc in includes(current):
            if any(p.search(inc) for p in FORBIDDEN):
                return chain + [inc]
            local = os.path.join(SOURCE_DIR, inc)
            if os.path.isfile(local) and local not in seen:
                seen.add(local)
                stack.append((local, chain + [inc]))
    return None


def sources(*folders):
    for folder in folders:
        for root, _, files in os.walk(os.path.join(SOURCE_DIR, folder)):
            for name in sorted(files):
                if name.endswith((".h", ".cc", ".cuh", ".cu")):
                    yield os.path.join(root, name)


class LayeringTest(unittest.TestCase):
    def check(self, *folders):
        files = list(sources(*folders))
        self.assertGreater(len(files), 3, f"no sources found under {folders}")
        for path in files:
            chain = forbidden_reach(path)
            self.assertIsNone(chain, "forbidden include: " + " -> ".join(chain or []))

    def test_engine_has_no_grpc_or_protobuf(self):
        self.check("engine")

    def test_request_path_below_transport_has_no_generated_code(self):
        self.check("server/request", "server/batching", "server/dispatch", "server/sessions")

    def test_the_check_sees_a_forbidden_include(self):
        # The transport does include generated code: the walk must notice.
        path = os.path.join(SOURCE_DIR, "server/transport/attention_service.h")
        self.assertIsNotNone(forbidden_reach(path))


if __name__ == "__main__":
    unittest.main()
