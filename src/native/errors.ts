/**
 * The one error class of kvxfer. `code` is stable (tests and callers match on
 * it, never on message text); `ucsStatus` is the numeric UCX status when UCX
 * produced the failure.
 */
export class KvxferError extends Error {
  override readonly name = "KvxferError";
  readonly code: string;
  readonly ucsStatus: number | undefined;

  constructor(
    code: string,
    message: string,
    options: { ucsStatus?: number; cause?: unknown } = {},
  ) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.code = code;
    this.ucsStatus = options.ucsStatus;
  }

  /**
   * Converts anything thrown by the addon into a KvxferError. When `site` is
   * given (an Error made where the caller started the operation), the stack
   * is the caller's, not the event loop's.
   */
  static from(err: unknown, site?: Error): KvxferError {
    if (err instanceof KvxferError && site === undefined) return err;
    const e = err as { code?: unknown; message?: unknown; ucsStatus?: unknown } | null;
    const code = typeof e?.code === "string" ? e.code : "ERR_INTERNAL";
    const message = typeof e?.message === "string" ? e.message : String(err);
    const ucsStatus = typeof e?.ucsStatus === "number" ? e.ucsStatus : undefined;
    const out = new KvxferError(
      code,
      message,
      ucsStatus === undefined ? { cause: err } : { ucsStatus, cause: err },
    );
    if (site?.stack !== undefined) {
      const frames = site.stack.split("\n").slice(1).join("\n");
      out.stack = `KvxferError [${code}]: ${message}\n${frames}`;
    }
    return out;
  }
}

/** True when `err` is a KvxferError with the given code. */
export function hasCode(err: unknown, code: string): boolean {
  return err instanceof KvxferError && err.code === code;
}
