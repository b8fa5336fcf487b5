"""The generated protobuf/gRPC modules: built into the wheel as
attnserve_client._proto; in a source checkout without a build, generated once
into a cache by codegen.ensure_stubs()."""

try:
    from ._proto.attnserve.v1 import attention_pb2, attention_pb2_grpc, model_config_pb2
    from ._proto.attnserve.grpc_ext.health.v1 import health_pb2, health_pb2_grpc
    BUILT_IN = True
except ModuleNotFoundError as e:  # only the missing _proto package means "checkout"
    if not (e.name or "").startswith(__package__ + "._proto"):
        raise
    from . import codegen
    codegen.ensure_stubs()
    from attnserve.v1 import attention_pb2, attention_pb2_grpc, model_config_pb2  # noqa: F401
    from attnserve.grpc_ext.health.v1 import health_pb2, health_pb2_grpc  # noqa: F401
    BUILT_IN = False
