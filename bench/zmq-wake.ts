// What one ZeroMQ send costs the sending thread on this machine, back to back and after the
// socket was idle for a while (libzmq's I/O thread asleep: the send wakes it). The sidecar's
// engine link sends every KvReady / ReleaseBlocks this way (ROUTER over ipc, 64-byte frame).
//   node dist/bench/zmq-wake.js [--n N]
import { performance } from "node:perf_hooks";
import { rmSync } from "node:fs";
import { pathToFileURL } from "node:url";
import { Dealer, Router } from "zeromq";

import { stats } from "./report.js";

export async function measure(n: number): Promise<{ label: string; p50: number; p90: number }[]> {
  const path = `/tmp/kvxfer-zmq-wake-${process.pid}.sock`;
  const router = new Router();
  const dealer = new Dealer({ routingId: "engine" });
  try {
    await router.bind(`ipc://${path}`);
    dealer.connect(`ipc://${path}`);
    await dealer.send("hello");
    const [id] = await router.receive();
    const drain = (async () => {
      for await (const _ of dealer) void _;
    })();
    const body = Buffer.alloc(64);
    const run = async (label: string, gapMs: number, count: number) => {
      const us: number[] = [];
      for (let i = 0; i < count; i++) {
        if (gapMs > 0) await new Promise((r) => setTimeout(r, gapMs));
        const t0 = performance.now();
        await router.send([id!, body]);
        us.push((performance.now() - t0) * 1000);
      }
      const s = stats(us);
      const sorted = [...us].sort((a, b) => a - b);
      return { label, p50: s.p50, p90: sorted[Math.floor(0.9 * (sorted.length - 1))]! };
    };
    const rows = [
      await run("back to back", 0, n),
      await run("after 1 ms idle", 1, Math.ceil(n / 5)),
      await run("back to back, again", 0, n),
    ];
    dealer.close();
    await drain;
    return rows;
  } finally {
    router.close();
    dealer.close();
    rmSync(path, { force: true });
  }
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? "").href) {
  const at = process.argv.indexOf("--n");
  const n = at >= 0 ? Number(process.argv[at + 1]) : 5000;
  for (const r of await measure(n))
    console.log(`${r.label.padEnd(20)} p50 ${r.p50.toFixed(1)} µs  p90 ${r.p90.toFixed(1)} µs`);
}
