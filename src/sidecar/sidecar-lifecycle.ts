/**
 * The sidecar's own lifecycle as one table: UNREGISTERED until the engine's KV registration is
 * accepted, SERVING while it takes new transfers and handshakes, DRAINING once told to stop
 * (SIGTERM, or its engine gone for good), CLOSED at the end. The facade (sidecar.ts) feeds it
 * events and asks it the questions that used to be flags (`kv === undefined`, `draining`,
 * `closed`). docs/protocol.md's diagram of it is generated from this table.
 */
export const SIDECAR_STATES = ["UNREGISTERED", "SERVING", "DRAINING", "CLOSED"] as const;
export type SidecarState = (typeof SIDECAR_STATES)[number];

export const SIDECAR_EVENTS = ["REGISTERED", "DRAIN", "CLOSE"] as const;
export type SidecarEvent = (typeof SIDECAR_EVENTS)[number];

/**
 * The next state for each (state, event); a missing pair is ignored (a second drain, a
 * registration again after an engine restart, anything once closed).
 */
export const SIDECAR_TABLE: Readonly<
  Record<SidecarState, Readonly<Partial<Record<SidecarEvent, SidecarState>>>>
> = {
  UNREGISTERED: { REGISTERED: "SERVING", DRAIN: "DRAINING", CLOSE: "CLOSED" },
  SERVING: { DRAIN: "DRAINING", CLOSE: "CLOSED" },
  // An engine may still register while the sidecar drains: it gets no new transfer.
  DRAINING: { CLOSE: "CLOSED" },
  CLOSED: {},
};

/** The sidecar's answer to `event` in `state`: the next state, or undefined (ignored). */
export function sidecarStep(state: SidecarState, event: SidecarEvent): SidecarState | undefined {
  return SIDECAR_TABLE[state][event];
}

/** The one writer of the sidecar's state. */
export class SidecarLifecycle {
  private current: SidecarState = "UNREGISTERED";

  get state(): SidecarState {
    return this.current;
  }

  /** Feeds `event`; returns whether it moved the sidecar. */
  on(event: SidecarEvent): boolean {
    const next = sidecarStep(this.current, event);
    if (next === undefined) return false;
    this.current = next;
    return true;
  }

  /** New transfers and handshakes are taken (the engine registered, no drain begun). */
  get serving(): boolean {
    return this.current === "SERVING";
  }

  get draining(): boolean {
    return this.current === "DRAINING";
  }

  get closed(): boolean {
    return this.current === "CLOSED";
  }
}
