/**
 * The engine's end of the engine link: a ZeroMQ DEALER connected to the sidecar's ROUTER.
 */
import { fromBinary } from "@bufbuild/protobuf";
import type { Logger } from "pino";
import { Dealer } from "zeromq";

import {
  type EngineToSidecar,
  type SidecarToEngine,
  SidecarToEngineSchema,
} from "../gen/kvxfer/v1/engine_pb.js";
import { engineToSidecarToBinary } from "../gen/kvxfer/v1/engine_binary.js";
import { KvxferError } from "../errors.js";
import {
  checkCap,
  DEFAULT_MAX_FRAME_BYTES,
  errCode,
  HARD_CAP_FACTOR,
  LINGER_MS,
  SEND_HIGH_WATER_MARK,
  type SidecarMessageHandler,
  within,
} from "./link-socket.js";

export interface EngineLinkClientOptions {
  /** The sidecar's engine link endpoint. */
  readonly endpoint: string;
  /** Called once per well-formed message from the sidecar; what it throws is logged. */
  readonly onMessage: SidecarMessageHandler;
  readonly logger: Logger;
  /** Largest frame accepted from the sidecar (default `DEFAULT_MAX_FRAME_BYTES`). */
  readonly maxFrameBytes?: number;
  /**
   * Told when the connection to the sidecar comes up or goes down (a ZeroMQ socket monitor):
   * "connected" after a reconnect means the sidecar may have restarted, so register again.
   */
  readonly onState?: (state: "connected" | "disconnected") => void;
}

/**
 * The engine's end of the engine link. Connecting never waits for the sidecar: ZeroMQ queues
 * what is sent and reconnects by itself, so an engine may start before its sidecar.
 */
export class EngineLinkClient {
  readonly endpoint: string;
  readonly maxFrameBytes: number;
  private readonly socket: Dealer;
  private readonly log: Logger;
  private readonly onMessage: SidecarMessageHandler;
  private closed = false;
  private readonly loop: Promise<void>;

  constructor(options: EngineLinkClientOptions) {
    this.endpoint = options.endpoint;
    this.maxFrameBytes = checkCap(options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES);
    this.onMessage = options.onMessage;
    this.log = options.logger.child({ component: "engine-link" });
    this.socket = new Dealer({
      linger: LINGER_MS,
      sendTimeout: 0,
      sendHighWaterMark: SEND_HIGH_WATER_MARK,
      maxMessageSize: this.maxFrameBytes * HARD_CAP_FACTOR,
      reconnectInterval: 50,
      reconnectMaxInterval: 1000,
    });
    const onState = options.onState;
    if (onState !== undefined) {
      const tell = (state: "connected" | "disconnected"): void => {
        if (this.closed) return;
        try {
          onState(state);
        } catch (err) {
          this.log.error({ err, state }, "engine link state handler threw");
        }
      };
      this.socket.events.on("connect", () => tell("connected"));
      this.socket.events.on("disconnect", () => tell("disconnected"));
    }
    this.socket.connect(this.endpoint);
    this.loop = this.receiveLoop();
  }

  private async receiveLoop(): Promise<void> {
    while (!this.closed) {
      try {
        for await (const frames of this.socket) this.onFrames(frames);
        return;
      } catch (err) {
        if (this.closed) return;
        this.log.error({ err }, "engine link receive failed; resuming");
        await new Promise((r) => setTimeout(r, 10));
      }
    }
  }

  private onFrames(frames: Buffer[]): void {
    const body = frames[0];
    if (frames.length !== 1 || body === undefined) {
      this.log.warn({ parts: frames.length }, "sidecar sent a multi-part message; dropped");
      return;
    }
    if (body.length > this.maxFrameBytes) {
      this.log.warn({ bytes: body.length }, "sidecar sent an oversized frame; dropped");
      return;
    }
    let msg: SidecarToEngine;
    try {
      msg = fromBinary(SidecarToEngineSchema, body);
    } catch (err) {
      this.log.warn({ err }, "sidecar sent a malformed frame; dropped");
      return;
    }
    if (msg.msg.case === undefined) {
      this.log.warn("sidecar sent a message with nothing set; dropped");
      return;
    }
    try {
      this.onMessage(msg);
    } catch (err) {
      this.log.error({ err, kind: msg.msg.case }, "sidecar message handler threw");
    }
  }

  /** Queues one message. Rejects with ERR_CLOSED, or ERR_SEND_FAILED when the queue is full. */
  async send(msg: EngineToSidecar): Promise<void> {
    await this.sendRaw(engineToSidecarToBinary(msg));
  }

  /** Queues one frame of raw bytes: for tests and tools that send what an engine should not. */
  async sendRaw(frame: Uint8Array | Uint8Array[]): Promise<void> {
    if (this.closed) throw new KvxferError("ERR_CLOSED", "engine link is closed");
    try {
      await this.socket.send(frame);
    } catch (err) {
      throw new KvxferError(
        "ERR_SEND_FAILED",
        `engine link send failed (${errCode(err) || "unknown"}): ${(err as Error).message}`,
        { cause: err },
      );
    }
  }

  /** Idempotent; what is queued gets `LINGER_MS` to reach the sidecar. */
  async close(timeoutMs = 2000): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.socket.close();
    await within(this.loop, timeoutMs);
  }
}
