/**
 * The demo's run (`runDemo`): starts sidecars and simulated engines as
 * separate processes (demo-node.ts), runs a workload through a simulated
 * router, and summarises it (demo-types.ts). `kvxfer demo` (demo-command.ts),
 * the tests and the benchmarks drive the same code.
 */
import { randomBytes } from "node:crypto";
import { performance } from "node:perf_hooks";

import { SidecarClient, type ResumableWatch } from "../src/api/index.js";
import { dataPhase, type SidecarEvent } from "../src/sidecar/index.js";
import { SimEngineProcess } from "./engine-client.js";
import { SidecarProcess } from "./sidecar-process.js";
import {
  type DemoOptions,
  type DemoRequestRecord,
  type DemoSummary,
  dBytesPerToken,
  percentile,
  type SidecarSummary,
} from "./demo-types.js";
import { type Node, startNode, TCP_NO_SEGMENTS } from "./demo-node.js";

/**
 * kvxfer's data phase per transfer, from the sidecars' traces: on the moving side (P for a push,
 * D for a pull), the first operation handed to the addon -> the last one flushed.
 */
async function readDataPhase(
  nodes: readonly Node[],
  bytesOf: ReadonlyMap<string, number>,
): Promise<DemoSummary["dataPhase"]> {
  const times: number[] = [];
  let bytes = 0;
  for (const n of nodes) {
    if (n.ready.grpc === undefined) continue;
    const client = new SidecarClient(n.ready.grpc);
    try {
      await client.connect(5_000);
      const { transfers } = await client.listTransfers({ limit: 10_000 });
      for (const t of transfers) {
        const moving = t.mode === "push" ? "prefill" : "decode";
        const b = bytesOf.get(t.transferId);
        if (t.side !== moving || b === undefined || b === 0) continue;
        const data = dataPhase(t.trace);
        if (data === undefined) continue;
        times.push((data.endUs - data.startUs) / 1000);
        bytes += b;
      }
    } catch {
      // A sidecar that cannot be read leaves its transfers out of the figure.
    } finally {
      client.close();
    }
  }
  if (times.length === 0) return undefined;
  const total = times.reduce((a, x) => a + x, 0);
  times.sort((a, b) => a - b);
  return {
    transfers: times.length,
    bytes,
    p50Ms: percentile(times, 50),
    gbps: total > 0 ? bytes / (total * 1e6) : 0,
  };
}

export async function runDemo(o: DemoOptions): Promise<DemoSummary> {
  if (o.transport === "tcp" && o.kvMemory === "segment") throw new Error(TCP_NO_SEGMENTS);
  const log = o.log ?? ((): void => {});
  const tag = `${process.pid}-${Date.now().toString(36)}`;
  const maxTokens = Math.max(...o.promptTokens);
  const blocksFor = (block: number): number =>
    o.blocks ?? Math.max(64, 2 * o.concurrency * Math.ceil(maxTokens / block) + 8);
  const nodes: Node[] = [];
  const sidecars: SidecarProcess[] = [];
  const engines: SimEngineProcess[] = [];
  const t0 = Date.now();
  const clients: SidecarClient[] = [];
  const watches: ResumableWatch[] = [];
  // The router learns "KV ready" from D's sidecars over gRPC (WatchEvents), one event per transfer.
  const terminal = new Map<string, SidecarEvent>();
  const waiting = new Map<string, (ev: SidecarEvent) => void>();
  const onTerminal = (ev: SidecarEvent): void => {
    if (ev.side !== "decode" || terminal.has(ev.transferId)) return;
    terminal.set(ev.transferId, ev);
    waiting.get(ev.transferId)?.(ev);
  };
  // One abort listener for every wait (not one per transfer in flight: past 10, Node warns of a
  // leak); each wait leaves `stoppers` when it ends.
  const stoppers = new Set<() => void>();
  const onAbort = (): void => {
    for (const stop of [...stoppers]) stop();
  };
  o.signal?.addEventListener("abort", onAbort, { once: true });
  const awaitTerminal = (transferId: string, timeoutMs: number): Promise<SidecarEvent> => {
    const seen = terminal.get(transferId);
    if (seen !== undefined) return Promise.resolve(seen);
    // Stopped already (Ctrl-C): the abort event has fired and would not fire again.
    if (o.signal?.aborted === true) return Promise.reject(new Error(`${transferId}: interrupted`));
    return new Promise((resolve, reject) => {
      const stop = (): void => {
        clearTimeout(timer);
        waiting.delete(transferId);
        stoppers.delete(stop);
        reject(new Error(`${transferId}: interrupted`));
      };
      const timer = setTimeout(() => {
        waiting.delete(transferId);
        stoppers.delete(stop);
        reject(
          new Error(`no terminal event for ${transferId} from D's sidecar within ${timeoutMs} ms`),
        );
      }, timeoutMs);
      // Ctrl-C reaches the sidecars too: nobody will answer, so stop waiting.
      stoppers.add(stop);
      waiting.set(transferId, (ev) => {
        clearTimeout(timer);
        waiting.delete(transferId);
        stoppers.delete(stop);
        resolve(ev);
      });
    });
  };
  try {
    const start = (role: "prefill" | "decode", i: number): Promise<Node> =>
      startNode(o, role, `${role === "prefill" ? "p" : "d"}${i}-${tag}`, {
        sidecars,
        engines,
        blocks: blocksFor(role === "prefill" ? o.pBlock : o.dBlock),
      });
    const ps = await Promise.all(Array.from({ length: o.prefill }, (_, i) => start("prefill", i)));
    const ds = await Promise.all(Array.from({ length: o.decode }, (_, i) => start("decode", i)));
    nodes.push(...ps, ...ds);
    const summaries = (): SidecarSummary[] =>
      nodes.map((n) => ({
        engineId: n.engineId,
        role: n.role,
        epoch: n.ready.epoch,
        sideChannel: n.ready.sideChannel,
        engineSocket: n.ready.engineSocket,
        ...(n.ready.grpc !== undefined ? { grpc: n.ready.grpc } : {}),
        ...(n.ready.metrics !== undefined ? { metrics: n.ready.metrics } : {}),
        ...(n.sidecar.child.pid !== undefined ? { pid: n.sidecar.child.pid } : {}),
      }));
    // Sidecars in other network namespaces serve gRPC on their own loopback, out of
    // the router's reach: there the router hears readiness from the engines alone.
    for (const d of o.hosts === undefined ? ds : []) {
      if (d.ready.grpc === undefined) continue;
      const client = new SidecarClient(d.ready.grpc);
      clients.push(client);
      watches.push(
        client.watchResumable({ kinds: ["KV_READY", "FAILED", "EXPIRED", "ABORTED"] }, onTerminal),
      );
    }
    const dLayout = ds[0]!.engine.ready!.layout;
    log(
      `started ${o.prefill} prefill (TP ${o.pTp}, block ${o.pBlock}) and ${o.decode} decode (TP ${o.dTp}, block ${o.dBlock}) engines with sidecars; ` +
        `${dLayout.numLayers} layers, ${dLayout.mla ? "MLA" : `${dLayout.totalKvHeads} KV heads`} x ${dLayout.headDim}, ${o.layout.toUpperCase()}, ${o.transport}, ` +
        `KV in ${o.kvMemory === "segment" ? "segments the sidecars allocate" : "files the engines create"}`,
    );
    for (const n of nodes) {
      log(
        `  ${n.role.padEnd(7)} ${n.engineId}: side channel ${n.ready.sideChannel}, gRPC ${n.ready.grpc ?? "-"}`,
      );
    }
    const firstD = ds[0]?.ready.grpc;
    if (firstD !== undefined) {
      log(
        `watch it live from another shell: node dist/src/cli/main.js watch ${firstD}   (or: status ${firstD})`,
      );
    }

    const latencies: number[] = [];
    const failures: string[] = [];
    let done = 0;
    let mismatches = 0;
    let checkedBytes = 0;
    const checkMs: number[] = [];
    /** Bytes moved by each verified transfer (for the data phase's GB/s). */
    const perTransferBytes = new Map<string, number>();
    const computeMsAll: number[] = [];
    let bytes = 0;
    const byMode: Record<string, number> = {};
    const perToken = dBytesPerToken(dLayout);
    const records: DemoRequestRecord[] = [];

    let prefixTokensSaved = 0;
    let prefixBytes = 0;
    let cut = 0;
    const stopped = (): boolean => o.signal?.aborted === true;
    /** The router gives up a request on one engine (its blocks come back; failures ignored). */
    const abortOn = async (n: Node, transferId: string): Promise<void> => {
      await n.engine.call("abort", { transferId }, o.requestTimeoutMs).catch(() => undefined);
    };
    const one = async (r: number): Promise<void> => {
      const p = ps[r % ps.length]!;
      const d = ds[r % ds.length]!;
      const transferId = `req-${r}-${tag}`;
      // The router binds the transfer to the D it picks: only a sidecar presenting this token gets it.
      const token = randomBytes(16).toString("hex");
      const tokens = o.promptTokens[r % o.promptTokens.length]!;
      const prefix = Math.min(o.prefixTokens, tokens - 1);
      const computeMs = o.computeMs + Math.round((o.computeMsPerToken ?? 0) * tokens);
      const rec: DemoRequestRecord = {
        transferId,
        tokens,
        computeMs,
        dispatchedMs: performance.now(),
        prefilledMs: 0,
        readyMs: 0,
        mode: "",
        ok: false,
        srcBlockIds: [],
        dstBlockIds: [],
      };
      let prefilledAt = 0;
      try {
        if (o.dispatch === "sequential" || (o.dispatch === "alternating" && r % 2 === 0)) {
          const { blockIds } = await p.engine.prefill(
            transferId,
            tokens,
            computeMs,
            o.requestTimeoutMs,
            token,
          );
          prefilledAt = Date.now();
          rec.prefilledMs = performance.now();
          rec.srcBlockIds = [...blockIds];
          const expected = await d.engine
            .expect(
              {
                transferId,
                tokens,
                prefixTokens: prefix,
                source: p.ready.sideChannel,
                sourceBlockIds: blockIds,
                token,
              },
              o.requestTimeoutMs,
            )
            .catch(async (err: unknown) => {
              await abortOn(p, transferId); // P's blocks back now, not at expiry
              throw err;
            });
          rec.dstBlockIds = [...expected.blockIds];
        } else {
          const pre = p.engine
            .prefill(transferId, tokens, computeMs, o.requestTimeoutMs, token)
            .then(({ blockIds }) => {
              prefilledAt = Date.now();
              rec.prefilledMs = performance.now();
              rec.srcBlockIds = [...blockIds];
            });
          const [prefilled, expected] = await Promise.allSettled([
            pre,
            d.engine.expect(
              { transferId, tokens, prefixTokens: prefix, source: p.ready.sideChannel, token },
              o.requestTimeoutMs,
            ),
          ]);
          // As a router does: when one side refused, the side that did take the request is
          // aborted, so that its blocks come back now instead of when the transfer expires.
          if (prefilled.status === "rejected") {
            if (expected.status === "fulfilled") await abortOn(d, transferId);
            throw prefilled.reason;
          }
          if (expected.status === "rejected") {
            await abortOn(p, transferId);
            throw expected.reason;
          }
          rec.dstBlockIds = [...expected.value.blockIds];
        }
        const ready: Pick<SidecarEvent, "kind" | "mode"> =
          watches.length > 0
            ? await awaitTerminal(transferId, o.requestTimeoutMs)
            : { kind: "KV_READY", mode: "" };
        const readyAt = Date.now();
        rec.readyMs = performance.now();
        // One waiter for either outcome: a losing waiter would linger until its timeout.
        const ev = await d.engine.waitEvent(
          (e) => e.event === "verified" || e.event === "failed",
          o.requestTimeoutMs,
          transferId,
        );
        if (ready.kind !== "KV_READY" && ev.event === "verified") {
          failures.push(
            `${transferId}: the engine verified KV its sidecar reported as ${ready.kind}`,
          );
        }
        if (ready.kind === "KV_READY" && ready.mode !== "") {
          byMode[ready.mode] = (byMode[ready.mode] ?? 0) + 1;
          rec.mode = ready.mode;
        }
        rec.ok = ready.kind === "KV_READY" && ev.event === "verified" && ev.ok === true;
        if (ev.event === "verified") {
          latencies.push(readyAt - prefilledAt);
          checkedBytes += Number(ev.checkedBytes ?? 0);
          if (typeof ev.checkMs === "number") checkMs.push(ev.checkMs);
          computeMsAll.push(computeMs);
          if (ev.ok === true) perTransferBytes.set(transferId, (tokens - prefix) * perToken);
          bytes += (tokens - prefix) * perToken;
          prefixTokensSaved += prefix;
          prefixBytes += prefix * perToken;
          if (ev.ok !== true) {
            mismatches += Number(ev.mismatches ?? 1);
            failures.push(`${transferId}: ${String(ev.first ?? "mismatch")}`);
          }
        } else if (stopped()) {
          cut++; // Ctrl-C reached the processes too: not a failure of the transfer
        } else {
          failures.push(`${transferId}: ${String(ev.reason)} ${String(ev.message ?? "")}`);
        }
      } catch (err) {
        if (stopped()) cut++;
        else failures.push(`${transferId}: ${(err as Error).message.slice(0, 300)}`);
      }
      if (o.recordRequests === true) records.push(rec);
      done++;
      o.progress?.(done, o.requests);
    };

    await o.onStarted?.(summaries());
    let next = 0;
    const until = o.durationMs !== undefined ? Date.now() + o.durationMs : Infinity;
    let requested = o.requests;
    const worker = async (): Promise<void> => {
      while (next < requested && o.signal?.aborted !== true) {
        if (Date.now() >= until)
          requested = next; // the duration is up: start nothing more
        else await one(next++);
      }
    };
    await Promise.all(Array.from({ length: Math.min(o.concurrency, o.requests) }, worker));
    const elapsedMs = Date.now() - t0;

    // Every block must be back with its engine: P's once released, D's once verified or released.
    let leakedBlocks = 0;
    // After Ctrl-C the engines may be gone already: there is nothing left to count.
    for (const n of o.signal?.aborted === true ? [] : nodes) {
      const deadline = Date.now() + 10_000;
      let free = 0;
      let total = 0;
      for (;;) {
        const s = await n.engine.stats();
        free = s.freeBlocks;
        total = s.totalBlocks;
        if (free === total || Date.now() > deadline) break;
        await new Promise((r) => setTimeout(r, 50));
      }
      leakedBlocks += (total - free) * (n.role === "prefill" ? o.pTp : o.dTp);
    }
    await o.beforeStop?.(summaries());
    const dataPhase =
      o.hosts === undefined && o.signal?.aborted !== true
        ? await readDataPhase(nodes, perTransferBytes)
        : undefined;
    latencies.sort((a, b) => a - b);
    const verified =
      failures.length === 0 &&
      mismatches === 0 &&
      leakedBlocks === 0 &&
      latencies.length === requested &&
      o.signal?.aborted !== true &&
      checkedBytes > 0;
    return {
      verified,
      transfers: next,
      requested,
      interrupted: stopped(),
      cut,
      failed: failures.length,
      mismatches,
      bytes,
      prefixTokens: prefixTokensSaved,
      prefixBytes,
      checkedBytes,
      mode: o.mode,
      byMode,
      dispatch: o.dispatch,
      kvMemory: o.kvMemory ?? "file",
      elapsedMs,
      gbps: bytes / (elapsedMs * 1e6),
      readyLatencyMs: {
        p50: percentile(latencies, 50),
        p99: percentile(latencies, 99),
        max: latencies[latencies.length - 1] ?? 0,
      },
      leakedBlocks,
      failures: failures.slice(0, 20),
      sidecars: summaries(),
      ...(dataPhase !== undefined ? { dataPhase } : {}),
      simulation: {
        computeMsP50: percentile(
          [...computeMsAll].sort((a, b) => a - b),
          50,
        ),
        checkMsP50: percentile(
          [...checkMs].sort((a, b) => a - b),
          50,
        ),
      },
      ...(o.recordRequests === true
        ? {
            requests: records,
            layouts: { prefill: ps[0]!.engine.ready!.layout, decode: dLayout },
          }
        : {}),
    };
  } finally {
    o.signal?.removeEventListener("abort", onAbort);
    for (const w of watches) w.cancel();
    for (const c of clients) c.close();
    await Promise.all(engines.map((e) => e.close().catch(() => undefined)));
    await Promise.all(sidecars.map((s) => s.close().catch(() => undefined)));
  }
}
