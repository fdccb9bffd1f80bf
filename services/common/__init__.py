"""What every l4m service shares and the SDK never imports: the gRPC front door (`serving`) and the
Prometheus helpers (`metrics`). What clients need too stays in the SDK: the wire layer
(`l4m.wire`) and the tracing set-up (`l4m.telemetry`); tests/unit/common/test_layering.py keeps each service
to these, the stubs and its own package."""
