// The engine link's bytes (protobuf-es both ways) are what the Python connector's generated code
// (kvxfer_vllm._gen) writes and reads, and what the previous release wrote.
import { fromBinary, toBinary } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import { sidecarMessage } from "../../src/engine/link.js";
import { EngineToSidecarSchema, SidecarToEngineSchema } from "../../src/gen/kvxfer/v1/engine_pb.js";
import { encodeEventResponse, eventToProto } from "../../src/api/convert.js";
import { WatchEventsResponseSchema } from "../../src/gen/kvxfer/v1/sidecar_pb.js";
import { GOLDEN } from "../peer/golden.js";

const hex = (b: Uint8Array): string => Buffer.from(b).toString("hex");

describe("engine link and event bytes", () => {
  it("KvReady as the previous release wrote it", () => {
    const msg = sidecarMessage("kvReady", {
      $typeName: "kvxfer.v1.KvReady",
      transferId: "req-4",
      bytes: 0n,
    });
    expect(hex(toBinary(SidecarToEngineSchema, msg))).toBe(GOLDEN.kvReady);
  });

  it("reads the PrefillDone the Python connector writes", () => {
    const m = fromBinary(EngineToSidecarSchema, Buffer.from(GOLDEN.prefillDoneFromPython, "hex"));
    expect(m.msg).toMatchObject({
      case: "prefillDone",
      value: { transferId: "req-6", blockIds: [3, 1, 300], numTokens: 40, token: "tk" },
    });
  });

  it("a KV_READY event as the previous release wrote it, read back the same", () => {
    const ev = {
      seq: 9,
      kind: "KV_READY" as const,
      timeMs: 1700000000000,
      transferId: "req-5",
      peer: "p-engine",
      side: "decode" as const,
      reason: "",
      bytes: 2097152,
      mode: "push" as const,
    };
    const bytes = encodeEventResponse(eventToProto(ev));
    expect(hex(bytes)).toBe(GOLDEN.event);
    const back = fromBinary(WatchEventsResponseSchema, bytes);
    expect(back.msg.case).toBe("event");
  });
});
