/**
 * One L4M session: the bidirectional command stream of `L4MService.Session` on the scheduler.
 *
 * Commands run in the order sent. `send()` is for fire-and-forget commands (allocate, forward_text
 * without outputs, ...); `request()` for commands the scheduler answers, matched by `requestId`.
 * A `Trap` (or the stream ending) fails every pending and every later request with an `L4MError`.
 */
import { type ClientDuplexStream, credentials, Metadata, type ServiceError } from "@grpc/grpc-js";

import { L4MError } from "./errors.js";
import {
  GetInfoRequest,
  type GetInfoResponse,
  L4MServiceClient,
  type SessionRequest,
  type SessionResponse,
} from "./gen/l4m/v1/l4m.js";

/** gRPC metadata key of the per-instance token (not needed by a scheduler started with --allow-anonymous). */
export const TOKEN_METADATA_KEY = "l4m-instance-token";
const MAX_MESSAGE_BYTES = 64 << 20; // GetInfo carries the tokenizer JSON (a few MiB)

export type Command = NonNullable<SessionRequest["command"]>;

interface Pending {
  resolve: (response: SessionResponse) => void;
  reject: (error: Error) => void;
}

export class L4MSession {
  private readonly stub: L4MServiceClient;
  private readonly metadata = new Metadata();
  private call: ClientDuplexStream<SessionRequest, SessionResponse> | undefined;
  private readonly pending = new Map<number, Pending>();
  private nextRequestId = 1;
  private failure: L4MError | undefined;

  constructor(readonly address: string, token?: string, readonly timeoutMs = 30_000) {
    this.stub = new L4MServiceClient(address, credentials.createInsecure(), {
      "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
    });
    if (token) this.metadata.set(TOKEN_METADATA_KEY, token);
  }

  /** Model, page size and capacities (a unary call; needs no open stream). */
  getInfo(): Promise<GetInfoResponse> {
    return new Promise((resolve, reject) =>
      this.stub.getInfo(GetInfoRequest.fromPartial({}), this.metadata, { deadline: Date.now() + this.timeoutMs }, (error, reply) =>
        error ? reject(new L4MError(`GetInfo failed: ${error.message} -- is the scheduler at ${this.address}?`)) : resolve(reply!),
      ),
    );
  }

  /** Queue a command with no reply. */
  send(command: Command, streamId = 0): void {
    this.write(command, streamId);
  }

  /** Send a command the scheduler answers; resolves to its reply. */
  request(command: Command, streamId = 0): Promise<SessionResponse> {
    return new Promise((resolve, reject) => {
      const requestId = this.write(command, streamId);
      this.pending.set(requestId, { resolve, reject });
    });
  }

  /** End the stream (the scheduler frees every page the session held) and the channel. */
  close(): void {
    this.call?.end();
    this.fail(new L4MError("the session was closed"));
    this.stub.close();
  }

  private write(command: Command, streamId: number): number {
    if (this.failure) throw this.failure;
    const requestId = this.nextRequestId++;
    this.open().write({ streamId, requestId, command });
    return requestId;
  }

  private open(): ClientDuplexStream<SessionRequest, SessionResponse> {
    if (this.call) return this.call;
    const call = this.stub.session(this.metadata);
    call.on("data", (response: SessionResponse) => this.dispatch(response));
    call.on("error", (error: ServiceError) =>
      this.fail(new L4MError(`the L4M stream ended: ${error.message}`, { cause: error })),
    );
    call.on("end", () => this.fail(new L4MError("the scheduler ended the L4M stream")));
    this.call = call;
    return call;
  }

  private dispatch(response: SessionResponse): void {
    if (response.event?.$case === "trap") {
      const trap = response.event.value;
      this.fail(new L4MError(`trapped (kind ${trap.kind}) by request ${trap.offendingRequestId}: ${trap.reason}`));
      return;
    }
    const waiter = this.pending.get(response.requestId);
    this.pending.delete(response.requestId);
    waiter?.resolve(response);
  }

  private fail(error: L4MError): void {
    this.failure ??= error;
    for (const waiter of this.pending.values()) waiter.reject(this.failure);
    this.pending.clear();
  }
}
