/**
 * Moved: `KvxferError` and `hasCode` live in src/errors.ts, where every layer
 * may import them. This re-export remains only for the modules not yet
 * switched (src/sidecar/event-log.ts); import from "../errors.js" instead.
 */
export { KvxferError, hasCode } from "../errors.js";
