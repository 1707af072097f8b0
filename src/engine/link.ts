/**
 * The engine link: one ZeroMQ connection between an engine and its sidecar. The sidecar binds a
 * ROUTER (`EngineLinkServer`), the engine connects a DEALER (`EngineLinkClient`); every frame is
 * one protobuf `EngineToSidecar` (engine → sidecar) or `SidecarToEngine` (sidecar → engine).
 *
 * Nothing an engine sends is trusted: each frame is size-capped and decoded in a try/catch, and a
 * frame that fails is answered with `Refused { code: ERR_TOO_LARGE | ERR_MALFORMED }`. The fields
 * of a well-formed message are checked by the sidecar with `checkEngineMessage` (validate.ts).
 */
export { EngineLinkClient, type EngineLinkClientOptions } from "./link-client.js";
export { EngineLinkServer, type EngineLinkServerOptions } from "./link-server.js";
export {
  DEFAULT_MAX_FRAME_BYTES,
  defaultEngineEndpoint,
  type EngineMessageHandler,
  type EnginePeer,
  type SidecarMessageHandler,
} from "./link-socket.js";
export { engineMessage, kvCacheRegistration, sidecarMessage } from "./messages.js";
export { ENGINE_ID_RULE, engineIdProblem } from "./validate.js";
// The link's messages (proto/kvxfer/v1/engine.proto), for an engine written against it.
export * from "../gen/kvxfer/v1/engine_pb.js";
