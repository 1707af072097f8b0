/**
 * The one place peer notifications are encoded and parsed. Nothing from the
 * network is trusted: size capped, schema checked, ids bounded.
 */
import { create, fromBinary, toBinary, type MessageInitShape } from "@bufbuild/protobuf";

import { PeerMessageSchema, type PeerMessage } from "../gen/kvxfer/v1/peer_pb.js";

/** Largest peer notification accepted (a PushReg of 250k block ids fits). */
export const MAX_PEER_MESSAGE_BYTES = 1 << 20;
export const MAX_TRANSFER_ID_BYTES = 256;

/** A peer message body to send (plain objects accepted). */
export type PeerBody = NonNullable<MessageInitShape<typeof PeerMessageSchema>["msg"]>;

export interface ParsedPeerMessage {
  readonly senderEngineId: string;
  readonly senderEpoch: bigint;
  readonly receiverEpoch: bigint;
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
): Uint8Array {
  return toBinary(
    PeerMessageSchema,
    create(PeerMessageSchema, { senderEngineId, senderEpoch, receiverEpoch, msg: body }),
  );
}

function checkTransferId(id: string): void {
  if (id.length === 0 || Buffer.byteLength(id) > MAX_TRANSFER_ID_BYTES) {
    throw new PeerMessageError(
      "ERR_BAD_TRANSFER_ID",
      `transfer id must be 1..${MAX_TRANSFER_ID_BYTES} bytes`,
    );
  }
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
