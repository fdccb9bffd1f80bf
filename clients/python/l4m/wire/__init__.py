"""The wire layer: what both ends of an l4m connection must agree on, beyond the generated stubs.

- `brle`: the binary run-length encoding of masks;
- `limits`: gRPC message limits of every hop and the per-command, per-batch bounds that follow;
- `rules`: the protocol's rules on a command's shape (one wording, called by the scheduler's validation,
  the executor's checks, the fake, the simulator and the SDK's builders);
- `tracecontext`: W3C trace context in and out of OpenTelemetry;
- `metadata`: the gRPC metadata keys;
- `credentials`: bearer secrets and TLS for listeners and channels.

Services and clients both import it; it imports only the stubs and itself (tests/unit/common/test_layering.py).
"""
