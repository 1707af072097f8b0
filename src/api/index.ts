// The gRPC API's public face (package entry `kvxfer/api`): the client routers and operators use,
// the server the sidecar starts, and the wire conversions and service definition a stand-in
// server (bench/native) needs to answer as the sidecar does.
export {
  type ClientTlsOptions,
  type EventWatch,
  type EventWatchFilter,
  type HealthStatus,
  type ResumableWatch,
  type ResumableWatchOptions,
  SidecarClient,
  type SidecarClientOptions,
  type SidecarStatusReply,
  type WatchOptions,
} from "./client.js";
export { encodeEventResponse, eventToProto } from "./convert.js";
export {
  type ApiServer,
  type ApiServerOptions,
  type ApiTlsOptions,
  startApiServer,
} from "./server.js";
export { asServiceDefinition, sidecarService } from "./service.js";
