// One kvxfer agent for the GPU device check (bench/gpu/harness.py drives it): JSON lines in on
// stdin, one JSON line out per request. It imports only the addon's typed face
// (dist/src/native/index.js, from the carried tree on the device: KVXFER_NATIVE), so it runs
// with nothing but a Node binary, the addon and UCX's libraries.
//
// Requests ({ op, ... } -> reply, or { error, code }):
//   info                                  -> { ucx, transports, memoryTypes }
//   open { id, handle, device, offset, length }  CUDA IPC handle (hex) -> cuda region `id`
//   alloc { id, length, device }          allocateCuda -> region `id`
//   map { id, path, length }              a host file (the dry run) -> region `id`
//   address                               -> { address } (hex)
//   rkey { id }                           -> { key } (hex)
//   connect { address }; import { id, key }
//   bench { kind, local, remote, size, iters, window }
//        -> { seconds }: `iters` WRITEs (or READs) of one `size`-byte descriptor, `window` in flight
//   xfer { kind, local, remote, descs, repeat }
//        -> { seconds: [...] }: one transfer of many descriptors (base64 float64 triples), `repeat` times
//   close
import { readFileSync } from "node:fs";
import { createInterface } from "node:readline";
import { performance } from "node:perf_hooks";
import { pathToFileURL } from "node:url";

const nativePath =
  process.env.KVXFER_NATIVE ?? new URL("../../dist/src/native/index.js", import.meta.url).pathname;
const { Agent, ucxInfo } = await import(pathToFileURL(nativePath).href);

const agent = new Agent({
  name: process.env.KVXFER_AGENT_NAME ?? "gpu-check",
  transports: process.env.KVXFER_TLS ?? "",
});
const regions = new Map();
const remotes = new Map();
let ep;

const hex = (b) => Buffer.from(b).toString("hex");
const bytes = (h) => Buffer.from(h, "hex");

async function bench({ kind, local, remote, size, iters, window }) {
  const l = regions.get(local);
  const r = remotes.get(remote);
  const descs = new Float64Array([0, 0, size]);
  const one = () => (kind === "write" ? agent.write(ep, l, r, descs) : agent.read(ep, l, r, descs));
  await one(); // warm: first-touch mappings and protocol selection out of the timing
  const t0 = performance.now();
  let posted = 0;
  await new Promise((resolve, reject) => {
    let done = 0;
    const post = () => {
      while (posted < iters && posted - done < window) {
        posted++;
        one().then(() => {
          done++;
          if (done === iters) resolve();
          else post();
        }, reject);
      }
    };
    post();
  });
  return { seconds: (performance.now() - t0) / 1000 };
}

async function xfer({ kind, local, remote, descs, repeat }) {
  const l = regions.get(local);
  const r = remotes.get(remote);
  const raw = Buffer.from(descs, "base64");
  const d = new Float64Array(raw.buffer.slice(raw.byteOffset, raw.byteOffset + raw.byteLength));
  const seconds = [];
  for (let i = 0; i < (repeat ?? 1); i++) {
    const t0 = performance.now();
    await (kind === "write" ? agent.write(ep, l, r, d) : agent.read(ep, l, r, d));
    seconds.push((performance.now() - t0) / 1000);
  }
  return { seconds, descriptors: d.length / 3 };
}

async function handle(m) {
  switch (m.op) {
    case "info": {
      const u = ucxInfo();
      // Which files this process really runs: the carried ones, on the device and in the dry run.
      const maps = readFileSync("/proc/self/maps", "utf8").split("\n");
      const loaded = (name) =>
        maps
          .find((l) => l.includes(name))
          ?.split(/\s+/)
          .pop() ?? null;
      return {
        ucx: u.version,
        transports: agent.transports,
        memoryTypes: agent.memoryTypes,
        ucxMemoryTypes: u.memoryTypes,
        addon: loaded("kvxfer.node"),
        libucp: loaded("libucp.so"),
        node: process.execPath,
      };
    }
    case "open":
      regions.set(
        m.id,
        agent.openCudaIpc(bytes(m.handle), {
          device: m.device,
          offset: m.offset,
          length: m.length,
        }),
      );
      return { memoryType: regions.get(m.id).memoryType };
    case "alloc":
      regions.set(m.id, agent.allocateCuda(m.length, { device: m.device }));
      return { memoryType: regions.get(m.id).memoryType };
    case "map":
      regions.set(m.id, agent.mapFile(m.path, { length: m.length }));
      return { memoryType: regions.get(m.id).memoryType };
    case "address":
      return { address: hex(agent.address) };
    case "rkey":
      return { key: hex(regions.get(m.id).remoteKey()) };
    case "connect":
      ep = agent.connect(bytes(m.address));
      return {};
    case "import":
      remotes.set(m.id, ep.importRemote(bytes(m.key)));
      return {};
    case "bench":
      return bench(m);
    case "xfer":
      return xfer(m);
    case "close":
      agent.close();
      return {};
    default:
      throw Object.assign(new Error(`unknown op ${m.op}`), { code: "ERR_INVALID_ARGUMENT" });
  }
}

const rl = createInterface({ input: process.stdin });
for await (const line of rl) {
  if (!line.trim()) continue;
  let reply;
  try {
    reply = await handle(JSON.parse(line));
  } catch (err) {
    reply = { error: String(err?.message ?? err), code: err?.code ?? "ERR_INTERNAL" };
  }
  process.stdout.write(JSON.stringify(reply) + "\n");
}
if (!agent.closed) agent.close();
