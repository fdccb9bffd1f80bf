/** Every failure of this client: a call that failed (with its gRPC status), a trap, a closed session. */
export class L4MError extends Error {
  override name = "L4MError";
}
