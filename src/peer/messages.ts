/**
 * The one place peer notifications are encoded and parsed. Nothing from the
 * network is trusted: size capped, schema checked, ids bounded.
 */
import { randomBytes, timingSafeEqual } from "node:crypto";

import { create, fromBinary, toBinary, type MessageInitShape } from "@bufbuild/protobuf";

import {
  PeerMessageSchema,
  SealedPeerMessageSchema,
  type PeerMessage,
} from "../gen/kvxfer/v1/peer_pb.js";
import { FIELD_OVERHEAD, isUint32, isUint64, utf8Bound, WireReader, WireWriter } from "../wire.js";
import { HMAC_SHA256_BYTES, hmacSha256 } from "./hmac.js";

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
  const inner = encodeNotificationBody(body);
  if (inner !== undefined && [senderEpoch, receiverEpoch, seq].every(isUint64)) {
    return new WireWriter(utf8Bound(senderEngineId) + inner.bytes.length + 5 * FIELD_OVERHEAD)
      .string(1, senderEngineId)
      .uint64(2, senderEpoch)
      .uint64(3, receiverEpoch)
      .uint64(4, seq)
      .bytes(inner.field, inner.bytes)
      .finish();
  }
  return toBinary(
    PeerMessageSchema,
    create(PeerMessageSchema, { senderEngineId, senderEpoch, receiverEpoch, seq, msg: body }),
  );
}

/** XferDone's fields, as the hand encoder and reader know them (the tests check the schema). */
export const XFER_DONE_FIELDS = [
  "transferId",
  "srcRank",
  "dstRank",
  "bytes",
  "sincePrefillDoneMs",
] as const;
/** ReadDone's fields, likewise. */
export const READ_DONE_FIELDS = ["transferId", "bytes", "token"] as const;
/** ReadAck's fields, likewise. */
export const READ_ACK_FIELDS = ["transferId", "held", "unknown"] as const;

/** The PeerMessage field of each body written and read by hand. */
const XFER_DONE = 11;
const READ_DONE = 12;
const READ_ACK = 13;

/**
 * The body of a notification on a transfer's critical path, written by hand (src/wire.ts says
 * why): XferDone (push: one per rank pair), ReadDone and ReadAck (pull: the round trip that tells
 * D that P still held the blocks). Undefined for other bodies, and for a value the generic
 * encoder must judge.
 */
function encodeNotificationBody(body: PeerBody): { field: number; bytes: Uint8Array } | undefined {
  switch (body.case) {
    case "xferDone": {
      const v = body.value;
      const id = v.transferId ?? "";
      const src = v.srcRank ?? 0;
      const dst = v.dstRank ?? 0;
      const bytes = v.bytes ?? 0n;
      const since = v.sincePrefillDoneMs ?? 0;
      if (typeof bytes !== "bigint" || !isUint64(bytes) || ![src, dst, since].every(isUint32))
        return undefined;
      const inner = new WireWriter(utf8Bound(id) + 5 * FIELD_OVERHEAD)
        .string(1, id)
        .uint32(2, src)
        .uint32(3, dst)
        .uint64(4, bytes)
        .uint32(5, since)
        .finish();
      return { field: XFER_DONE, bytes: inner };
    }
    case "readDone": {
      const v = body.value;
      const id = v.transferId ?? "";
      const bytes = v.bytes ?? 0n;
      const token = v.token ?? "";
      if (typeof bytes !== "bigint" || !isUint64(bytes)) return undefined;
      const inner = new WireWriter(utf8Bound(id) + utf8Bound(token) + 3 * FIELD_OVERHEAD)
        .string(1, id)
        .uint64(2, bytes)
        .string(3, token)
        .finish();
      return { field: READ_DONE, bytes: inner };
    }
    case "readAck": {
      const v = body.value;
      const id = v.transferId ?? "";
      const held = v.held ?? false;
      const unknown = v.unknown ?? false;
      if (typeof held !== "boolean" || typeof unknown !== "boolean") return undefined;
      const inner = new WireWriter(utf8Bound(id) + 3 * FIELD_OVERHEAD)
        .string(1, id)
        .bool(2, held)
        .bool(3, unknown)
        .finish();
      return { field: READ_ACK, bytes: inner };
    }
    default:
      return undefined;
  }
}

/**
 * A PeerMessage carrying an XferDone, a ReadDone or a ReadAck, read by hand in the layout
 * protobuf writes (fields in order, ASCII text, bools as 0 or 1); undefined for anything else,
 * which protobuf-es then reads. Each costs 60-75 µs with protobuf-es after 20 ms idle (40-45
 * by hand), and every push reads an XferDone per rank pair, every pull a ReadDone on P and a ReadAck on D.
 */
export function decodeNotification(bytes: Uint8Array): PeerMessage | undefined {
  const r = new WireReader(bytes);
  const senderEngineId = r.string(1);
  const senderEpoch = r.uint64(2);
  const receiverEpoch = r.uint64(3);
  const seq = r.uint64(4);
  const field = r.nextField();
  const x = r.message(field);
  const transferId = x.string(1);
  let msg: PeerMessage["msg"];
  switch (field) {
    case XFER_DONE: {
      const srcRank = x.uint32(2);
      const dstRank = x.uint32(3);
      const moved = x.uint64(4);
      const sincePrefillDoneMs = x.uint32(5);
      msg = {
        case: "xferDone",
        value: {
          $typeName: "kvxfer.v1.XferDone",
          transferId,
          srcRank,
          dstRank,
          bytes: moved,
          sincePrefillDoneMs,
        },
      };
      break;
    }
    case READ_DONE: {
      const moved = x.uint64(2);
      const token = x.string(3);
      msg = {
        case: "readDone",
        value: { $typeName: "kvxfer.v1.ReadDone", transferId, bytes: moved, token },
      };
      break;
    }
    case READ_ACK: {
      const held = x.bool(2);
      const unknown = x.bool(3);
      msg = {
        case: "readAck",
        value: { $typeName: "kvxfer.v1.ReadAck", transferId, held, unknown },
      };
      break;
    }
    default:
      return undefined;
  }
  if (!r.done || !x.done) return undefined;
  return {
    $typeName: "kvxfer.v1.PeerMessage",
    senderEngineId,
    senderEpoch,
    receiverEpoch,
    seq,
    msg,
  };
}

/** Bytes of a MAC key handed over in the handshake. */
export const MAC_KEY_BYTES = 32;

export function newMacKey(): Buffer {
  return randomBytes(MAC_KEY_BYTES);
}

/**
 * A notification as it travels: the message and its HMAC-SHA256 under the sender's key, as a
 * SealedPeerMessage. Written here, byte for byte as protobuf-es writes it (field 1, then field
 * 2; the tests compare), because the generic encoder costs tens of µs when it has not run for a
 * while, which is every transfer's case.
 */
export function sealPeerMessage(key: Uint8Array, message: Uint8Array): Uint8Array {
  const mac = hmacSha256(key, message);
  const w = new WireWriter(message.length + mac.length + 2 * FIELD_OVERHEAD);
  if (message.length > 0) w.bytes(1, message); // proto3 leaves an empty field out
  return w.bytes(2, mac).finish();
}

/**
 * The two fields of a SealedPeerMessage in the layout `sealPeerMessage` writes (views into
 * `bytes`); undefined for any other layout, which the generic decoder then reads.
 */
function splitSealed(bytes: Uint8Array): { message: Uint8Array; mac: Uint8Array } | undefined {
  const r = new WireReader(bytes);
  const message = r.bytes(1);
  const mac = r.bytes(2);
  return r.done ? { message, mac } : undefined;
}

/** A received notification, parsed but not yet verified: `verify` with the sender's key. */
export interface OpenedPeerMessage extends ParsedPeerMessage {
  verify(key: Uint8Array): boolean;
}

/** Parses a sealed notification; the caller looks the sender up, then calls `verify`. */
export function openPeerMessage(bytes: Uint8Array): OpenedPeerMessage {
  if (bytes.length > MAX_PEER_MESSAGE_BYTES + 64) {
    throw new PeerMessageError(
      "ERR_TOO_LARGE",
      `peer message of ${bytes.length} bytes exceeds ${MAX_PEER_MESSAGE_BYTES}`,
    );
  }
  let sealed = splitSealed(bytes);
  try {
    sealed ??= fromBinary(SealedPeerMessageSchema, bytes);
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
    verify: (key) => timingSafeEqual(hmacSha256(key, message), mac),
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
 * Characters a transfer id may not hold: control characters (NUL, newline, escape, C1), format
 * characters (bidi overrides, zero-width), line and paragraph separators, lone surrogates. Ids
 * reach logs, `kvxfer watch` and the router's output as they are.
 */
const UNPRINTABLE = /[\p{Cc}\p{Cf}\p{Zl}\p{Zp}\p{Cs}]/u;

/** The one rule for a transfer id's characters (engine link, peers, gRPC): why not, or undefined. */
export function transferIdCharProblem(id: string, field = "transfer id"): string | undefined {
  const m = UNPRINTABLE.exec(id);
  if (m === null) return undefined;
  const cp = m[0].codePointAt(0)!.toString(16).toUpperCase().padStart(4, "0");
  return `${field} holds U+${cp} at index ${m.index}: only printable characters`;
}

function checkTransferId(id: string): void {
  // Short ids need no count (utf8Bound: at most 3 bytes per UTF-16 unit).
  const short = utf8Bound(id) <= MAX_TRANSFER_ID_BYTES;
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
    msg = decodeNotification(bytes) ?? fromBinary(PeerMessageSchema, bytes);
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
