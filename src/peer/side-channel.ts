/**
 * The handshake side channel: a sidecar listens on TCP; a peer connects, sends
 * one HandshakeRequest and waits (with a deadline) for one HandshakeResponse.
 * Each message is a 4-byte big-endian length and the protobuf bytes; the length
 * is checked before anything is buffered.
 *
 * With peer credentials (a certificate whose subject CN is the sidecar's engine
 * id, its key, and the cluster's CA), the connection is mutual TLS 1.3 and each
 * side learns the other's engine id from its certificate: the caller checks
 * that the metadata claims the same id. Without credentials the channel is
 * plain TCP and proves nothing (docs/security.md).
 */
import { X509Certificate } from "node:crypto";
import * as net from "node:net";
import * as tls from "node:tls";

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import type { Logger } from "pino";

import {
  HandshakeRequestSchema,
  HandshakeResponseSchema,
  type HandshakeRequest,
  type HandshakeResponse,
} from "../gen/kvxfer/v1/peer_pb.js";
import { KvxferError } from "../errors.js";
import { ConnectionSlots } from "./connection-slots.js";

/** Largest handshake frame accepted (metadata of 8 ranks with many regions fits easily). */
export const MAX_HANDSHAKE_BYTES = 4 << 20;
/**
 * Connections that have not authenticated yet, held at once (all sources together). Past it a
 * newcomer takes the place of the oldest one of the largest address group (ConnectionSlots):
 * nobody is refused at accept, and an attacker loses its own connections first.
 */
export const OPENING_HANDSHAKES = 128;
/** Authenticated connections (TLS finished) waiting for their request, held at once. */
export const AUTHENTICATED_HANDSHAKES = 256;
/** Authenticated connections of one engine identity at once: its own oldest makes room. */
export const HANDSHAKES_PER_IDENTITY = 4;
/**
 * A connection must have sent a complete first TLS record (its ClientHello; without TLS, the
 * request's 4-byte length) this long after accept, or it is closed: a real peer sends it in its
 * first round trip, so what sends nothing useful holds a slot for at most this long.
 */
export const HELLO_DEADLINE_MS = 2_000;
/** The TLS handshake must have finished (without TLS: the whole request arrived) by then. */
export const AUTH_DEADLINE_MS = 5_000;
/** After TLS, the request must arrive within this long. */
export const REQUEST_DEADLINE_MS = 2_000;
/**
 * Every connection is closed this long after it was accepted, whatever it sent or sends (TLS,
 * the request, our answer): a hard deadline, not an idle timer (one byte every few seconds
 * keeps nothing open), and a destroy, not Node's handshakeTimeout (which only reports).
 */
export const HANDSHAKE_DEADLINE_MS = 10_000;
/** Largest first TLS record accepted as a ClientHello (2^14 bytes of plaintext, and some). */
const MAX_HELLO_RECORD = (1 << 14) + 2048;

/** The sidecar's credentials for its peers (PEM). */
export interface PeerCredentials {
  readonly cert: Buffer;
  readonly key: Buffer;
  readonly ca: Buffer;
}

/**
 * Who is at the other end: the engine id in its verified certificate, or
 * undefined on an unauthenticated channel.
 */
export type PeerIdentity = string | undefined;

export type HandshakeHandler = (req: HandshakeRequest, peer: PeerIdentity) => HandshakeResponse;

/** "host:port" (or "tcp://host:port") → host and port. */
export function parseAddress(address: string): { host: string; port: number } {
  const bare = address.replace(/^tcp:\/\//, "");
  const m = /^(.*):(\d+)$/.exec(bare);
  if (m === null || m[1] === "" || Number(m[2]) > 65535) {
    throw new KvxferError(
      "ERR_BAD_ADDRESS",
      `side channel address must be host:port, got '${address}'`,
    );
  }
  return { host: m[1]!.replace(/^\[(.*)\]$/, "$1"), port: Number(m[2]) };
}

/** True for an address only this machine can reach (loopback). */
export function isLoopback(host: string): boolean {
  return host === "localhost" || host === "::1" || /^127\./.test(host);
}

/** The engine id a certificate names: its subject CN. */
export function certificateIdentity(cert: tls.PeerCertificate | X509Certificate): string {
  if (cert instanceof X509Certificate) {
    const m = /(?:^|\n)CN=([^\n]*)/.exec(cert.subject);
    return m?.[1] ?? "";
  }
  const cn = cert.subject?.CN;
  return Array.isArray(cn) ? (cn[0] ?? "") : (cn ?? "");
}

/**
 * The client's TLS context for `creds` (TLS 1.3 at least), built once, by the start-up check,
 * and used by every dial: `tls.connect({cert, key, ca})` parsed the PEM files again at each one,
 * and a decode sidecar dials a quiet peer before a transfer (measured: most of a 25-90 ms
 * handshake at 4096-token prompts; journal/vllm.md). The server keeps its own options: given
 * this context instead, it failed every mutual-TLS handshake (alert 40).
 */
const peerContexts = new WeakMap<PeerCredentials, tls.SecureContext>();
function peerContext(creds: PeerCredentials): tls.SecureContext {
  let ctx = peerContexts.get(creds);
  if (ctx === undefined) {
    ctx = tls.createSecureContext({
      cert: creds.cert,
      key: creds.key,
      ca: creds.ca,
      minVersion: "TLSv1.3",
    });
    peerContexts.set(creds, ctx);
  }
  return ctx;
}

/**
 * Checks credentials at start-up: every file parses, the certificate is signed
 * by the CA and names `engineId`. Throws ERR_CONFIG naming what is wrong.
 */
export function checkCredentials(creds: PeerCredentials, engineId: string): void {
  let cert: X509Certificate;
  try {
    cert = new X509Certificate(creds.cert);
  } catch (err) {
    throw new KvxferError("ERR_CONFIG", `--peer-cert is not a PEM certificate: ${String(err)}`);
  }
  const cas = pemBlocks(creds.ca).map((pem, i) => {
    try {
      return new X509Certificate(pem);
    } catch (err) {
      throw new KvxferError(
        "ERR_CONFIG",
        `--peer-ca certificate ${i + 1} does not parse: ${String(err)}`,
      );
    }
  });
  if (cas.length === 0) throw new KvxferError("ERR_CONFIG", "--peer-ca holds no PEM certificate");
  if (!cas.some((ca) => cert.checkIssued(ca) && cert.verify(ca.publicKey))) {
    throw new KvxferError(
      "ERR_CONFIG",
      "--peer-cert is not signed by any certificate in --peer-ca",
    );
  }
  const id = certificateIdentity(cert);
  if (id !== engineId) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--peer-cert names '${id}' (subject CN) but this sidecar's engine id is '${engineId}'`,
    );
  }
  const when = validityProblem(cert, "--peer-cert");
  if (when !== undefined) throw new KvxferError("ERR_CONFIG", when);
  try {
    peerContext(creds);
  } catch (err) {
    throw new KvxferError(
      "ERR_CONFIG",
      `--peer-key does not go with --peer-cert: ${(err as Error).message}`,
    );
  }
}

/**
 * Why a certificate of ours cannot be used now (not yet valid, or expired), naming its dates;
 * undefined when `nowMs` lies within them. Peers would refuse it anyway, one handshake at a time.
 */
export function validityProblem(
  cert: X509Certificate,
  flag: string,
  nowMs = Date.now(),
): string | undefined {
  const from = Date.parse(cert.validFrom);
  const to = Date.parse(cert.validTo);
  const dates = `valid from ${cert.validFrom} to ${cert.validTo}, now ${new Date(nowMs).toUTCString()}`;
  if (nowMs < from) return `${flag} is not valid yet (${dates})`;
  if (nowMs > to) return `${flag} has expired (${dates})`;
  return undefined;
}

export function pemBlocks(pem: Buffer): string[] {
  return (
    pem.toString("utf8").match(/-----BEGIN CERTIFICATE-----[\s\S]*?-----END CERTIFICATE-----/g) ??
    []
  );
}

/** Reads framed messages off a stream: one length, one body; refuses a length over `max`. */
class FrameReader {
  private chunks: Buffer[] = [];
  private have = 0;
  private want = -1;

  constructor(private readonly max: number) {}

  /** Adds bytes; returns a complete body, "too-large", or undefined (need more). */
  push(data: Buffer): Buffer | "too-large" | undefined {
    this.chunks.push(data);
    this.have += data.length;
    if (this.want < 0 && this.have >= 4) {
      const all = Buffer.concat(this.chunks);
      this.chunks = [all];
      this.want = all.readUInt32BE(0);
      if (this.want > this.max) return "too-large";
    }
    if (this.want >= 0 && this.have >= 4 + this.want) {
      const all = Buffer.concat(this.chunks);
      return all.subarray(4, 4 + this.want);
    }
    return undefined;
  }

  /** Length announced so far (-1 before the header). */
  get announced(): number {
    return this.want;
  }
}

function frame(body: Uint8Array): Buffer {
  const head = Buffer.alloc(4);
  head.writeUInt32BE(body.length, 0);
  return Buffer.concat([head, body]);
}

/** Where the side channel's deadlines and pools differ from the defaults (tests). */
export interface SideChannelLimits {
  readonly opening: number;
  readonly authenticated: number;
  readonly perIdentity: number;
  readonly helloMs: number;
  readonly authMs: number;
  readonly requestMs: number;
  readonly deadlineMs: number;
}

export class SideChannelServer {
  private server: net.Server | undefined;
  /** With credentials: TLS over the connections it is handed (never listens itself). */
  private tlsServer: tls.Server | undefined;
  /** Accepted connections (the TCP socket under TLS), each holding one slot until it closes. */
  private readonly slots: ConnectionSlots;
  private readonly limits: SideChannelLimits;
  /** TCP connections handed to TLS, by their remote address and port, until TLS finishes. */
  private readonly inTls = new Map<string, net.Socket>();
  private closed = false;
  /** "host:port" actually bound (port 0 resolved). */
  address = "";

  constructor(
    private readonly handler: HandshakeHandler,
    private readonly log: Logger,
    /** Told about connections refused before they reach the handler (malformed, too large, TLS). */
    private readonly onRefused?: (code: string, message: string) => void,
    private readonly creds?: PeerCredentials,
    limits: Partial<SideChannelLimits> = {},
  ) {
    this.limits = {
      opening: limits.opening ?? OPENING_HANDSHAKES,
      authenticated: limits.authenticated ?? AUTHENTICATED_HANDSHAKES,
      perIdentity: limits.perIdentity ?? HANDSHAKES_PER_IDENTITY,
      helloMs: limits.helloMs ?? HELLO_DEADLINE_MS,
      authMs: limits.authMs ?? AUTH_DEADLINE_MS,
      requestMs: limits.requestMs ?? REQUEST_DEADLINE_MS,
      deadlineMs: limits.deadlineMs ?? HANDSHAKE_DEADLINE_MS,
    };
    this.slots = new ConnectionSlots(
      {
        opening: this.limits.opening,
        established: this.limits.authenticated,
        perGroup: this.limits.perIdentity,
        establishMs: this.limits.authMs,
        deadlineMs: this.limits.deadlineMs,
      },
      (code, message) => {
        if (!this.closed) this.onRefused?.(code, `side channel: ${message}`);
      },
    );
  }

  /** Connections holding a slot now (tests, status). */
  get inFlight(): number {
    return this.slots.inFlight;
  }

  /** Connections holding an opening slot, and an authenticated one (tests). */
  get slotCounts(): { opening: number; authenticated: number } {
    return { opening: this.slots.openingCount, authenticated: this.slots.establishedCount };
  }

  get authenticated(): boolean {
    return this.creds !== undefined;
  }

  async bind(address: string): Promise<string> {
    const { host, port } = parseAddress(address);
    const creds = this.creds;
    if (creds !== undefined) {
      const tlsServer = tls.createServer(
        {
          cert: creds.cert,
          key: creds.key,
          ca: creds.ca,
          requestCert: true,
          rejectUnauthorized: true,
          minVersion: "TLSv1.3",
          handshakeTimeout: this.limits.authMs,
        },
        (socket) => this.onSecure(socket),
      );
      tlsServer.on("tlsClientError", (err: Error) => {
        // A peer without this cluster's credentials, or not speaking TLS at all.
        this.onRefused?.("ERR_UNAUTHENTICATED", `TLS handshake failed: ${err.message}`);
      });
      this.tlsServer = tlsServer;
    }
    // Every TCP connection takes an opening slot at accept (under TLS too: before any TLS byte).
    const server = net.createServer((socket: net.Socket) => {
      if (this.closed) {
        socket.destroy();
        return;
      }
      this.slots.admit(socket);
      if (creds === undefined) this.serve(socket);
      else this.awaitHello(socket);
    });
    this.server = server;
    await new Promise<void>((resolve, reject) => {
      server.once("error", reject);
      server.listen(port, host, () => {
        server.off("error", reject);
        resolve();
      });
    });
    server.on("error", (err) => this.log.error({ err }, "side channel: server error"));
    const a = server.address() as net.AddressInfo;
    this.address = `${a.family === "IPv6" ? `[${a.address}]` : a.address}:${a.port}`;
    return this.address;
  }

  /**
   * Reads the connection's first TLS record (its ClientHello) before TLS starts: a connection
   * that has not sent it whole within helloMs is closed; one that sends something else is
   * closed at once. Then TLS takes the connection with the bytes read (unshifted).
   */
  private awaitHello(socket: net.Socket): void {
    let buf: Buffer = Buffer.alloc(0);
    const timer = setTimeout(() => socket.destroy(), this.limits.helloMs);
    timer.unref();
    const refuse = (why: string): void => {
      clearTimeout(timer);
      socket.destroy();
      this.onRefused?.(
        "ERR_UNAUTHENTICATED",
        `TLS handshake failed: ${why} from ${socket.remoteAddress}`,
      );
    };
    const onData = (data: Buffer): void => {
      buf = buf.length === 0 ? data : Buffer.concat([buf, data]);
      if (buf[0] !== 0x16) return refuse("the first record is not a TLS handshake");
      if (buf.length < 5) return;
      const want = 5 + buf.readUInt16BE(3);
      if (want > MAX_HELLO_RECORD) return refuse(`a first TLS record of ${want} bytes`);
      if (buf.length < want) return;
      clearTimeout(timer);
      socket.off("data", onData);
      socket.pause();
      socket.unshift(buf);
      if (this.closed || socket.destroyed) return void socket.destroy();
      const key = `${socket.remoteAddress}|${socket.remotePort}`;
      this.inTls.set(key, socket);
      socket.once("close", () => {
        if (this.inTls.get(key) === socket) this.inTls.delete(key);
      });
      this.tlsServer!.emit("connection", socket);
    };
    socket.on("data", onData);
  }

  /** TLS finished: the connection takes an authenticated slot under its engine id, then serves. */
  private onSecure(socket: tls.TLSSocket): void {
    const key = `${socket.remoteAddress}|${socket.remotePort}`;
    const raw = this.inTls.get(key);
    this.inTls.delete(key);
    const identity = certificateIdentity(socket.getPeerCertificate());
    if (raw === undefined || this.closed || !this.slots.establish(raw, `id:${identity}`)) {
      socket.destroy();
      return;
    }
    const timer = setTimeout(() => socket.destroy(), this.limits.requestMs);
    timer.unref();
    socket.once("close", () => clearTimeout(timer));
    this.serve(socket, () => clearTimeout(timer));
  }

  private serve(socket: net.Socket, requestRead?: () => void): void {
    if (this.closed) {
      socket.destroy();
      return;
    }
    socket.on("error", () => socket.destroy());
    let identity: PeerIdentity;
    if (socket instanceof tls.TLSSocket) {
      identity = certificateIdentity(socket.getPeerCertificate());
      if (identity === "") {
        this.reply(socket, refusal("ERR_UNAUTHENTICATED", "client certificate names no engine"));
        return;
      }
    } else {
      // Without TLS: the request's length must come within helloMs (AUTH_DEADLINE_MS bounds
      // the whole request: the slot's establish deadline, as such a connection never
      // establishes itself).
      const hello = setTimeout(() => {
        if (socket.bytesRead < 4) socket.destroy();
      }, this.limits.helloMs);
      hello.unref();
      socket.once("close", () => clearTimeout(hello));
    }
    const reader = new FrameReader(MAX_HANDSHAKE_BYTES);
    let answered = false;
    socket.on("data", (data: Buffer) => {
      if (answered) return;
      const body = reader.push(data);
      if (body === undefined) return;
      answered = true;
      requestRead?.();
      socket.pause();
      if (body === "too-large") {
        this.reply(
          socket,
          refusal(
            "ERR_TOO_LARGE",
            `handshake of ${reader.announced} bytes exceeds ${MAX_HANDSHAKE_BYTES}`,
          ),
          true,
        );
        return;
      }
      let req: HandshakeRequest;
      try {
        req = fromBinary(HandshakeRequestSchema, body);
      } catch (err) {
        this.reply(
          socket,
          refusal("ERR_MALFORMED", `not a HandshakeRequest: ${(err as Error).message}`),
          true,
        );
        return;
      }
      let response: HandshakeResponse;
      try {
        response = this.handler(req, identity);
      } catch (err) {
        const e = KvxferError.from(err);
        response = refusal(e.code, e.message);
      }
      this.reply(socket, response);
    });
  }

  private reply(socket: net.Socket, response: HandshakeResponse, refusedEarly = false): void {
    if (refusedEarly) this.onRefused?.(response.errorCode, response.error);
    socket.end(frame(toBinary(HandshakeResponseSchema, response)));
  }

  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    this.slots.destroyAll();
    const server = this.server;
    if (server !== undefined) await new Promise<void>((resolve) => server.close(() => resolve()));
  }
}

export function refusal(code: string, message: string): HandshakeResponse {
  return create(HandshakeResponseSchema, { errorCode: code, error: message });
}

/** Handshake failures where the connection was cut before any answer (see `wasCut`). */
const cuts = new WeakSet<Error>();

/**
 * True when `err` is a handshake whose connection was closed or reset before any answer came:
 * the side channel may have displaced it to make room, and another try may get through (a
 * refused connection, a refusal or a failed TLS handshake is not one).
 */
export function wasCut(err: unknown): boolean {
  return err instanceof Error && cuts.has(err);
}

/** A handshake answer and who gave it (the engine id in its certificate, if authenticated). */
export interface HandshakeResult {
  readonly response: HandshakeResponse;
  readonly peer: PeerIdentity;
}

/**
 * One handshake with the sidecar at `address`; rejects with a KvxferError after
 * `timeoutMs`. With credentials the server must present a certificate from the
 * same CA (ERR_UNAUTHENTICATED otherwise).
 */
export async function handshake(
  address: string,
  req: HandshakeRequest,
  timeoutMs: number,
  creds?: PeerCredentials,
): Promise<HandshakeResult> {
  const { host, port } = parseAddress(address);
  return new Promise<HandshakeResult>((resolve, reject) => {
    let done = false;
    const finish = (err: KvxferError | undefined, result?: HandshakeResult): void => {
      if (done) return;
      done = true;
      clearTimeout(timer);
      socket.destroy();
      if (err !== undefined) reject(err);
      else resolve(result!);
    };
    const socket: net.Socket =
      creds === undefined
        ? net.connect({ host, port })
        : tls.connect({
            host,
            port,
            secureContext: peerContext(creds),
            // Not a host name check: the peer's identity is its engine id, which the caller
            // compares with the metadata it sends.
            checkServerIdentity: () => undefined,
            ...(net.isIP(host) === 0 ? { servername: host } : {}),
          });
    const timer = setTimeout(
      () =>
        finish(
          new KvxferError(
            "ERR_UNREACHABLE",
            `no handshake answer from ${address} within ${timeoutMs} ms`,
          ),
        ),
      timeoutMs,
    );
    const reader = new FrameReader(MAX_HANDSHAKE_BYTES);
    socket.once(creds === undefined ? "connect" : "secureConnect", () => {
      socket.write(frame(toBinary(HandshakeRequestSchema, req)));
    });
    socket.on("data", (data: Buffer) => {
      const body = reader.push(data);
      if (body === undefined) return;
      if (body === "too-large") {
        finish(new KvxferError("ERR_MALFORMED", `handshake answer from ${address} is too large`));
        return;
      }
      let response: HandshakeResponse;
      try {
        response = fromBinary(HandshakeResponseSchema, body);
      } catch (err) {
        finish(
          new KvxferError(
            "ERR_MALFORMED",
            `handshake answer from ${address} is not a HandshakeResponse`,
            { cause: err },
          ),
        );
        return;
      }
      const peer =
        socket instanceof tls.TLSSocket
          ? certificateIdentity(socket.getPeerCertificate())
          : undefined;
      finish(undefined, { response, peer });
    });
    socket.on("error", (err: Error) => {
      const tlsFailure =
        creds !== undefined &&
        /certificate|alert|handshake|SSL|TLS|self.signed|unable to verify/i.test(err.message);
      const e = new KvxferError(
        tlsFailure ? "ERR_UNAUTHENTICATED" : "ERR_UNREACHABLE",
        tlsFailure
          ? `side channel ${address} refused mutual TLS: ${err.message}`
          : `side channel ${address}: ${err.message}`,
        { cause: err },
      );
      const errno = (err as NodeJS.ErrnoException).code;
      if (!tlsFailure && (errno === "ECONNRESET" || errno === "EPIPE")) cuts.add(e);
      finish(e);
    });
    socket.on("close", () => {
      const e = new KvxferError("ERR_UNREACHABLE", `side channel ${address} closed with no answer`);
      cuts.add(e);
      finish(e);
    });
  });
}
