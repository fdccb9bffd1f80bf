/**
 * The user's side of l4m: a SpawnerService client. Upload a controller program (chunked,
 * content-addressed by sha256), launch instances of it, attach to their output as an async iterator,
 * send them messages and terminate them. `run()` is `l4m run`. Every unary call has a deadline.
 *
 * Every call carries the user's API key as `authorization: Bearer <key>` metadata: the `apiKey`
 * option, else the environment's `L4M_API_KEY` (a spawner without `--insecure-local` refuses a call
 * without one: UNAUTHENTICATED). With `tlsCa` (PEM bytes of the CA, or `L4M_TLS_CA` naming a file) the
 * channel is TLS, verified against it.
 */
import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { readFile } from "node:fs/promises";
import { basename } from "node:path";

import { credentials, Metadata, type ServiceError, status } from "@grpc/grpc-js";

import { L4MError } from "./errors.js";
import {
  type AttachResponse,
  ExitReason,
  type InstanceExit,
  type InstanceInfo,
  type LaunchResponse,
  type Limits,
  type ListInstancesResponse,
  type SendMessageResponse,
  SpawnerServiceClient,
  type TerminateResponse,
  type UploadProgramRequest,
} from "./gen/l4m/v1/spawner.js";

/** The spawner accepts upload chunks of at most 1 MiB. */
export const CHUNK_BYTES = 1 << 20;
export const DEFAULT_TIMEOUT_MS = 30_000;

export interface SpawnerClientOptions {
  /** The user's API key (default: the environment's L4M_API_KEY). */
  apiKey?: string;
  /** PEM of the CA that signed the spawner's certificate: TLS (default: the file $L4M_TLS_CA names, else plaintext). */
  tlsCa?: Buffer;
}

export class SpawnerClient {
  private readonly stub: SpawnerServiceClient;
  private readonly apiKey: string | undefined;

  constructor(readonly address: string, readonly timeoutMs: number = DEFAULT_TIMEOUT_MS, options: SpawnerClientOptions = {}) {
    this.apiKey = options.apiKey ?? (process.env.L4M_API_KEY || undefined);
    const caFile = process.env.L4M_TLS_CA;
    const tlsCa = options.tlsCa ?? (caFile ? readFileSync(caFile) : undefined);
    this.stub = new SpawnerServiceClient(address, tlsCa ? credentials.createSsl(tlsCa) : credentials.createInsecure());
  }

  close(): void {
    this.stub.close();
  }

  /** Store a program (a `.py` file or a zip, told apart by `filename`); resolves to its id (sha256). */
  async upload(program: Uint8Array, filename: string, tag = ""): Promise<string> {
    const digest = createHash("sha256").update(program).digest("hex");
    const parts: UploadProgramRequest[] = [
      { part: { $case: "header", value: { sizeBytes: program.length, sha256: digest, tag, filename } } },
    ];
    for (let start = 0; start < program.length; start += CHUNK_BYTES) {
      parts.push({ part: { $case: "chunk", value: Buffer.from(program.subarray(start, start + CHUNK_BYTES)) } });
    }
    const response = await new Promise<{ sha256: string }>((resolve, reject) => {
      const call = this.stub.uploadProgram(this.metadata(), { deadline: this.deadline(4) }, (error, reply) =>
        error ? reject(this.failure("upload", error)) : resolve(reply!),
      );
      parts.forEach((part) => call.write(part));
      call.end();
    });
    if (response.sha256 !== digest) {
      throw new L4MError(`the spawner stored ${response.sha256}, not the ${digest} sent`);
    }
    return response.sha256;
  }

  async uploadFile(path: string, tag = ""): Promise<string> {
    return this.upload(await readFile(path), basename(path), tag);
  }

  /**
   * Start an instance of a stored program (its id or "name:tag"); resolves to the instance id. Unless
   * `detached`, the spawner ends it when nobody attaches (or the last attached client goes away). Its
   * session serves `model` (a name the scheduler lists in GetInfo's modelNames; "": the default). With
   * `shareProcess` it may run in one controller process with this user's other running launches of the
   * program that set it (LaunchRequest.shareProcess: cheaper launches, one fate).
   */
  async launch(program: string, args: string[] = [], limits?: Limits, detached = false, model = "",
               shareProcess = false): Promise<string> {
    const response = await this.unary<LaunchResponse>("launch", (done) =>
      this.stub.launch({ program, args, limits, detached, model, shareProcess }, this.metadata(),
                       { deadline: this.deadline() }, done),
    );
    return response.instanceId;
  }

  /**
   * Every event of the instance, from its start, ending with its exit, one by one (the spawner sends the
   * events that are ready together in one response, `batchEvents`). No deadline: stop iterating to detach.
   */
  async *attach(instanceId: string): AsyncGenerator<AttachResponse> {
    const call = this.stub.attach({ instanceId, batchEvents: true }, this.metadata());
    try {
      for await (const response of call as AsyncIterable<AttachResponse>) {
        if (response.events.length > 0) {
          yield* response.events;
        } else {
          yield response;
        }
      }
    } catch (error) {
      throw this.failure("attach", error as ServiceError);
    } finally {
      call.cancel();
    }
  }

  async send(instanceId: string, text: string): Promise<void> {
    await this.unary<SendMessageResponse>("send", (done) => this.stub.sendMessage({ instanceId, text }, this.metadata(), { deadline: this.deadline() }, done));
  }

  async terminate(instanceId: string): Promise<void> {
    await this.unary<TerminateResponse>("terminate", (done) => this.stub.terminate({ instanceId }, this.metadata(), { deadline: this.deadline() }, done));
  }

  async listInstances(): Promise<InstanceInfo[]> {
    const response = await this.unary<ListInstancesResponse>("list", (done) => this.stub.listInstances({}, this.metadata(), { deadline: this.deadline() }, done));
    return response.instances;
  }

  /** Upload, launch and attach; calls `onEvent` for every event; resolves to how the instance ended. */
  async run(path: string, args: string[] = [], onEvent?: (event: AttachResponse) => void): Promise<InstanceExit> {
    const instanceId = await this.launch(await this.uploadFile(path), args);
    for await (const event of this.attach(instanceId)) {
      onEvent?.(event);
      if (event.event?.$case === "exit") {
        return event.event.value;
      }
    }
    throw new L4MError(`the spawner ended the attach stream of ${instanceId} without an exit event`);
  }

  /** Per call: the API key as `authorization: Bearer <key>`. */
  private metadata(): Metadata {
    const metadata = new Metadata();
    if (this.apiKey) metadata.set("authorization", `Bearer ${this.apiKey}`);
    return metadata;
  }

  private deadline(factor = 1): Date {
    return new Date(Date.now() + factor * this.timeoutMs);
  }

  private unary<T>(what: string, start: (done: (error: ServiceError | null, reply?: T) => void) => void): Promise<T> {
    return new Promise((resolve, reject) =>
      start((error, reply) => (error ? reject(this.failure(what, error)) : resolve(reply!))),
    );
  }

  private failure(what: string, error: ServiceError): L4MError {
    // Only an unreachable spawner is worth asking about; a refusal (no key, another user's instance) says itself.
    const unreachable = error.code === status.UNAVAILABLE || error.code === status.DEADLINE_EXCEEDED;
    const hint = unreachable ? ` -- is the spawner running at ${this.address}?` : "";
    const keyHint = error.code === status.UNAUTHENTICATED ? " (set L4M_API_KEY or the apiKey option)" : "";
    return new L4MError(`${what} failed: ${error.message}${keyHint}${hint}`, { cause: error });
  }
}

/** A process exit status for an instance's exit: its own code, 3 for a trap, 1 otherwise (as `l4m run`). */
export function exitStatus(exit: InstanceExit): number {
  if (exit.reason === ExitReason.EXIT_REASON_EXITED) return exit.exitCode;
  if (exit.reason === ExitReason.EXIT_REASON_TRAPPED) return 3;
  return 1;
}
