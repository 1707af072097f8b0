/**
 * The engine's messages to this sidecar: registration and allocation to the KV registry, every
 * other message checked once (engine/validate.ts), refused while draining or at the wrong role,
 * and handed to the side that owns it. Never throws.
 */
import { ReleaseReason, type EngineToSidecar } from "../gen/kvxfer/v1/engine_pb.js";
import { KvxferError } from "../errors.js";
import { checkEngineMessage } from "../engine/validate.js";
import type { Logger } from "pino";
import type { ErrorPort } from "./context.js";
import type { DecodeSide } from "./decode.js";
import type { EngineOutbox, EngineSender } from "./engine-port.js";
import type { EngineConnection, KvRegistry } from "./kv-registration.js";
import type { PrefillSide } from "./prefill.js";
import type { SidecarLifecycle } from "./sidecar-lifecycle.js";
import { monoUs } from "./trace.js";
import type { SidecarRole, TransferMode } from "./view.js";
import { allBlockIds, blockLists } from "../plan/index.js";

/** What the dispatch hands messages to. */
export interface EngineDispatchParts {
  readonly role: SidecarRole;
  readonly mode: TransferMode;
  readonly log: Logger;
  readonly engine: EngineOutbox;
  readonly kvs: KvRegistry;
  readonly life: SidecarLifecycle;
  readonly prefill: PrefillSide;
  readonly decode: DecodeSide;
  readonly errors: ErrorPort;
}

export class EngineDispatch {
  constructor(private readonly parts: EngineDispatchParts) {}

  /**
   * Handles one message from the engine; never throws. `reply` reaches the connection that sent
   * it: refusals and the answer to a registration go there (an engine that is not, or no longer,
   * registered still hears why its message was refused), everything else to the registered engine.
   */
  receive(msg: EngineToSidecar, reply?: EngineSender, conn?: EngineConnection): void {
    const { role, mode, engine, kvs, life, prefill, decode } = this.parts;
    const receivedUs = monoUs();
    engine.replyingTo(reply);
    try {
      if (msg.msg.case === "register") {
        kvs.register(msg.msg.value, conn);
        return;
      }
      if (msg.msg.case === "allocate") {
        kvs.allocate(msg.msg.value, conn);
        return;
      }
      // One place checks engine messages' fields; a problem costs only the message.
      const problem = checkEngineMessage(msg, kvs.kv?.groups);
      if (problem !== undefined) {
        engine.refuse(problem.transferId, problem.code, problem.message);
        return;
      }
      if (life.draining && (msg.msg.case === "prefillDone" || msg.msg.case === "expectKv")) {
        // Blocks of a refused PrefillDone go straight back: no one will read them.
        if (msg.msg.case === "prefillDone") {
          engine.send({
            case: "releaseBlocks",
            value: {
              transferId: msg.msg.value.transferId,
              blockIds: allBlockIds(blockLists(msg.msg.value.groups, msg.msg.value.blockIds)),
              reason: ReleaseReason.FAILED,
            },
          });
        }
        if (msg.msg.case === "expectKv") decode.tellSourceDraining(msg.msg.value);
        engine.refuse(
          msg.msg.value.transferId,
          "ERR_DRAINING",
          "the sidecar is draining (SIGTERM): no new transfers",
        );
        return;
      }
      switch (msg.msg.case) {
        case "prefillDone":
          if (role === "decode")
            return engine.refuse(
              msg.msg.value.transferId,
              "ERR_WRONG_ROLE",
              "PrefillDone sent to a decode sidecar",
            );
          prefill.prefillDone(msg.msg.value, receivedUs);
          break;
        case "expectKv":
          if (role === "prefill")
            return engine.refuse(
              msg.msg.value.transferId,
              "ERR_WRONG_ROLE",
              "ExpectKv sent to a prefill sidecar",
            );
          // Pull when configured, or (auto) when the engine names P's blocks.
          decode.expectKv(
            msg.msg.value,
            mode === "pull" || (mode === "auto" && msg.msg.value.hasSourceBlockIds),
            receivedUs,
          );
          break;
        case "layersSaved":
          if (role === "decode")
            return engine.refuse(
              msg.msg.value.transferIds[0] ?? "",
              "ERR_WRONG_ROLE",
              "LayersSaved sent to a decode sidecar",
            );
          prefill.layersSaved(msg.msg.value, receivedUs);
          break;
        case "abort":
          this.abort(msg.msg.value.transferId);
          break;
        default:
          engine.refuse("", "ERR_MALFORMED", "engine message carries no body");
      }
    } catch (err) {
      const e = KvxferError.from(err);
      this.parts.errors.note(`engine message: ${e.code} ${e.message}`);
      this.parts.log.error({ err }, "engine message failed");
    } finally {
      engine.replyingTo(undefined);
    }
  }

  private abort(transferId: string): void {
    const { role, engine, prefill, decode } = this.parts;
    if (!decode.has(transferId) && !prefill.has(transferId)) {
      // P's engine may give up on a push before D registers: D's registration is refused then.
      if (role !== "decode") prefill.giveUp(transferId);
      return engine.refuse(transferId, "ERR_UNKNOWN_TRANSFER", `no transfer '${transferId}'`);
    }
    decode.abort(transferId);
    prefill.abort(transferId);
  }
}
