/**
 * The first thing a newcomer runs: two processes, each with a UCX agent and a
 * registered region; one writes its region into the other's and reads it
 * back, and both hashes are compared.
 */
import { PeerProcess, type PeerXfer, connectPeers } from "./peer-client.js";

export interface NativeDemoSummary {
  verified: boolean;
  bytes: number;
  transports: string;
  write: { ms: number; gbps: number };
  read: { ms: number; gbps: number };
}

export async function runNativeDemo(opts: {
  size: number;
  transports?: string;
  log?: ((line: string) => void) | undefined;
}): Promise<NativeDemoSummary> {
  const transports = opts.transports ?? "shm,self";
  const log = opts.log ?? ((): void => {});
  const size = opts.size;
  const p = new PeerProcess();
  const d = new PeerProcess();
  try {
    const { pids } = await connectPeers(p, d, ["prefill", "decode"], { transports }, size);
    log(`started agents: prefill pid ${pids[0]}, decode pid ${pids[1]} (UCX_TLS=${transports})`);
    const whole = Buffer.from(new Float64Array([0, 0, size]).buffer).toString("base64");
    const hash = async (peer: PeerProcess): Promise<string> =>
      (await peer.call<{ sha256: string }>("hash")).sha256;

    const w = await p.call<PeerXfer>("write", { descs: whole });
    if (w.failed) throw new Error(`write failed: ${w.failed.code} ${w.failed.message}`);
    const writeOk = (await hash(p)) === (await hash(d));
    log(
      `WRITE prefill -> decode: ${size} bytes in ${w.ms.toFixed(1)} ms, sha256 ${writeOk ? "matches" : "DIFFERS"}`,
    );

    await d.call("fill", { seed: 3 });
    const r = await p.call<PeerXfer>("read", { descs: whole });
    if (r.failed) throw new Error(`read failed: ${r.failed.code} ${r.failed.message}`);
    const readOk = (await hash(p)) === (await hash(d));
    log(
      `READ  decode -> prefill: ${size} bytes in ${r.ms.toFixed(1)} ms, sha256 ${readOk ? "matches" : "DIFFERS"}`,
    );
    const verified = writeOk && readOk;
    log(verified ? "verified: every byte matched" : "NOT verified: bytes differ");
    return {
      verified,
      bytes: 2 * size,
      transports,
      write: { ms: w.ms, gbps: size / (w.ms * 1e6) },
      read: { ms: r.ms, gbps: size / (r.ms * 1e6) },
    };
  } finally {
    await p.close();
    await d.close();
  }
}
