/**
 * `--bootstrap HOST:PORT`: the prefill engine's coordinates for a router that sends P and D their
 * requests at once (vllm-router's `--kv-connector mooncake` mode, which asks each prefill URL's
 * bootstrap port for them at start-up).
 *
 * `GET /query` answers what vLLM's Mooncake bootstrap server answers, read from vLLM's
 * `mooncake_utils.py` (`dict[int, EngineEntry]`): data-parallel rank → `{engine_id, worker_addr}`
 * with `worker_addr` tensor-parallel rank → pipeline rank → address. A kvxfer engine has one
 * sidecar for all its ranks, so there is one entry, rank 0 → rank 0 → the sidecar's side channel.
 * The router hands D `remote_engine_id` and `remote_bootstrap_addr` (this server's URL), and D's
 * connector asks the same URL for the side channel it registers its blocks with (push).
 */
import { serveGets, type HttpServer } from "./http.js";

/** The `/query` body: one data-parallel rank, this engine, its side channel as rank 0's worker. */
export function bootstrapAnswer(engineId: string, sideChannel: string): string {
  return JSON.stringify({
    "0": { engine_id: engineId, worker_addr: { "0": { "0": sideChannel } } },
  });
}

export function startBootstrapServer(opts: {
  readonly address: string;
  readonly engineId: string;
  readonly sideChannel: string;
}): Promise<HttpServer> {
  const body = bootstrapAnswer(opts.engineId, opts.sideChannel);
  return serveGets("bootstrap", opts.address, {
    "/query": { contentType: "application/json", body: () => body },
  });
}
