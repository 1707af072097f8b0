/**
 * The typed face of the native UCX addon, and the one module the rest of kvxfer imports from it.
 * The addon is loaded (addon.ts) once, when this module is first imported; everything else in
 * kvxfer uses the classes and functions below.
 *
 * An Agent is one UCX context and worker with its own progress thread. It
 * registers memory (Regions), connects to peers (Endpoints), imports peers'
 * memory (RemoteRegions) and moves bytes with one-sided WRITE and READ.
 *
 * Its parts: agent.ts (Agent), handles.ts (Region, Endpoint, RemoteRegion, PreparedTransfer),
 * types.ts (plain data types), trace.ts (OpTrace and monoUs), ucx.ts (the UCX in use), mac.ts
 * (MacKey, HMAC-SHA256 for peer notifications), addon.ts
 * (the raw addon, its loading, and calls into it).
 */

// The addon's public face includes its error class (defined in src/errors.ts for every layer).
export { KvxferError, hasCode } from "../errors.js";
export { Agent, type AgentEvents, type TransferEntry, type WritePart } from "./agent.js";
export { Endpoint, PreparedTransfer, Region, RemoteRegion } from "./handles.js";
export { MacKey } from "./mac.js";
export { monoUs } from "./trace.js";
export type {
  AgentOptions,
  Descriptors,
  EndpointState,
  ErrorMode,
  MemoryType,
  Notification,
  OpTrace,
  UcxInfo,
} from "./types.js";
export { describeUcx, ucxGetReplyFix, ucxInfo, ucxVersion } from "./ucx.js";
