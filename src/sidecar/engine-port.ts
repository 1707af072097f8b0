/**
 * The engine as the sides and the facade reach it: messages to the registered engine, and
 * answers (a refusal, a registration's answer) to the sender of the engine message being
 * handled. Also the last errors kept for GetStatus, where every refusal is noted.
 */
import { create } from "@bufbuild/protobuf";
import type { Logger } from "pino";

import { SidecarToEngineSchema, type SidecarToEngine } from "../gen/kvxfer/v1/engine_pb.js";
import type { EngineMessage, EnginePort } from "./context.js";

/** Where a sidecar sends what its engine must hear. */
export type EngineSender = (msg: SidecarToEngine) => void;

/** The last errors, for GetStatus (bounded). */
export class LastErrors {
  private readonly kept: string[] = [];

  note(text: string): void {
    this.kept.push(`${new Date().toISOString()} ${text}`);
    if (this.kept.length > 20) this.kept.shift();
  }

  list(): string[] {
    return [...this.kept];
  }
}

export class EngineOutbox implements EnginePort {
  private sendTo: EngineSender = () => {};
  /** The sender of the engine message being handled, while it is handled. */
  private replyTo: EngineSender | undefined;

  constructor(
    private readonly log: Logger,
    private readonly errors: LastErrors,
  ) {}

  /** Messages go to `send` from now on (the engine link). */
  connect(send: EngineSender): void {
    this.sendTo = send;
  }

  /** Answers go to `reply` (the sender of the engine message now handled; undefined: none). */
  replyingTo(reply: EngineSender | undefined): void {
    this.replyTo = reply;
  }

  send(msg: EngineMessage): void {
    this.sendTo(create(SidecarToEngineSchema, { msg }));
  }

  /** To the sender of the engine message being handled (else the registered engine). */
  answer(msg: EngineMessage): void {
    (this.replyTo ?? this.sendTo)(create(SidecarToEngineSchema, { msg }));
  }

  /** Refuses the engine message being handled (`Refused`, to its sender). */
  refuse(transferId: string, code: string, message: string): void {
    this.errors.note(`${code}: ${message}`);
    this.log.warn({ transferId, code }, message);
    this.answer({ case: "refused", value: { transferId, code, message } });
  }
}
