/**
 * Abandoned endpoints, waited out: a read or write given up on a silent peer is failed for
 * JavaScript at once but not cancelled in UCX (error mode none has no cancel, and over TCP an
 * abandoned operation's bytes wait in the old connection until the link comes back). The blocks
 * it touched may be reused only once UCX holds none of its operations: the endpoint's flush is
 * over (`Endpoint.settled()`), or the settle bound has passed.
 */
import type { Endpoint } from "../native/index.js";
import { DEFAULT_SETTLE_BOUND_MS, type LifecycleSettings, type SideContext } from "./context.js";

/** How long at most a side waits for an abandoned endpoint to settle. */
export function settleBound(s: LifecycleSettings): number {
  return s.settleBoundMs ?? DEFAULT_SETTLE_BOUND_MS;
}

/**
 * Waits until every abandoned endpoint in `eps` has settled, at most `settleBoundMs` (a warning
 * names the transfer if the bound ends the wait: a byte may still land in its blocks).
 */
export async function settleAbandoned(
  ctx: SideContext,
  transferId: string,
  peer: string,
  eps: readonly Endpoint[],
): Promise<void> {
  const waits = eps.filter((ep) => ep.abandoned).map((ep) => ep.settled());
  if (waits.length === 0) return;
  const boundMs = settleBound(ctx.settings);
  const started = ctx.clock.now();
  const bound = new Promise<"bound">((resolve) => ctx.clock.after(boundMs, () => resolve("bound")));
  const how = await Promise.race([Promise.all(waits), bound]);
  if (how === "bound") {
    ctx.log.warn(
      { transfer: transferId, peer, boundMs },
      "abandoned reads or writes not settled within the settle bound: their blocks go back anyway",
    );
  } else {
    ctx.log.info(
      { transfer: transferId, peer, waitedMs: ctx.clock.now() - started, codes: how },
      "abandoned reads or writes settled",
    );
  }
}
