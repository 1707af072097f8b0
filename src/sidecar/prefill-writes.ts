/**
 * P's writes of a push, the I/O behind the START_WRITES effect: plan the pairs, post each pair's
 * writes with its XferDone sealed behind them, wait for all to settle. The result is the event
 * PrefillSide feeds P's machine next.
 */
import type { Agent, Endpoint, OpTrace, WritePart } from "../native/index.js";
import { KvxferError } from "../errors.js";
import { layerSpans, planGroups, splitByLayer, type TransferPlan } from "../plan/index.js";
import { transferError, type SideContext } from "./context.js";
import { layersPending, type LayerProgress, type PrefillTransfer } from "./prefill-transfer.js";
import { settleAbandoned } from "./settle.js";
import { markPairSteps } from "./trace.js";

/** How the writes ended: all landed, or one failed. */
export type WriteResult =
  { event: "WRITES_DONE"; bytes: number } | { event: "WRITES_FAILED"; error: KvxferError };

/** The pairs P writes for `t`, or why it cannot (the KV broke, D expects other tokens, no plan). */
export function planPush(ctx: SideContext, t: PrefillTransfer): TransferPlan | KvxferError {
  const kv = ctx.kvs.kv!;
  const reg = t.reg!;
  const peer = reg.peer;
  try {
    // A KV file that shrank would fault (SIGBUS) when the writes read it.
    const shrunk = kv.shrunk?.();
    if (shrunk !== undefined) throw new KvxferError("ERR_REGION_CHANGED", shrunk);
    if (reg.numTokens !== t.numTokens) {
      throw new KvxferError(
        "ERR_BAD_TOKENS",
        `D expects ${reg.numTokens} tokens, P prefilled ${t.numTokens}`,
      );
    }
    return planGroups(peer.pairing(kv.groups, peer.groups), {
      numTokens: t.numTokens,
      prefixTokens: reg.prefixTokens,
      src: t.lists!,
      dst: reg.dstLists,
    });
  } catch (err) {
    const e = transferError(err);
    ctx.errors.note(`push of '${t.id}' refused: ${e.code}: ${e.message}`);
    return e;
  }
}

/** P writes every rank pair's KV into D's blocks, each pair followed by its XferDone. */
export async function postWrites(
  ctx: SideContext,
  t: PrefillTransfer,
  plan: TransferPlan,
): Promise<WriteResult> {
  const kv = ctx.kvs.kv!;
  const peer = t.reg!.peer;
  t.trace.mark("planned");
  const plannedAt = performance.now();
  // A registration whose lease ran out must not be written to: D may have released the blocks.
  const used: Endpoint[] = [];
  // Layer-wise, while layers are still coming: where each layer lies in P's regions (one group).
  const layers = layersPending(t) ? t.layers : undefined;
  const layersOf = layers && layerSpans(kv.groups[0]!.layout);
  const results = await Promise.allSettled(
    plan.pairs.map(async (pair) => {
      const agent = kv.agents[pair.srcRank]!;
      const ep = peer.endpoint(pair.srcRank, pair.dstRank);
      used.push(ep);
      const parts: WritePart[] = [];
      /** Layer-wise push: each part's layer (-1: it waits for the last layer). */
      const partLayers: number[] = [];
      for (const rp of pair.regionPairs) {
        if (rp.count === 0) continue;
        const local = kv.regions[pair.srcRank]![rp.srcRegion]!;
        const remote = peer.remote(pair.srcRank, pair.dstRank, rp.dstRegion);
        const spans = layersOf?.[rp.srcRegion];
        const byLayer = spans && splitByLayer(rp.descriptors, rp.count, spans);
        if (byLayer === undefined) {
          parts.push({ local, remote, descriptors: rp.descriptors });
          partLayers.push(-1);
        } else
          for (const l of byLayer) {
            parts.push({ local, remote, descriptors: l.descriptors });
            partLayers.push(l.layer);
          }
      }
      const mayWrite = (): void => {
        if (ctx.clock.now() > t.regDeadline || t.state !== "WRITING" || peer.state !== "connected")
          throw new KvxferError(
            "ERR_ABORTED",
            "registration expired, aborted, or peer down before the write",
          );
      };
      mayWrite();
      // One native operation for all of the pair's region pairs and its XferDone: one hand-off
      // to the progress thread and one flush, whatever the number of layers; the addon sends the
      // XferDone once every write is remotely complete, and not at all if one fails. So it is
      // sealed before the writes: its time since PrefillDone is to their posting. Layer-wise,
      // while layers are still coming: one operation per batch of saved layers, then the
      // XferDone's own (writeLayers).
      const xferDone = ctx.peers.seal(peer, {
        case: "xferDone",
        value: {
          transferId: t.id,
          srcRank: pair.srcRank,
          dstRank: pair.dstRank,
          bytes: BigInt(pair.bytes),
          sincePrefillDoneMs: Math.max(0, ctx.clock.now() - t.t.prefillDoneMs),
        },
      });
      const written = layers
        ? await writeLayers(ctx, t, layers, agent, ep, parts, partLayers, xferDone, mayWrite)
        : [await agent.writeParts(ep, parts, xferDone)];
      markPairSteps(t.trace, `${pair.srcRank}>${pair.dstRank}`, written);
    }),
  );
  t.t.dataDoneMs = ctx.clock.now();
  t.bytes = plan.bytes;
  t.descriptors = plan.descriptorCount;
  ctx.log.debug(
    {
      transferId: t.id,
      bytes: plan.bytes,
      descriptors: plan.descriptorCount,
      ms: t.t.dataDoneMs - t.t.dataStartedMs,
      moveMs: Math.round((performance.now() - plannedAt) * 100) / 100,
    },
    "push writes settled",
  );
  const failed = results.find((r) => r.status === "rejected");
  if (failed === undefined) {
    return { event: "WRITES_DONE", bytes: plan.bytes };
  }
  // An abandoned write (D went silent) is not cancelled in UCX: over TCP its bytes wait in the
  // old connection and land in D's blocks when the link heals. WRITES_FAILED (and with it an
  // AbortAck, which D takes as "nothing more will land") waits until UCX holds none of them.
  await settleAbandoned(ctx, t.id, peer.engineId, used);
  const e = KvxferError.from((failed as PromiseRejectedResult).reason);
  return { event: "WRITES_FAILED", error: e };
}

/**
 * Layer-wise push, one rank pair: each part is posted once its layer is saved (every part at
 * once when its region holds several layers: it waits for the last), layers saved together in
 * one operation; the XferDone goes after every write is remotely complete, and not at all if one
 * failed. A wait for layers ends when more are saved, when the transfer stops writing, or after
 * the block lease (an engine that stops sending LayersSaved does not hold D's blocks forever).
 * Whatever was posted has settled before this returns or throws.
 */
async function writeLayers(
  ctx: SideContext,
  t: PrefillTransfer,
  layers: LayerProgress,
  agent: Agent,
  ep: Endpoint,
  parts: readonly WritePart[],
  partLayers: readonly number[],
  xferDone: Uint8Array,
  mayWrite: () => void,
): Promise<OpTrace[]> {
  const posted: Promise<OpTrace>[] = [];
  const sent = new Array<boolean>(parts.length).fill(false);
  let left = parts.length;
  const waitUntil = performance.now() + ctx.settings.leaseMs;
  let failure: unknown;
  try {
    for (;;) {
      const saved = layers.saved;
      const batch: WritePart[] = [];
      for (let i = 0; i < parts.length; i++) {
        if (sent[i]) continue;
        const layer = partLayers[i]!;
        if (saved >= layers.total || (layer >= 0 && layer < saved)) {
          sent[i] = true;
          left--;
          batch.push(parts[i]!);
        }
      }
      if (batch.length > 0) {
        mayWrite();
        const op = agent.writeParts(ep, batch);
        op.catch(() => undefined); // settled below
        posted.push(op);
      }
      if (left === 0) break;
      const wait = waitUntil - performance.now();
      if (wait <= 0)
        throw new KvxferError(
          "ERR_TIMEOUT",
          `layers ${layers.saved}..${layers.total - 1} of '${t.id}' not saved within the block lease`,
        );
      await new Promise<void>((wake) => {
        const timer = setTimeout(wake, wait);
        layers.waiters.push(() => {
          clearTimeout(timer);
          wake();
        });
      });
      mayWrite();
    }
  } catch (err) {
    failure = err;
  }
  const settled = await Promise.allSettled(posted);
  const bad = settled.find((r) => r.status === "rejected");
  if (failure !== undefined) throw failure;
  if (bad !== undefined) throw (bad as PromiseRejectedResult).reason;
  const traces = settled.map((r) => (r as PromiseFulfilledResult<OpTrace>).value);
  // Nothing outstanding: the XferDone's own operation flushes nothing and sends it.
  traces.push(await agent.writeParts(ep, [], xferDone));
  return traces;
}
