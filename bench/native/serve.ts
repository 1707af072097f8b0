/**
 * The serving loop of a peer process (bench/native/peer.ts, bench/peers/kvxfer-peer.ts): one
 * JSON request per stdin line, one JSON reply per request on stdout (`result` or `error` with a
 * KvxferError code); the driver closing stdin ends the process after `onEnd`.
 */
import { createInterface } from "node:readline";

import { KvxferError } from "../../src/errors.js";

export function serveJsonLines<R extends { id?: unknown }>(
  handle: (req: R) => Promise<unknown>,
  onEnd: () => void,
): void {
  const rl = createInterface({ input: process.stdin });
  rl.on("line", (line) => {
    let req: R;
    try {
      req = JSON.parse(line) as R;
    } catch {
      return;
    }
    handle(req).then(
      (result) => process.stdout.write(JSON.stringify({ id: req.id, result }) + "\n"),
      (err: unknown) => {
        const e = KvxferError.from(err);
        process.stdout.write(
          JSON.stringify({ id: req.id, error: { code: e.code, message: e.message } }) + "\n",
        );
      },
    );
  });
  // The driver going away ends the peer.
  rl.on("close", () => {
    onEnd();
    process.exit(0);
  });
}
