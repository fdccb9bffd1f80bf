"""What every l4m service shares and the SDK never imports: the gRPC front door (`serving`) and the
Prometheus helpers (`metrics`). The wire modules that clients need too (`l4m.credentials`,
`l4m.limits`, `l4m.brle`, `l4m.telemetry`) stay in the SDK; tests/unit/common/test_layering.py keeps
each service to these, the stubs and its own package."""
