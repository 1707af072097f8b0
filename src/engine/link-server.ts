/**
 * The sidecar's end of the engine link: a ZeroMQ ROUTER that serves the one engine whose
 * registration was accepted. Each received frame is size-capped and decoded in a try/catch; a
 * frame that fails is answered with `Refused { code: ERR_TOO_LARGE | ERR_MALFORMED }`.
 */
import { chmodSync, lstatSync, unlinkSync } from "node:fs";
import type { Server } from "node:net";

import { create, fromBinary } from "@bufbuild/protobuf";
import type { Logger } from "pino";
import { Router } from "zeromq";

import {
  type EngineToSidecar,
  EngineToSidecarSchema,
  RefusedSchema,
  type SidecarToEngine,
} from "../gen/kvxfer/v1/engine_pb.js";
import { sidecarToEngineToBinary } from "../gen/kvxfer/v1/engine_binary.js";
import { KvxferError } from "../errors.js";
import {
  checkCap,
  DEFAULT_MAX_FRAME_BYTES,
  type EngineMessageHandler,
  type EnginePeer,
  errCode,
  HARD_CAP_FACTOR,
  LINGER_MS,
  SEND_HIGH_WATER_MARK,
  within,
} from "./link-socket.js";
import { sidecarMessage } from "./messages.js";
import { fileId, ipcPath, listenLock, socketLive, unlinkIfSame } from "./socket-file.js";

/** libzmq's ZMQ_ROUTER_NOTIFY (a draft option zeromq.js builds in, but does not name). */
const ZMQ_ROUTER_NOTIFY = 97;
/** ZMQ_NOTIFY_DISCONNECT: the ROUTER reads `[routing id, empty frame]` when a peer goes. */
const ZMQ_NOTIFY_DISCONNECT = 2;

/**
 * Asks `router` for an empty frame from a connection when that connection ends, so the link
 * knows when the engine that owns it is gone (and a reconnecting engine may take it over).
 * False when this libzmq lacks the option. (zeromq.js seals its sockets, so no subclass.)
 */
function enableDisconnectNotify(router: Router): boolean {
  try {
    (router as unknown as { setInt32Option(option: number, value: number): void }).setInt32Option(
      ZMQ_ROUTER_NOTIFY,
      ZMQ_NOTIFY_DISCONNECT,
    );
    return true;
  } catch {
    return false;
  }
}

export interface EngineLinkServerOptions {
  /** Any ZeroMQ endpoint; `defaultEngineEndpoint(engineId)` is the usual one. */
  readonly endpoint: string;
  /** Called once per well-framed message, in arrival order; what it throws is logged. */
  readonly onMessage: EngineMessageHandler;
  /** A pino logger; the link logs under a child `{ component: "engine-link" }`. */
  readonly logger: Logger;
  /** Largest frame accepted (default `DEFAULT_MAX_FRAME_BYTES`). */
  readonly maxFrameBytes?: number;
  /** Told about every frame refused at the link (malformed, too large), e.g. for status. */
  readonly onRefused?: (code: string, message: string) => void;
  /** Told when an engine's connection ends (ZMQ_ROUTER_NOTIFY), owner or not. */
  readonly onConnectionEnded?: (peer: EnginePeer) => void;
}

/** The sidecar's end of the engine link. */
export class EngineLinkServer {
  readonly endpoint: string;
  readonly maxFrameBytes: number;
  private readonly socket: Router;
  private readonly log: Logger;
  private readonly onMessage: EngineMessageHandler;
  private readonly onRefused: ((code: string, message: string) => void) | undefined;
  private readonly onEnded: ((peer: EnginePeer) => void) | undefined;
  private phase: "new" | "open" | "closed" = "new";
  private loop: Promise<void> | undefined;
  /** The connection of the accepted registration (`adopt`): the only one the link serves. */
  private owner: EnginePeer | undefined;
  /** False once the owner's connection ended (until a frame from it, or a takeover). */
  private ownerUp = false;
  /** Messages for the owner while its connection is down, delivered on a takeover (bounded). */
  private readonly held: SidecarToEngine[] = [];
  /** An ipc endpoint's lock: a unix socket at `<path>.lock` this process listens on. */
  private lock: { path: string; id: string | undefined; server: Server } | undefined;
  /** The ipc socket file this link bound, and its (device, inode): removed on close. */
  private socketFile: { path: string; id: string | undefined } | undefined;

  constructor(options: EngineLinkServerOptions) {
    this.endpoint = options.endpoint;
    this.maxFrameBytes = checkCap(options.maxFrameBytes ?? DEFAULT_MAX_FRAME_BYTES);
    this.onMessage = options.onMessage;
    this.onRefused = options.onRefused;
    this.onEnded = options.onConnectionEnded;
    this.log = options.logger.child({ component: "engine-link" });
    this.socket = new Router({
      linger: LINGER_MS,
      // Unroutable sends fail (EHOSTUNREACH) instead of vanishing; with a zero send timeout a
      // full queue fails at once instead of blocking every later send.
      mandatory: true,
      sendTimeout: 0,
      sendHighWaterMark: SEND_HIGH_WATER_MARK,
      // Set before bind: libzmq drops a connection whose frame header announces more than
      // this, before it allocates or buffers the frame.
      maxMessageSize: this.maxFrameBytes * HARD_CAP_FACTOR,
    });
    if (!enableDisconnectNotify(this.socket)) {
      this.log.warn(
        "this libzmq has no ZMQ_ROUTER_NOTIFY: a reconnecting engine cannot take its link back",
      );
    }
  }

  /** The endpoint actually bound (a tcp port 0 resolved), once started. */
  get boundEndpoint(): string {
    return this.socket.lastEndpoint ?? this.endpoint;
  }

  /** The connection that owns the link (its registration was accepted: `adopt`), if any. */
  get registeredEngine(): EnginePeer | undefined {
    return this.owner;
  }

  /** True when `peer` is the connection that owns the link. */
  isOwner(peer: EnginePeer): boolean {
    return this.owner !== undefined && this.owner.id === peer.id;
  }

  /**
   * True while the owner's connection is up; false when no engine owns the link, or when the
   * owner's connection ended (ZeroMQ told us) and no frame has come from it since.
   */
  get ownerConnected(): boolean {
    return this.owner !== undefined && this.ownerUp;
  }

  /**
   * Makes `peer` the owner of the link: the sidecar calls this when it accepts a registration
   * from `peer`, and only then. A refused registration never changes the owner. A takeover (a
   * new connection while the old owner's is gone) gets what was held for the old one.
   */
  adopt(peer: EnginePeer): void {
    const previous = this.owner;
    this.owner = peer;
    this.ownerUp = true;
    if (previous !== undefined && previous.id !== peer.id) {
      this.log.warn(
        { previous: previous.id, peer: peer.id, held: this.held.length },
        "engine link taken over by a new connection of the engine (the old one ended)",
      );
    }
    this.flushHeld();
  }

  private flushHeld(): void {
    const to = this.owner;
    if (to === undefined) return;
    for (const m of this.held.splice(0)) void this.send(to, m);
  }

  /**
   * Binds the endpoint and starts receiving. Rejects with ERR_ENGINE_SOCKET_IN_USE when another
   * live process holds the ipc socket, ERR_BIND when the endpoint cannot be bound.
   *
   * ZeroMQ's ipc bind unlinks whatever file is at the path and binds anew, so a second sidecar
   * would silently take the socket of a live one. Before binding, this link takes a lock: a unix
   * socket at `<path>.lock` it listens on for its whole life. bind(2) creates that file
   * atomically (EADDRINUSE if it exists), and whether its holder is alive is whether a connect
   * succeeds: a lock left by a process that died (kill -9) refuses connections and is taken
   * over. The socket itself is probed too, for a holder that takes no lock.
   */
  async start(): Promise<void> {
    if (this.phase !== "new") {
      throw new KvxferError("ERR_STATE", `engine link is ${this.phase}; start() runs once`);
    }
    const path = ipcPath(this.endpoint);
    const fsPath = path !== undefined && path !== "" && !path.startsWith("@") && path !== "*";
    // An ipc socket file is created owner-only: the umask covers the bind itself (no moment
    // when another user could connect), the chmod covers a umask that something else changed.
    const umask = path !== undefined ? process.umask(0o077) : undefined;
    try {
      if (fsPath) await this.takeLock(path);
      await this.socket.bind(this.endpoint);
      const bound = ipcPath(this.boundEndpoint) ?? path;
      if (bound !== undefined && bound !== "" && !bound.startsWith("@")) {
        this.socketFile = { path: bound, id: fileId(bound) };
        const st = lstatSync(bound);
        if (!st.isSocket())
          throw new Error(`${bound} is not a socket after bind (mode ${st.mode.toString(8)})`);
        if ((st.mode & 0o777) !== 0o600) chmodSync(bound, 0o600);
      }
    } catch (err) {
      this.phase = "closed";
      this.socket.close();
      this.removeFiles();
      if (err instanceof KvxferError) throw err;
      throw new KvxferError(
        "ERR_BIND",
        `engine link cannot bind ${this.endpoint}: ${(err as Error).message}`,
        { cause: err },
      );
    } finally {
      if (umask !== undefined) process.umask(umask);
    }
    this.phase = "open";
    this.loop = this.receiveLoop();
    this.log.info({ endpoint: this.endpoint }, "engine link listening");
  }

  private async takeLock(path: string): Promise<void> {
    const inUse = (): KvxferError =>
      new KvxferError(
        "ERR_ENGINE_SOCKET_IN_USE",
        `engine socket ${this.endpoint} is held by another live process (another sidecar for this engine?); stop it or give --engine-socket another path`,
      );
    const lockPath = `${path}.lock`;
    for (let attempt = 0; ; attempt++) {
      try {
        const server = await listenLock(lockPath);
        this.lock = { path: lockPath, id: fileId(lockPath), server };
        break;
      } catch (err) {
        const code = (err as NodeJS.ErrnoException).code;
        if (code !== "EADDRINUSE") {
          // No lock possible here (e.g. the path is too long for one more suffix): the probe
          // of the socket below still refuses a live holder, only a simultaneous start is not.
          this.log.warn({ lock: lockPath, err: code }, "cannot take the engine socket lock");
          break;
        }
        if (attempt >= 2) throw err;
      }
      if (await socketLive(lockPath)) throw inUse();
      // A lock left by a holder that died: take it over.
      this.log.warn({ lock: lockPath }, "removing a stale engine socket lock (its holder is gone)");
      try {
        unlinkSync(lockPath);
      } catch {
        // someone else removed it: try again
      }
    }
    let live = false;
    try {
      live = await socketLive(path);
    } catch {
      live = false; // not a socket, or it does not answer: the bind decides
    }
    if (live) throw inUse();
  }

  /**
   * Removes the ipc socket file and the lock this link made, if they are still the files it
   * made; synchronous, for a process 'exit' hook. `close()` calls it.
   */
  removeFiles(): void {
    if (this.socketFile !== undefined) unlinkIfSame(this.socketFile.path, this.socketFile.id);
    this.socketFile = undefined;
    if (this.lock !== undefined) {
      // The socket first: no moment when the lock is gone but the socket still ours.
      unlinkIfSame(this.lock.path, this.lock.id);
      this.lock.server.close();
      this.lock = undefined;
    }
  }

  private async receiveLoop(): Promise<void> {
    // One loop; an error ends one pass, is logged, and the loop resumes unless the link closed.
    while (this.phase === "open") {
      try {
        for await (const frames of this.socket) {
          this.onFrames(frames);
        }
        return; // the socket closed
      } catch (err) {
        if (this.phase !== "open") return;
        this.log.error({ err }, "engine link receive failed; resuming");
        await new Promise((r) => setTimeout(r, 10));
      }
    }
  }

  private onFrames(frames: Buffer[]): void {
    const routingId = frames[0];
    if (routingId === undefined) return;
    const from: EnginePeer = { id: routingId.toString("hex"), routingId };
    if (frames.length !== 2) {
      this.refuse(
        from,
        "ERR_MALFORMED",
        `expected one frame per message, got ${frames.length - 1}`,
      );
      return;
    }
    const body = frames[1]!;
    if (body.length === 0) {
      // ZMQ_ROUTER_NOTIFY: this connection ended. An engine never sends an empty frame (every
      // EngineToSidecar has its oneof set); one that does is answered and treated the same.
      this.onConnectionEnded(from);
      void this.send(
        from,
        sidecarMessage(
          "refused",
          create(RefusedSchema, {
            transferId: "",
            code: "ERR_MALFORMED",
            message: "an empty frame: EngineToSidecar has no message set",
          }),
        ),
        true,
      );
      return;
    }
    if (this.owner !== undefined && from.id === this.owner.id && !this.ownerUp) {
      // The owner "ended" by sending an empty frame, yet it is still here.
      this.ownerUp = true;
      this.flushHeld();
    }
    if (body.length > this.maxFrameBytes) {
      this.refuse(
        from,
        "ERR_TOO_LARGE",
        `frame of ${body.length} bytes exceeds the engine link cap of ${this.maxFrameBytes}`,
      );
      return;
    }
    let msg: EngineToSidecar;
    try {
      msg = fromBinary(EngineToSidecarSchema, body);
    } catch (err) {
      this.refuse(
        from,
        "ERR_MALFORMED",
        `not an EngineToSidecar message: ${(err as Error).message}`,
      );
      return;
    }
    if (msg.msg.case === undefined) {
      this.refuse(from, "ERR_MALFORMED", "EngineToSidecar has no message set");
      return;
    }
    if (msg.msg.case !== "register" && this.owner !== undefined && from.id !== this.owner.id) {
      // The link belongs to the owner's connection: nothing another connection says is acted on.
      const tid = (msg.msg.value as { transferId?: unknown }).transferId;
      const transferId = typeof tid === "string" && Buffer.byteLength(tid) <= 256 ? tid : "";
      this.refuse(
        from,
        "ERR_NOT_OWNER",
        `this engine link belongs to another connection (the engine whose registration was accepted); ${msg.msg.case} ignored`,
        transferId,
      );
      return;
    }
    try {
      this.onMessage(msg, from);
    } catch (err) {
      this.log.error({ err, peer: from.id, kind: msg.msg.case }, "engine message handler threw");
    }
  }

  private onConnectionEnded(peer: EnginePeer): void {
    try {
      this.onEnded?.(peer);
    } catch (err) {
      this.log.error({ err }, "onConnectionEnded failed");
    }
    if (this.owner === undefined || peer.id !== this.owner.id) {
      this.log.debug({ peer: peer.id }, "engine link connection ended");
      return;
    }
    this.ownerUp = false;
    this.log.warn(
      { peer: peer.id },
      "the engine's connection ended; messages for it are held until it reconnects and registers",
    );
  }

  private refuse(to: EnginePeer, code: string, message: string, transferId = ""): void {
    this.log.warn({ peer: to.id, code, reason: message }, "engine frame refused");
    this.onRefused?.(code, message);
    void this.send(
      to,
      sidecarMessage("refused", create(RefusedSchema, { transferId, code, message })),
    );
  }

  /**
   * Sends one message to one engine. Resolves true once queued; false (logged, never thrown)
   * when the engine is gone, its queue is full, or the link is closed.
   */
  async send(to: EnginePeer, msg: SidecarToEngine, quietIfGone = false): Promise<boolean> {
    return (await this.trySend(to, msg, quietIfGone)) === "sent";
  }

  /** `send`, telling an engine that is gone (EHOSTUNREACH) from other failures. */
  private async trySend(
    to: EnginePeer,
    msg: SidecarToEngine,
    quietIfGone: boolean,
  ): Promise<"sent" | "gone" | "failed"> {
    if (this.phase !== "open") return "failed";
    let body: Uint8Array;
    try {
      body = sidecarToEngineToBinary(msg);
    } catch (err) {
      this.log.error({ err, kind: msg.msg.case }, "cannot encode a message to the engine");
      return "failed";
    }
    try {
      await this.socket.send([to.routingId, body]);
      return "sent";
    } catch (err) {
      if (this.phase !== "open") return "failed";
      const code = errCode(err);
      if (quietIfGone && code === "EHOSTUNREACH") return "gone";
      if (code === "EHOSTUNREACH") {
        // Expected when an engine left (or was refused and went): one line, no stack.
        this.log.warn(
          { peer: to.id, kind: msg.msg.case },
          "the engine connection is gone; message dropped",
        );
      } else {
        this.log.error({ err, peer: to.id, kind: msg.msg.case }, "send to engine failed");
      }
      return code === "EHOSTUNREACH" ? "gone" : "failed";
    }
  }

  /**
   * `send` to the engine that owns the link; false when none does. While the owner's connection
   * is down the message is held (up to the send queue's bound) for the owner's next connection.
   */
  async sendToRegistered(msg: SidecarToEngine): Promise<boolean> {
    const to = this.owner;
    if (to === undefined) {
      this.log.warn({ kind: msg.msg.case }, "no engine has registered; message dropped");
      return false;
    }
    if (!this.ownerUp) {
      if (this.held.length >= SEND_HIGH_WATER_MARK) {
        this.log.error({ kind: msg.msg.case }, "engine gone and its held queue full; dropped");
        return false;
      }
      this.held.push(msg);
      return true;
    }
    const r = await this.trySend(to, msg, true);
    if (r === "gone" && this.owner === to && this.phase === "open") {
      // The owner's connection ended before ZeroMQ's notice reached us: hold this one too.
      this.ownerUp = false;
      this.log.warn({ peer: to.id }, "the engine's connection ended; holding its messages");
      this.held.push(msg);
      return true;
    }
    return r === "sent";
  }

  /** Idempotent; stops receiving and closes the socket (what is queued gets `LINGER_MS`). */
  async close(timeoutMs = 2000): Promise<void> {
    if (this.phase === "closed") return;
    const wasOpen = this.phase === "open";
    this.phase = "closed";
    this.socket.close();
    if (wasOpen && this.loop) await within(this.loop, timeoutMs);
    this.removeFiles();
  }
}
