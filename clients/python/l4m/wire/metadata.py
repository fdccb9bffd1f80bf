"""The gRPC metadata keys l4m reads and writes."""

from __future__ import annotations

# A controller's per-instance token, on its L4M session and on the spans it exports through the spawner.
TOKEN_METADATA_KEY = "l4m-instance-token"
# The model an L4M session serves (GetInfoResponse.model_names); absent or empty: the scheduler's default.
MODEL_METADATA_KEY = "l4m-model"
# The control plane's and a user's bearer secret: `authorization: Bearer <secret>`.
AUTHORIZATION_METADATA_KEY = "authorization"
BEARER_PREFIX = "Bearer "
