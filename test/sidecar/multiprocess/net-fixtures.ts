// P and D sidecars on two "hosts" of a FaultNet (bench/net/faults.ts): each sidecar in its own
// network namespace, its side channel and UCX (TCP, error mode peer, mutual TLS) on the data link
// the faults act on, its gRPC on the management link this process reaches. The simulated engines
// run here and talk to their sidecars over ipc:// sockets (files: any namespace reaches them).
import type { FaultNet } from "../../../bench/net/faults.js";
import type { SimEngineOptions } from "../../../sim/engine-client.js";
import type { TransferMode } from "../../../src/sidecar/view.js";
import { KvNode, pairOf, type Pair } from "./fixtures.js";

/** Llama 3 8B's KV head shape, 2 layers, block 16: 8 KiB per token, 128 KiB per block. */
export const NET_ENGINE: Partial<SimEngineOptions> = {
  model: "llama3-8b",
  layers: 2,
  kvHeads: 8,
  headDim: 128,
  block: 16,
  blocks: 320,
  tp: 1,
};

export const BYTES_PER_TOKEN = 2 * 2 * 8 * 128 * 2;

export interface NetPairOptions {
  mode?: TransferMode;
  sidecarArgs?: string[];
  engine?: Partial<SimEngineOptions>;
}

/** P on net's host "p", D on host "d". */
export async function startNetPair(net: FaultNet, o: NetPairOptions = {}): Promise<Pair> {
  const start = (role: "prefill" | "decode"): Promise<KvNode> => {
    const h = net.hosts[role === "prefill" ? "p" : "d"];
    return KvNode.start({
      role,
      mode: o.mode ?? "auto",
      listen: `${h.address}:0`,
      transports: "tcp,self",
      prefix: h.prefix,
      sidecarArgs: [
        "--grpc",
        `${h.mgmtAddress}:0`,
        "--net-devices",
        h.dev,
        "--error-mode",
        "peer",
        ...(o.sidecarArgs ?? []),
      ],
      engine: { ...NET_ENGINE, ...o.engine },
    });
  };
  const [p, d] = await Promise.allSettled([start("prefill"), start("decode")]);
  return pairOf(p, d);
}

export interface Outcome {
  transferId: string;
  /** verified: D's engine checked every byte; failed: D's engine got KvFailed (reason). */
  outcome: "verified" | "mismatch" | "failed" | "timeout";
  reason?: string;
  message?: string;
  /** From the request to D's engine's verdict. */
  ms: number;
}

/**
 * One transfer as a router makes it, push (P and D at once) or pull (P first, then D with P's
 * block ids); resolves with what D's engine saw, never rejects, bounded by `timeoutMs`.
 */
export async function attempt(
  pair: Pair,
  transferId: string,
  o: { tokens: number; pull: boolean; timeoutMs: number },
): Promise<Outcome> {
  const { p, d } = pair;
  const t0 = Date.now();
  const token = `tok-${transferId}`;
  const verdict = d.engine.waitEvent(
    (e) => e.transferId === transferId && (e.event === "verified" || e.event === "failed"),
    o.timeoutMs,
  );
  verdict.catch(() => undefined);
  try {
    if (o.pull) {
      const { blockIds } = await p.engine.prefill(transferId, o.tokens, 0, o.timeoutMs, token);
      await d.engine.expect(
        { transferId, tokens: o.tokens, source: p.sideChannel, sourceBlockIds: blockIds, token },
        o.timeoutMs,
      );
    } else {
      await Promise.all([
        p.engine.prefill(transferId, o.tokens, 0, o.timeoutMs, token),
        d.engine.expect(
          { transferId, tokens: o.tokens, source: p.sideChannel, token },
          o.timeoutMs,
        ),
      ]);
    }
    const ev = await verdict;
    const ms = Date.now() - t0;
    if (ev.event === "verified")
      return { transferId, outcome: ev.ok === true ? "verified" : "mismatch", ms };
    return {
      transferId,
      outcome: "failed",
      reason: String(ev.reason),
      message: String(ev.message ?? ""),
      ms,
    };
  } catch (err) {
    return { transferId, outcome: "timeout", message: String(err), ms: Date.now() - t0 };
  }
}
