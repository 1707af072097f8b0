// What programs beside the sidecar use of it (package entry `kvxfer/sidecar`): its view of
// transfers and events (the types its API reports), its event log, its log sink and the phases
// of a transfer's trace. The sidecar itself is started by the CLI (`kvxfer sidecar`).
export { EventLog, type EventLogOptions } from "./event-log.js";
export { type LogSink, stderrSink } from "./log-sink.js";
export { dataPhase } from "./trace.js";
export type {
  EventKind,
  SidecarEvent,
  SidecarRole,
  SidecarStatus,
  SidecarView,
  TransferInfo,
  TransferMode,
  TransferState,
} from "./view.js";
