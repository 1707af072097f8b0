/**
 * D's push registrations as P admits them: the registration a PushReg makes, every refusal P
 * answers a registration or a ReadDone with (the code D hears, its message, the line P notes
 * among its errors), and where a registration made before PrefillDone is kept. Pure rules:
 * PrefillSide (prefill.ts) sends what they decide.
 */
import type { PushReg } from "../gen/kvxfer/v1/peer_pb.js";
import { tokensEqual } from "../peer/messages.js";
import type { PeerState } from "../peer/peer-state.js";
import type { LifecycleSettings } from "./context.js";
import { PER_PEER_SHARE, type PrefillTransfer, type PushRegistration } from "./prefill-transfer.js";
import { blockLists } from "../plan/index.js";

/** A Failed that P sends D; `note`, when set, goes to P's last errors first. */
export interface Refusal {
  readonly code: string;
  readonly message: string;
  readonly note?: string;
}

const BAD_TOKENS: Refusal = { code: "ERR_BAD_TOKENS", message: "bad token counts in PushReg" };
// Its PrefillDone would be refused: D frees its blocks now, not at its watchdog.
const DRAINING: Refusal = { code: "ERR_DRAINING", message: "the prefill sidecar is stopping" };

/** A registration for an id P's engine has not named lives this long unless renewed (default). */
export const UNCONFIRMED_LEASE_MS = 5_000;

/**
 * The registration D's PushReg makes at `now`: its lease clamped to 100 ms .. 10 min; before
 * PrefillDone (`unconfirmed`) no longer than the unconfirmed lease, until P's engine names the
 * id (D's heartbeats renew it meanwhile).
 */
export function newRegistration(
  peer: PeerState,
  m: PushReg,
  now: number,
  unconfirmed: LifecycleSettings | undefined,
): PushRegistration {
  const requestedLeaseMs = Math.min(Math.max(m.leaseMs, 100), 10 * 60_000);
  const leaseMs =
    unconfirmed === undefined
      ? requestedLeaseMs
      : Math.min(requestedLeaseMs, unconfirmedLeaseMs(unconfirmed));
  return {
    transferId: m.transferId,
    peer,
    token: m.token,
    dstLists: blockLists(m.groups, m.blockIds),
    numTokens: m.numTokens,
    prefixTokens: m.prefixTokens,
    leaseMs,
    requestedLeaseMs,
    deadline: now + leaseMs,
  };
}

/** Registrations one decode engine may keep before PrefillDone. */
export function perPeerCap(s: LifecycleSettings): number {
  return s.maxPerPeer ?? Math.max(1, Math.floor(s.maxTransfers / PER_PEER_SHARE));
}

/** Registrations kept before PrefillDone, all decode engines together (P's unconfirmed pool). */
export function unconfirmedCap(s: LifecycleSettings): number {
  return s.maxUnconfirmed ?? Math.max(1, Math.floor(s.maxTransfers / PER_PEER_SHARE));
}

export function unconfirmedLeaseMs(s: LifecycleSettings): number {
  return s.unconfirmedLeaseMs ?? UNCONFIRMED_LEASE_MS;
}

/**
 * A registration past `peer`'s share of the unconfirmed pool (`mine` kept already), or in a
 * full pool where `peer` holds as many as any other decode engine: refused, or undefined.
 */
export function poolRefusal(
  peer: PeerState,
  transferId: string,
  mine: number,
  fullAndLargest: boolean,
  s: LifecycleSettings,
): Refusal | undefined {
  const share = perPeerCap(s);
  if (mine >= share)
    return {
      code: "ERR_OVERLOADED",
      message: `${share} registrations of yours wait for prefill on P`,
      note:
        `PushReg for '${transferId}' from '${peer.engineId}' refused: ERR_OVERLOADED ` +
        `(${share} registrations waiting for prefill from this engine)`,
    };
  if (fullAndLargest)
    return {
      code: "ERR_OVERLOADED",
      message: `${unconfirmedCap(s)} registrations wait for prefill on P, and yours are as many as any engine's`,
      note:
        `PushReg for '${transferId}' from '${peer.engineId}' refused: ERR_OVERLOADED ` +
        `(the ${unconfirmedCap(s)} places for registrations before prefill are taken; it holds the most)`,
    };
  return undefined;
}

/** What a displaced registration's decode engine hears (it frees its blocks at once). */
export const DISPLACED: Refusal = {
  code: "ERR_OVERLOADED",
  message:
    "registration displaced: P's places for registrations before prefill are full and your engine holds the most",
};

/** What P's side is, for a PushReg that would create an entry. */
export interface AdmissionState {
  /** The engine gave up on this id before its prefill. */
  readonly givenUp: boolean;
  readonly draining: boolean;
}

/**
 * D's PushReg for a transfer P does not know: refused, or undefined (it makes a new entry, if
 * the unconfirmed pool has room: poolRefusal).
 */
export function refuseNewEntry(m: PushReg, side: AdmissionState): Refusal | undefined {
  if (side.givenUp)
    return {
      code: "ERR_ABORTED",
      message: "the prefill engine gave up on this request before its prefill",
    };
  if (m.numTokens === 0 || m.prefixTokens > m.numTokens) return BAD_TOKENS;
  if (side.draining) return DRAINING;
  return undefined;
}

/**
 * CHECK_REG: D's PushReg for a live transfer. "again" for the same engine's registration again
 * (idempotent), a refusal, or undefined: it may stand (REG_OK).
 */
export function checkRegistration(
  t: PrefillTransfer,
  peer: PeerState,
  m: PushReg,
  draining: boolean,
): Refusal | "again" | undefined {
  const mine = t.pending.get(peer);
  if (t.reg?.peer === peer || (mine !== undefined && mine.withdrawn === undefined)) return "again";
  if (m.numTokens === 0 || m.prefixTokens > m.numTokens) return BAD_TOKENS;
  if (draining && t.blocks === undefined) return DRAINING;
  if (t.blocks !== undefined && !tokensEqual(t.token, m.token)) {
    // The transfer names its decode engine by its token: anyone else is refused, and the
    // transfer goes on waiting for the right one.
    return {
      code: "ERR_BAD_TRANSFER_TOKEN",
      message: "the transfer's token does not match",
      note: `PushReg for '${t.id}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
    };
  }
  return undefined;
}

/**
 * KEEP_ASIDE: before PrefillDone nobody knows whose token is right: `reg` is kept among the
 * transfer's registrations until then (a withdrawn one of the same engine is replaced; room was
 * made in the unconfirmed pool). Its deadline can only bring the entry's earlier (O(1)).
 */
export function keepAside(t: PrefillTransfer, reg: PushRegistration): void {
  t.pending.set(reg.peer, reg);
  t.deadline = Math.min(t.deadline, reg.deadline);
}

/** REFUSE_ENDED: a late registration for blocks already released (lease expired, aborted). */
export function endedRefusal(t: PrefillTransfer): Refusal {
  return {
    code:
      t.state === "EXPIRED"
        ? "ERR_LEASE_EXPIRED"
        : t.reason === "ERR_REGION_CHANGED"
          ? "ERR_REGION_CHANGED" // P's KV broke: D should hear why, not only that it ended
          : "ERR_ENDED",
    message: `transfer ended on P as ${t.state}`,
  };
}

/** REFUSE_REG_TAKEN: another decode engine's registration is the one P writes for. */
export function takenRefusal(t: PrefillTransfer, peer: PeerState): Refusal {
  return {
    code: "ERR_DUPLICATE",
    message: "another decode engine registered for this transfer",
    note:
      `PushReg for '${t.id}' from '${peer.engineId}' refused: ERR_DUPLICATE ` +
      `(registered by '${t.reg!.peer.engineId}')`,
  };
}

/** CHECK_READ_TOKEN: D's ReadDone presents the transfer's token, or is refused. */
export function readTokenRefusal(
  t: PrefillTransfer,
  peer: PeerState,
  token: string,
): Refusal | undefined {
  if (t.blocks === undefined || tokensEqual(t.token, token)) return undefined;
  return {
    code: "ERR_BAD_TRANSFER_TOKEN",
    message: "the transfer's token does not match",
    note: `ReadDone for '${t.id}' from '${peer.engineId}' refused: ERR_BAD_TRANSFER_TOKEN`,
  };
}
