/** l4m's TypeScript client: a SpawnerService client, an L4M session, and the generated l4m.v1 stubs. */
export { CHUNK_BYTES, DEFAULT_TIMEOUT_MS, SpawnerClient, type SpawnerClientOptions, exitStatus } from "./client.js";
export { L4MError } from "./errors.js";
export { type Command, L4MSession, TOKEN_METADATA_KEY } from "./session.js";
export * as common from "./gen/l4m/v1/common.js";
export * as l4m from "./gen/l4m/v1/l4m.js";
export * as spawner from "./gen/l4m/v1/spawner.js";
