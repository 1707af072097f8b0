// How `kvxfer bench vllm` prints its rows: the failure rows of `--faults` (what the client saw,
// whether D's output is one engine's, where D's prompt came from, when P's blocks came back, whether
// the surviving engine still serves), each cell's failed transfers, and D's side in the main table.
// Formatting only: the bench itself runs in connectors/vllm (kvxfer_vllm_testing.bench); no engine
// starts here.
import { describe, expect, it } from "vitest";

import {
  formatKvFailures,
  formatVllm,
  formatVllmFaults,
  linkChart,
  settingsLine,
  type VllmBenchResult,
  type VllmFaultRow,
  type VllmRow,
} from "../../bench/vllm.js";

const row = (over: Partial<VllmFaultRow>): VllmFaultRow => ({
  system: "kvxfer-pull",
  label: "kvxfer pull",
  fault: "P's engine killed after answering",
  tokens: 32,
  client: "answered",
  identical: true,
  e2e_ms: 812.4,
  next_request_identical: true,
  ...over,
});

describe("formatVllmFaults", () => {
  it("names where D's prompt came from, and a block return that did not happen", () => {
    const out = formatVllmFaults(
      [
        row({ d_prompt_tokens: { external_kv_transfer: 32, local_compute: 0 } }),
        row({
          system: "nixl-fixed",
          label: "NixlConnector, 2 fixes",
          fault: "D's engine killed mid-load",
          client: "1/8 answered; error: connection refused",
          identical: false,
          p_kv_usage_zero_after_s: null,
          next_request_identical: "error: P gone",
        }),
        row({ identical: null, client: "error: HTTP 500", p_kv_usage_zero_after_s: 2.25 }),
      ],
      true,
    );
    const lines = out.split("\n");
    expect(lines[0]).toContain("D's prompt");
    expect(lines[2]).toContain("moved 32, computed 0");
    expect(lines[2]).toContain("one engine's");
    expect(lines[2]).toContain("812");
    expect(lines[3]).toContain("DIFFERENT");
    expect(lines[3]).toContain("not within 60 s");
    expect(lines[3]).toContain("error: P gone");
    expect(lines[4]).toContain("2.3 s");
    expect(lines[4]).toMatch(/\| - \|/);
  });
});

describe("formatKvFailures", () => {
  const cell = (over: Partial<VllmRow>): VllmRow => ({
    system: "kvxfer-pull",
    label: "kvxfer pull",
    tokens: 4096,
    concurrency: 8,
    status: "ok",
    requests: 16,
    ttft_ms: { p50: 1, p90: 2, n: 16 },
    e2e_ms: { p50: 1, p90: 2, n: 16 },
    output_tokens_per_s: 1,
    cpu_s_per_request: null,
    correct: { identical: 16, compared: 16 },
    errors: [],
    error_count: 0,
    ...over,
  });

  it("names each cell's failed transfers by side, state and reason, and nothing for a clean cell", () => {
    const lines = formatKvFailures([
      cell({ kv_failures: { "D failed: ERR_TIMEOUT: no readAck within 5000 ms": 1 } }),
      cell({ tokens: 32, kv_failures: null }),
      cell({ system: "nixl-fixed", label: "NixlConnector, 2 fixes" }),
    ]);
    expect(lines).toEqual([
      "  kvxfer pull, 4096 tokens, 8 in flight: 1 x D failed: ERR_TIMEOUT: no readAck within 5000 ms",
    ]);
  });

  it("prints D's side (P's answer to D's first token) where a row has one, '-' where not", () => {
    const result = {
      rows: [
        cell({ d_side_ms: { p50: 21.4, p90: 30.2, n: 16 } }),
        cell({ system: "one", label: "one engine", d_side_ms: { p50: null, p90: null, n: 0 } }),
        cell({ system: "nixl-fixed", label: "NixlConnector, 2 fixes" }), // a result from before it
      ],
    } as unknown as Parameters<typeof formatVllm>[0];
    const lines = formatVllm(result, true).split("\n");
    expect(lines[0]).toContain("| D side p50 / p90 ms |");
    expect(lines[2]!.split("|")[7]!.trim()).toBe("21 / 30");
    expect(lines[3]!.split("|")[7]!.trim()).toBe("-");
    expect(lines[4]!.split("|")[7]!.trim()).toBe("-");
  });

  it("prints TTFT's 95% intervals, '?' for an end the samples cannot bound, '-' for results from before them", () => {
    const result = {
      rows: [
        cell({ ttft_ms: { p50: 400, p90: 520, n: 15, p50_ci: [380.4, 450], p90_ci: [470, null] } }),
        cell({ system: "nixl-fixed", label: "NixlConnector, 2 fixes" }),
      ],
    } as unknown as Parameters<typeof formatVllm>[0];
    const lines = formatVllm(result, true).split("\n");
    expect(lines[0]).toContain("| TTFT p50 / p90 ms | vs kvxfer pull | 95% intervals |");
    expect(lines[2]!.split("|")[6]!.trim()).toBe("380-450 / 470-?");
    expect(lines[3]!.split("|")[6]!.trim()).toBe("-");
  });
});

describe("settingsLine", () => {
  it("names pinning, the CPU hog and kvxfer's settings; a result from before them reads as the defaults then", () => {
    const base = { engine: { pinned: "the model threads only" } };
    expect(
      settingsLine({
        ...base,
        load: { hogs: 2, nice: 0, what: "2 x a Python busy loop at nice 0" },
        kvxfer: { prefault: false, placement: "shared", kv_memory: "file", idle_wait_s: 0 },
      } as unknown as VllmBenchResult),
    ).toBe(
      "engines: the model threads only pinned; load: 2 x a Python busy loop at nice 0; " +
        "kvxfer: prefault false, placement shared, KV memory file, idle wait 0 s",
    );
    expect(
      settingsLine({
        ...base,
        kvxfer: { placement: "shared", kv_memory: "file" },
      } as unknown as VllmBenchResult),
    ).toBe(
      "engines: the model threads only pinned; load: none; " +
        "kvxfer: prefault true, placement shared, KV memory file, idle wait the connector's default",
    );
    expect(
      settingsLine({
        ...base,
        kvxfer: { placement: "shared", kv_memory: "file", worker_rest_s: 0 },
      } as unknown as VllmBenchResult),
    ).toContain("idle wait the connector's default, worker rest 0 s");
    expect(
      settingsLine({
        ...base,
        link: { mbit: 1000, what: "two namespaces, tbf 1000 Mbit/s each way" },
        model: {
          layers: 32,
          kv_heads: 8,
          head_dim: 64,
          dtype: "bfloat16",
          kv_bytes_per_token: 65536,
        },
        kvxfer: { placement: "shared", kv_memory: "file" },
      } as unknown as VllmBenchResult),
    ).toContain(
      "load: none; link: two namespaces, tbf 1000 Mbit/s each way; model: 32 layers, 64 KiB of KV per token; kvxfer:",
    );
  });
});

describe("--link: each cell's reference and the link's chart", () => {
  const cell = (system: string, label: string, link: number, p50: number): VllmRow =>
    ({
      system,
      label,
      tokens: 1024,
      concurrency: 1,
      status: "ok",
      requests: 8,
      ttft_ms: { p50, p90: p50, n: 8 },
      e2e_ms: { p50, p90: p50, n: 8 },
      output_tokens_per_s: 1,
      cpu_s_per_request: { total: 1 },
      correct: { identical: 8, compared: 8 },
      link_mbit: link,
      errors: [],
      error_count: 0,
    }) as VllmRow;
  const r = {
    vllm: "0.32.0",
    machine: "2 cores",
    engine: {},
    link: { mbits: [1000, 0], what: "two namespaces" },
    rows: [
      cell("one", "one engine, 1000 Mbit/s", 1000, 150),
      cell("one", "one engine, uncapped", 0, 150),
      cell("kvxfer-pull", "kvxfer pull, 1000 Mbit/s", 1000, 250),
      cell("kvxfer-pull", "kvxfer pull, uncapped", 0, 200),
      cell("kvxfer-layerwise", "kvxfer push, layer-wise, 1000 Mbit/s", 1000, 180),
      cell("kvxfer-layerwise", "kvxfer push, layer-wise, uncapped", 0, 180),
    ],
  } as unknown as VllmBenchResult;

  it("ratios are to kvxfer pull over the same link", () => {
    const lines = formatVllm(r).split("\n");
    const lw = (link: string) => lines.find((l) => l.includes(`layer-wise, ${link}`))!;
    expect(lw("1000 Mbit/s")).toContain("0.72"); // 180 / 250
    expect(lw("uncapped")).toContain("0.90"); // 180 / 200
  });

  it("the chart: every system over the capped link, one engine once, the uncapped pushes beside", () => {
    const svg = linkChart(r, 1000);
    expect(svg).toContain("P and D over a 1 Gbit/s link");
    for (const name of [
      "one engine",
      "kvxfer pull, 1 Gb/s",
      "kvxfer layer-wise, 1 Gb/s",
      "kvxfer layer-wise, no cap",
    ])
      expect(svg).toContain(`>${name}<`);
    expect(svg).not.toContain("kvxfer pull, no cap");
    expect(svg.match(/>one engine</g)).toHaveLength(1);
  });
});
