"""Generated gRPC stubs of the kubelet PodResources API (see api.proto)."""
