// How `kvxfer bench vllm --faults` prints its failure rows: what the client saw, whether D's output
// is one engine's, where D's prompt came from (moved KV or recomputed), when P's blocks came back
// and whether the surviving engine still serves. Formatting only: the faults themselves run in
// connectors/vllm (kvxfer_vllm_testing.bench); no engine starts here.
import { describe, expect, it } from "vitest";

import { formatVllmFaults, type VllmFaultRow } from "../../bench/vllm.js";

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
