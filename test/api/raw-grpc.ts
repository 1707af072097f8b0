// A gRPC client spoken by hand over node:http2, from a chosen local address (grpc-js cannot
// pick its source address): the API tests' attackers use it to open calls from many loopback
// addresses (127.0.0.x; Linux routes all 127/8 to lo). Every call and connection it opens is
// closed by `close()`.
import * as http2 from "node:http2";
import * as net from "node:net";
import * as tls from "node:tls";

import { create, toBinary } from "@bufbuild/protobuf";

import {
  AwaitTransferRequestSchema,
  WatchEventsRequestSchema,
} from "../../src/gen/kvxfer/v1/sidecar_pb.js";

/** A call's end: its gRPC status (0 OK), or -1 when the connection went before any status. */
export interface RawCall {
  /** Resolves once the first message came (a stream is open). */
  readonly firstMessage: Promise<void>;
  readonly status: Promise<number>;
  cancel(): void;
}

function frame(body: Uint8Array): Buffer {
  const b = Buffer.alloc(5 + body.length);
  b.writeUInt32BE(body.length, 1);
  Buffer.from(body).copy(b, 5);
  return b;
}

export class RawGrpc {
  private readonly calls = new Set<http2.ClientHttp2Stream>();
  readonly closed: Promise<void>;

  private constructor(private readonly session: http2.ClientHttp2Session) {
    this.closed = new Promise((r) => session.once("close", () => r()));
    session.on("error", () => undefined);
  }

  /**
   * One HTTP/2 connection to 127.0.0.1:`port` from `from`; with `creds`, over TLS presenting
   * them (mutual TLS).
   */
  static async connect(
    port: number,
    from: string,
    creds?: { cert: Buffer; key: Buffer; ca: Buffer },
  ): Promise<RawGrpc> {
    const session = http2.connect(`${creds ? "https" : "http"}://127.0.0.1:${port}`, {
      createConnection: () => {
        const sock = net.connect({ host: "127.0.0.1", port, localAddress: from });
        if (creds === undefined) return sock;
        return tls.connect({
          socket: sock,
          ...creds,
          ALPNProtocols: ["h2"],
          checkServerIdentity: () => undefined,
        });
      },
    });
    await new Promise<void>((resolve, reject) => {
      session.once("connect", () => resolve());
      session.once("error", reject);
      session.once("close", () => reject(new Error("closed before it connected")));
    });
    return new RawGrpc(session);
  }

  /** A call of `path` with one request message; the stream stays open until the server ends it. */
  call(path: string, body: Uint8Array): RawCall {
    let first!: () => void;
    const firstMessage = new Promise<void>((r) => (first = r));
    let done!: (code: number) => void;
    const status = new Promise<number>((r) => (done = r));
    let req: http2.ClientHttp2Stream;
    try {
      req = this.session.request({
        ":method": "POST",
        ":path": path,
        "content-type": "application/grpc",
        te: "trailers",
      });
    } catch {
      done(-1);
      return { firstMessage, status, cancel: () => undefined };
    }
    this.calls.add(req);
    const statusOf = (h: http2.IncomingHttpHeaders): void => {
      const s = h["grpc-status"];
      if (s !== undefined) done(Number(s));
    };
    req.on("response", statusOf);
    req.on("trailers", statusOf);
    req.on("data", () => first());
    req.on("error", () => done(-1));
    req.on("close", () => {
      this.calls.delete(req);
      done(-1);
    });
    req.end(frame(body));
    return { firstMessage, status, cancel: () => req.close(http2.constants.NGHTTP2_CANCEL) };
  }

  watch(): RawCall {
    return this.call(
      "/kvxfer.v1.Sidecar/WatchEvents",
      toBinary(WatchEventsRequestSchema, create(WatchEventsRequestSchema, { liveOnly: true })),
    );
  }

  await(transferId: string): RawCall {
    return this.call(
      "/kvxfer.v1.Sidecar/AwaitTransfer",
      toBinary(AwaitTransferRequestSchema, create(AwaitTransferRequestSchema, { transferId })),
    );
  }

  close(): void {
    for (const c of this.calls) c.close(http2.constants.NGHTTP2_CANCEL);
    this.session.destroy();
  }
}
