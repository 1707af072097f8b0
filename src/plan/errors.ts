/**
 * Errors of the planner. The plan module imports nothing of ours, so it has its own error class;
 * the sidecar maps it onto the shared `KvxferError` by `code`. Callers assert on `code` and
 * `field`, never on message text.
 */
export type PlanErrorCode =
  /** A layout is malformed on its own (bad numbers, slots outside regions, overlapping slots). */
  | "ERR_LAYOUT_INVALID"
  /** Two valid layouts cannot exchange KV (different model shape or TP sizes). */
  | "ERR_LAYOUT_INCOMPATIBLE"
  /** A request does not fit the layouts (token counts, block ids). */
  | "ERR_PLAN_INVALID";

export class PlanError extends Error {
  override readonly name = "PlanError";
  readonly code: PlanErrorCode;
  /** The layout or request field at fault, e.g. `numLayers`, `dstBlockIds`. */
  readonly field: string;

  constructor(code: PlanErrorCode, field: string, message: string) {
    super(message);
    this.code = code;
    this.field = field;
  }
}
