/**
 * One node of the demo: a `kvxfer sidecar` process and its simulated engine,
 * started together and stopped together.
 */
import { SimEngineProcess, type SimEngineOptions } from "./engine-client.js";
import { SidecarProcess, type SidecarReady } from "./sidecar-process.js";
import type { DemoOptions } from "./demo-types.js";

/** One engine and its sidecar, both running. */
export interface Node {
  engineId: string;
  role: "prefill" | "decode";
  sidecar: SidecarProcess;
  ready: SidecarReady;
  engine: SimEngineProcess;
}

export type NodeShape = Pick<
  DemoOptions,
  | "pTp"
  | "dTp"
  | "pBlock"
  | "dBlock"
  | "layout"
  | "pScheme"
  | "dScheme"
  | "model"
  | "layers"
  | "kvHeads"
  | "kvMemory"
  | "checkAfterMs"
  | "headDim"
  | "mode"
  | "transport"
  | "hosts"
  | "sidecarArgs"
  | "peerAuth"
  | "requestTimeoutMs"
>;

/**
 * Starts one sidecar and its simulated engine. Both processes are added to
 * `track` as soon as they exist, so the caller can stop them whatever fails.
 */
export async function startNode(
  o: NodeShape,
  role: "prefill" | "decode",
  engineId: string,
  track: {
    sidecars: SidecarProcess[];
    engines: SimEngineProcess[];
    blocks: number;
    listen?: string;
    extraArgs?: string[];
  },
): Promise<Node> {
  const host = o.hosts?.[role];
  const socket = `ipc:///tmp/kvxfer-demo-${engineId}.sock`;
  const args = [
    "--engine-id",
    engineId,
    "--role",
    role,
    "--engine-socket",
    socket,
    "--listen",
    track.listen ?? `${host?.listenHost ?? "127.0.0.1"}:0`,
    "--mode",
    o.mode,
    "--transfer-timeout-ms",
    String(o.requestTimeoutMs),
    ...(o.transport === "tcp"
      ? ["--transports", "tcp,self", "--error-mode", "peer"]
      : o.transport === "default"
        ? host !== undefined
          ? ["--error-mode", "peer"]
          : []
        : ["--transports", "shm,self"]),
    ...(host?.netDevice !== undefined ? ["--net-devices", host.netDevice] : []),
    // On one host, TCP stays on loopback: UCX would otherwise also offer every other interface.
    ...(o.transport === "tcp" && host === undefined ? ["--net-devices", "lo"] : []),
    ...(o.sidecarArgs ?? []),
    ...(track.extraArgs ?? []),
    ...(o.peerAuth === false ? ["--insecure-peers", "true"] : []),
  ];
  const sidecar = new SidecarProcess(args, {
    ...(host?.prefix !== undefined ? { prefix: host.prefix } : {}),
    ...(o.peerAuth === false ? { pki: false as const } : {}),
  });
  track.sidecars.push(sidecar);
  const ready = await sidecar.ready;
  const engineOpts: SimEngineOptions = {
    engineId,
    role,
    socket,
    tp: role === "prefill" ? o.pTp : o.dTp,
    model: o.model,
    block: role === "prefill" ? o.pBlock : o.dBlock,
    blocks: track.blocks,
    layout: o.layout,
    ...((role === "prefill" ? o.pScheme : o.dScheme) !== undefined
      ? { scheme: role === "prefill" ? o.pScheme : o.dScheme }
      : {}),
    ...(o.layers !== undefined ? { layers: o.layers } : {}),
    ...(o.kvHeads !== undefined ? { kvHeads: o.kvHeads } : {}),
    ...(o.kvMemory !== undefined ? { kvMemory: o.kvMemory } : {}),
    ...(role === "decode" && o.checkAfterMs !== undefined ? { checkAfterMs: o.checkAfterMs } : {}),
    ...(o.headDim !== undefined ? { headDim: o.headDim } : {}),
  };
  const engine = await SimEngineProcess.start(
    engineOpts,
    host?.prefix !== undefined ? { prefix: host.prefix } : {},
  );
  track.engines.push(engine);
  return { engineId, role, sidecar, ready, engine };
}

/** UCX over TCP alone loads no SysV memory domain, so the sidecars could not allocate segments. */
export const TCP_NO_SEGMENTS =
  "--kv-memory segment needs --transport shm: UCX over TCP alone allocates no SysV shared-memory segment for an engine to attach";
