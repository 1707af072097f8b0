/**
 * The one place peer notifications are encoded and parsed. Nothing from the
 * network is trusted: size capped, schema checked, ids bounded.
 */
import { randomBytes, timingSafeEqual } from "node:crypto";

import { fromBinary, type MessageInitShape } from "@bufbuild/protobuf";

import {
  PeerMessageSchema,
  type PeerMessage,
  type SealedPeerMessage,
  SealedPeerMessageSchema,
} from "../gen/kvxfer/v1/peer_pb.js";
import { MacKey } from "../native/index.js";
import { peerMessageToBinary, sealedPeerMessageToBinary } from "../gen/kvxfer/v1/peer_binary.js";

/** Largest peer notification accepted (a PushReg of 250k block ids fits). */
export const MAX_PEER_MESSAGE_BYTES = 1 << 20;
export const MAX_TRANSFER_ID_BYTES = 256;
export const MAX_TOKEN_BYTES = 128;

/** Constant-time equality of two transfer tokens. */
export function tokensEqual(a: string, b: string): boolean {
  const x = Buffer.from(a);
  const y = Buffer.from(b);
  return x.length === y.length && timingSafeEqual(x, y);
}

/** A peer message body to send (plain objects accepted). */
export type PeerBody = NonNullable<MessageInitShape<typeof PeerMessageSchema>["msg"]>;

export interface ParsedPeerMessage {
  readonly senderEngineId: string;
  readonly senderEpoch: bigint;
  readonly receiverEpoch: bigint;
  readonly seq: bigint;
  readonly body: Exclude<PeerMessage["msg"], { case: undefined }>;
}

export class PeerMessageError extends Error {
  constructor(
    readonly code: string,
    message: string,
  ) {
    super(message);
  }
}

export function encodePeerMessage(
  senderEngineId: string,
  senderEpoch: bigint,
  receiverEpoch: bigint,
  body: PeerBody,
  seq = 0n,
): Uint8Array {
  return peerMessageToBinary({ senderEngineId, senderEpoch, receiverEpoch, seq, msg: body });
}

/** Bytes of a MAC key handed over in the handshake. */
export const MAC_KEY_BYTES = 32;

export function newMacKey(): Buffer {
  return randomBytes(MAC_KEY_BYTES);
}

/** Bytes of an HMAC-SHA256. */
export const HMAC_SHA256_BYTES = 32;

/**
 * Each key's MacKey, made the first time the key object is used: a peer keeps its keys for the
 * connection's life, so the key is set up once per peer, not once per message (createHmac did
 * that per message: 2-3x the time of the whole seal on a sidecar idle between transfers).
 */
const macKeys = new WeakMap<Uint8Array, MacKey>();

function macKeyOf(key: Uint8Array): MacKey {
  let k = macKeys.get(key);
  if (k === undefined) {
    k = new MacKey(key);
    macKeys.set(key, k);
  }
  return k;
}

/**
 * A notification as it travels: the encoded PeerMessage and its HMAC-SHA256 under the sender's
 * key, as a SealedPeerMessage.
 */
export function sealPeerMessage(key: Uint8Array, message: Uint8Array): Uint8Array {
  return sealedPeerMessageToBinary({ message, mac: macKeyOf(key).sign(message) });
}

/** A received notification, parsed but not yet verified: `verify` with the sender's key. */
export interface OpenedPeerMessage extends ParsedPeerMessage {
  verify(key: Uint8Array): boolean;
}

/**
 * Parses a sealed notification; the caller looks the sender up, then calls `verify`, which
 * checks the MAC over the PeerMessage bytes as received (never a re-encoding of what was parsed).
 */
export function openPeerMessage(bytes: Uint8Array): OpenedPeerMessage {
  if (bytes.length > MAX_PEER_MESSAGE_BYTES + 64) {
    throw new PeerMessageError(
      "ERR_TOO_LARGE",
      `peer message of ${bytes.length} bytes exceeds ${MAX_PEER_MESSAGE_BYTES}`,
    );
  }
  let sealed: SealedPeerMessage;
  try {
    sealed = fromBinary(SealedPeerMessageSchema, bytes);
  } catch (err) {
    throw new PeerMessageError(
      "ERR_MALFORMED",
      `not a SealedPeerMessage: ${(err as Error).message}`,
    );
  }
  if (sealed.mac.length !== HMAC_SHA256_BYTES)
    throw new PeerMessageError("ERR_UNAUTHENTICATED", "peer message carries no MAC");
  const { message, mac } = sealed;
  const parsed = parsePeerMessage(message);
  return {
    ...parsed,
    verify: (key) => key.length > 0 && macKeyOf(key).verify(message, mac),
  };
}

/**
 * Which sequence numbers of one sender's stream were seen: numbers may arrive
 * out of order (several agent pairs carry one stream), so the last `size` are
 * remembered; anything older, or seen, is a replay.
 */
export class ReplayWindow {
  private highest = 0n;
  private readonly seen = new Set<bigint>();

  constructor(private readonly size = 4096n) {}

  /** True (and remembered) the first time `seq` is offered within the window. */
  accept(seq: bigint): boolean {
    if (seq === 0n) return false;
    if (seq + this.size <= this.highest || this.seen.has(seq)) return false;
    this.seen.add(seq);
    if (seq > this.highest) {
      this.highest = seq;
      if (this.seen.size > 2 * Number(this.size)) {
        for (const s of this.seen) if (s + this.size <= this.highest) this.seen.delete(s);
      }
    }
    return true;
  }
}

/**
 * The characters a transfer id may hold: printable ASCII other than the space, U+0021..U+007E
 * (issue 48). Ids reach logs, `kvxfer watch`, ListTransfers and the router's output as they are,
 * so two ids that look alike must be the same id: no space, no-break space or ideographic
 * space, no control or format character (bidi overrides, zero-width), no combining mark, no
 * homoglyph of another script, no private-use or unassigned code point. vLLM's request ids and
 * the routers' ids (prefixes, UUIDs, addresses) are all of this set.
 */
export const TRANSFER_ID_RULE = "printable characters of ASCII other than space (U+0021..U+007E)";
const NOT_ALLOWED = /[^\x21-\x7e]/u;

/** The one rule for a transfer id's characters (engine link, peers, gRPC): why not, or undefined. */
export function transferIdCharProblem(id: string, field = "transfer id"): string | undefined {
  const m = NOT_ALLOWED.exec(id);
  if (m === null) return undefined;
  const cp = m[0].codePointAt(0)!.toString(16).toUpperCase().padStart(4, "0");
  return `${field} holds U+${cp} at index ${m.index}: only ${TRANSFER_ID_RULE}`;
}

/**
 * The one rule for an engine id, wherever one is given (sidecar, simulated engine, engine link,
 * peer metadata, the vLLM connector's config.py): it names files, sockets and certificates.
 */
export const ENGINE_ID_RULE = "1..128 characters of [A-Za-z0-9._-]";
const ENGINE_ID = /^[A-Za-z0-9._-]{1,128}$/;

/** Why `id` is not a valid engine id (naming `field`), or undefined. */
export function engineIdProblem(id: string, field = "engine id"): string | undefined {
  return ENGINE_ID.test(id)
    ? undefined
    : `${field} must be ${ENGINE_ID_RULE}, got '${id.length > 64 ? id.slice(0, 64) + "..." : id}'`;
}

function checkTransferId(id: string): void {
  // Short ids need no count (UTF-8 takes at most 3 bytes per UTF-16 unit).
  const short = 3 * id.length <= MAX_TRANSFER_ID_BYTES;
  if (id.length === 0 || (!short && Buffer.byteLength(id) > MAX_TRANSFER_ID_BYTES)) {
    throw new PeerMessageError(
      "ERR_BAD_TRANSFER_ID",
      `transfer id must be 1..${MAX_TRANSFER_ID_BYTES} bytes`,
    );
  }
  const bad = transferIdCharProblem(id);
  if (bad !== undefined) throw new PeerMessageError("ERR_BAD_TRANSFER_ID", bad);
}

/** Parses and checks one notification; throws PeerMessageError naming what is wrong. */
export function parsePeerMessage(bytes: Uint8Array): ParsedPeerMessage {
  if (bytes.length > MAX_PEER_MESSAGE_BYTES) {
    throw new PeerMessageError(
      "ERR_TOO_LARGE",
      `peer message of ${bytes.length} bytes exceeds ${MAX_PEER_MESSAGE_BYTES}`,
    );
  }
  let msg: PeerMessage;
  try {
    msg = fromBinary(PeerMessageSchema, bytes);
  } catch (err) {
    throw new PeerMessageError("ERR_MALFORMED", `not a PeerMessage: ${(err as Error).message}`);
  }
  if (msg.msg.case === undefined)
    throw new PeerMessageError("ERR_MALFORMED", "peer message carries no body");
  if (msg.senderEngineId.length === 0)
    throw new PeerMessageError("ERR_MALFORMED", "peer message has no sender engine id");
  const body = msg.msg;
  switch (body.case) {
    case "pushReg":
    case "xferDone":
    case "readDone":
    case "readAck":
    case "abort":
    case "abortAck":
    case "failed":
      checkTransferId(body.value.transferId);
      if ("token" in body.value && Buffer.byteLength(body.value.token) > MAX_TOKEN_BYTES)
        throw new PeerMessageError(
          "ERR_BAD_TRANSFER_TOKEN",
          `token exceeds ${MAX_TOKEN_BYTES} bytes`,
        );
      break;
    case "heartbeat":
      if (body.value.transferIds.length > 1_000_000)
        throw new PeerMessageError("ERR_TOO_LARGE", "heartbeat names too many transfers");
      break;
  }
  return {
    senderEngineId: msg.senderEngineId,
    senderEpoch: msg.senderEpoch,
    receiverEpoch: msg.receiverEpoch,
    seq: msg.seq,
    body,
  };
}

/** Agent names carry the sender's identity: `<engineId>#<epoch>#<rank>`. */
export function agentName(engineId: string, epoch: bigint, rank: number): string {
  return `${engineId}#${epoch}#${rank}`;
}

export function parseAgentName(
  name: string,
): { engineId: string; epoch: bigint; rank: number } | undefined {
  const m = /^(.*)#(\d+)#(\d+)$/.exec(name);
  if (m === null) return undefined;
  return { engineId: m[1]!, epoch: BigInt(m[2]!), rank: Number(m[3]!) };
}
