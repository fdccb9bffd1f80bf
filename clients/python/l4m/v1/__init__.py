"""Generated protobuf and gRPC stubs of the `l4m.v1` protocol (protos/l4m/v1). Regenerate with scripts/gen-protos.sh."""
