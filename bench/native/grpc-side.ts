/**
 * The sending side of `bench e2e`'s gRPC hop reference in its own process, as D's sidecar is to
 * the router: a grpc-js server with the sidecar's own WatchEvents definition and event encoder
 * that, on each stream, writes `count` KV_READY events, each after `gapMs` asleep (the idle time
 * before the sidecars' transfers), and records when it wrote each one (monoUs, the clock the
 * bench process shares on this host). Nothing else: no event log, no filter, no sidecar.
 * Driven by JSON lines (serve.ts); closing stdin stops the server.
 */
import * as grpc from "@grpc/grpc-js";

import {
  asServiceDefinition,
  encodeEventResponse,
  eventToProto,
  sidecarService,
} from "../../src/api/index.js";
import { KvxferError } from "../../src/errors.js";
import { monoUs } from "../../src/native/index.js";
import { serveJsonLines } from "./serve.js";

interface Request {
  id: number;
  op: string;
  [key: string]: unknown;
}

const server = new grpc.Server();
let count = 0;
let gapMs = 20;
/** seq -> when the event was handed to grpc-js (monoUs). */
const written = new Map<number, number>();
const sleep = (ms: number): Promise<void> => new Promise((r) => setTimeout(r, ms));

server.addService(asServiceDefinition({ WatchEvents: sidecarService.WatchEvents! }), {
  WatchEvents: (call: grpc.ServerWritableStream<unknown, unknown>) => {
    let cancelled = false;
    call.on("cancelled", () => (cancelled = true));
    void (async () => {
      for (let seq = 1; seq <= count && !cancelled; seq++) {
        await sleep(gapMs);
        const at = monoUs();
        // What D's sidecar writes for a transfer that is ready (its encoder, an id of the demo's length).
        call.write(
          encodeEventResponse(
            eventToProto({
              seq,
              kind: "KV_READY",
              timeMs: Date.now(),
              transferId: `req-${String(seq).padStart(6, "0")}-hop`,
              peer: "prefill-0",
              side: "decode",
              reason: "",
              bytes: 2 << 20,
              mode: "push",
            }),
          ),
        );
        written.set(seq, at);
      }
      if (!cancelled) call.end();
    })();
  },
});

async function handle(req: Request): Promise<unknown> {
  switch (req.op) {
    case "listen": {
      count = Number(req.count);
      gapMs = Number(req.gapMs);
      const port = await new Promise<number>((resolve, reject) =>
        server.bindAsync("127.0.0.1:0", grpc.ServerCredentials.createInsecure(), (err, p) =>
          err ? reject(err) : resolve(p),
        ),
      );
      return { port };
    }
    case "written":
      return { writtenUs: Object.fromEntries(written) };
    default:
      throw new KvxferError("ERR_INVALID_ARGUMENT", `unknown op '${req.op}'`);
  }
}

serveJsonLines(handle, () => server.forceShutdown());
