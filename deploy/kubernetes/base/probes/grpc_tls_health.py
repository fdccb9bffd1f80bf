"""grpc.health.v1 Check over TLS, for a Kubernetes exec probe (the kubelet's own `grpc:` probe speaks no TLS).

Exits 0 when the server at L4M_HEALTH_ADDR answers SERVING, 1 otherwise (an error is printed): the same check
as docker-compose.yml's health check, with the certificate verified against the CA in L4M_TLS_CA for the name
in L4M_TLS_NAME (the pod's own DNS name, which its certificate covers) rather than the address dialled.
"""

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    with open(os.environ["L4M_TLS_CA"], "rb") as file:
        credentials = grpc.ssl_channel_credentials(file.read())
    options = [("grpc.ssl_target_name_override", os.environ["L4M_TLS_NAME"])]
    with grpc.secure_channel(os.environ["L4M_HEALTH_ADDR"], credentials, options=options) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=4)
        except grpc.RpcError as error:
            print(f"health check failed: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"not serving: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
