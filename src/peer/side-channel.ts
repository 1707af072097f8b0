/**
 * The handshake side channel: a sidecar binds a ZeroMQ ROUTER on its listen
 * address; a peer connects a DEALER, sends one HandshakeRequest and waits (with
 * a deadline) for one HandshakeResponse.
 */
import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { Dealer, Router } from "zeromq";
import type { Logger } from "pino";

import {
  HandshakeRequestSchema,
  HandshakeResponseSchema,
  type HandshakeRequest,
  type HandshakeResponse,
} from "../gen/kvxfer/v1/peer_pb.js";
import { KvxferError } from "../native/errors.js";

/** Largest handshake frame accepted (metadata of 8 ranks with many regions fits easily). */
export const MAX_HANDSHAKE_BYTES = 4 << 20;

export type HandshakeHandler = (req: HandshakeRequest) => HandshakeResponse;

/** "host:port" → "tcp://host:port"; an explicit zmq endpoint passes through. */
export function zmqEndpoint(address: string): string {
  if (/^[a-z]+:\/\//.test(address)) return address;
  const m = /^(.*):(\d+)$/.exec(address);
  if (m === null) {
    throw new KvxferError(
      "ERR_BAD_ADDRESS",
      `side channel address must be host:port, got '${address}'`,
    );
  }
  return `tcp://${m[1]}:${m[2]}`;
}

export class SideChannelServer {
  private readonly socket = new Router();
  private closed = false;
  private loop: Promise<void> | undefined;
  /** "host:port" actually bound (port 0 resolved). */
  address = "";

  constructor(
    private readonly handler: HandshakeHandler,
    private readonly log: Logger,
    /** Told about frames refused before they reach the handler (malformed, too large). */
    private readonly onRefused?: (code: string, message: string) => void,
  ) {
    this.socket.linger = 0;
  }

  async bind(address: string): Promise<string> {
    await this.socket.bind(zmqEndpoint(address));
    const bound = this.socket.lastEndpoint ?? "";
    this.address = bound.replace(/^tcp:\/\//, "");
    this.loop = this.receive();
    return this.address;
  }

  private async receive(): Promise<void> {
    try {
      for await (const frames of this.socket) {
        const [id, body] = frames;
        if (id === undefined) continue;
        let response: HandshakeResponse;
        let req: HandshakeRequest | undefined;
        if (frames.length !== 2 || body === undefined) {
          response = refusal("ERR_MALFORMED", `expected one frame, got ${frames.length - 1}`);
        } else if (body.length > MAX_HANDSHAKE_BYTES) {
          response = refusal(
            "ERR_TOO_LARGE",
            `handshake of ${body.length} bytes exceeds ${MAX_HANDSHAKE_BYTES}`,
          );
        } else {
          try {
            req = fromBinary(HandshakeRequestSchema, body);
          } catch (err) {
            response = refusal(
              "ERR_MALFORMED",
              `not a HandshakeRequest: ${(err as Error).message}`,
            );
          }
          if (req !== undefined) {
            try {
              response = this.handler(req);
            } catch (err) {
              const e = KvxferError.from(err);
              response = refusal(e.code, e.message);
            }
          }
        }
        if (req === undefined && response!.errorCode !== "") {
          this.onRefused?.(response!.errorCode, response!.error);
        }
        try {
          await this.socket.send([id, toBinary(HandshakeResponseSchema, response!)]);
        } catch (err) {
          this.log.warn({ err }, "side channel: reply failed");
        }
      }
    } catch (err) {
      if (!this.closed) this.log.error({ err }, "side channel: receive loop ended");
    }
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.socket.close();
    await this.loop;
  }
}

export function refusal(code: string, message: string): HandshakeResponse {
  return create(HandshakeResponseSchema, { errorCode: code, error: message });
}

/** One handshake with the sidecar at `address`; rejects with a KvxferError after `timeoutMs`. */
export async function handshake(
  address: string,
  req: HandshakeRequest,
  timeoutMs: number,
): Promise<HandshakeResponse> {
  const socket = new Dealer();
  socket.linger = 0;
  socket.receiveTimeout = timeoutMs;
  socket.sendTimeout = timeoutMs;
  try {
    socket.connect(zmqEndpoint(address));
    await socket.send(toBinary(HandshakeRequestSchema, req));
    let frames: Buffer[];
    try {
      frames = await socket.receive();
    } catch (err) {
      throw new KvxferError(
        "ERR_UNREACHABLE",
        `no handshake answer from ${address} within ${timeoutMs} ms`,
        {
          cause: err,
        },
      );
    }
    const body = frames[frames.length - 1];
    if (body === undefined || body.length > MAX_HANDSHAKE_BYTES) {
      throw new KvxferError("ERR_MALFORMED", `bad handshake answer from ${address}`);
    }
    try {
      return fromBinary(HandshakeResponseSchema, body);
    } catch (err) {
      throw new KvxferError(
        "ERR_MALFORMED",
        `handshake answer from ${address} is not a HandshakeResponse`,
        {
          cause: err,
        },
      );
    }
  } finally {
    socket.close();
  }
}
