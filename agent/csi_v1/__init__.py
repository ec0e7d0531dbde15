"""Generated gRPC stubs of the Container Storage Interface, spec v1.13.0 (see csi.proto,
from the spec's repository; regenerate with grpcio-tools as pyproject.toml says)."""
