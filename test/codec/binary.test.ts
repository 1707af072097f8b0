// The generated encoders (src/gen/**/*_binary.ts, scripts/protoc-gen-kvxfer-binary.mjs) write
// exactly what protobuf-es's toBinary writes, for every message of every file, over random values
// drawn from the schema (each field absent, at its zero value or at the edges of its type).
import { create, type DescField, type DescMessage, ScalarType, toBinary } from "@bufbuild/protobuf";
import { describe, expect, it } from "vitest";

import * as health from "../../src/gen/grpc/health/v1/health_pb.js";
import * as healthBinary from "../../src/gen/grpc/health/v1/health_binary.js";
import * as engine from "../../src/gen/kvxfer/v1/engine_pb.js";
import * as engineBinary from "../../src/gen/kvxfer/v1/engine_binary.js";
import * as layout from "../../src/gen/kvxfer/v1/layout_pb.js";
import * as layoutBinary from "../../src/gen/kvxfer/v1/layout_binary.js";
import * as peer from "../../src/gen/kvxfer/v1/peer_pb.js";
import * as peerBinary from "../../src/gen/kvxfer/v1/peer_binary.js";
import * as sidecar from "../../src/gen/kvxfer/v1/sidecar_pb.js";
import * as sidecarBinary from "../../src/gen/kvxfer/v1/sidecar_binary.js";

// A fixed sequence (a linear congruential generator), so a failure can be run again.
let seed = 4242;
const next = (): number => (seed = (seed * 1103515245 + 12345) % 2 ** 31);
const pick = <T>(xs: readonly T[]): T => xs[next() % xs.length]!;

const STRINGS = ["", "a", "req-00012-abcdef", "ü-Ω-😀", "x".repeat(200)];
const U32 = [0, 1, 127, 128, 16_384, 2 ** 31, 0xffff_ffff];
const I32 = [0, 1, -1, 2 ** 31 - 1, -(2 ** 31)];
const U64 = [0n, 1n, 127n, 128n, 2n ** 32n, 2n ** 53n + 1n, 2n ** 64n - 1n];
const I64 = [0n, 1n, -1n, 2n ** 63n - 1n, -(2n ** 63n)];

function scalar(t: ScalarType): unknown {
  switch (t) {
    case ScalarType.STRING:
      return pick(STRINGS);
    case ScalarType.BYTES:
      return Uint8Array.from({ length: pick([0, 1, 32, 300]) }, () => next() % 256);
    case ScalarType.BOOL:
      return pick([true, false]);
    case ScalarType.UINT32:
    case ScalarType.FIXED32:
      return pick(U32);
    case ScalarType.INT32:
    case ScalarType.SINT32:
    case ScalarType.SFIXED32:
      return pick(I32);
    case ScalarType.UINT64:
    case ScalarType.FIXED64:
      return pick(U64);
    case ScalarType.INT64:
    case ScalarType.SINT64:
    case ScalarType.SFIXED64:
      return pick(I64);
    default:
      return pick([0, -0, 1.5, -2.25, 1e300]);
  }
}

function value(field: DescField, depth: number): unknown {
  switch (field.fieldKind) {
    case "scalar":
      return scalar(field.scalar);
    case "enum":
      return pick(field.enum.values).number;
    case "message":
      return randomInit(field.message, depth + 1);
    case "list":
      return Array.from({ length: pick([0, 1, 3]) }, () =>
        field.listKind === "message"
          ? randomInit(field.message, depth + 1)
          : field.listKind === "enum"
            ? pick(field.enum.values).number
            : scalar(field.scalar),
      );
    case "map":
      return next() % 2 === 0
        ? {}
        : { [pick(["a", "b"])]: field.mapKind === "scalar" ? scalar(field.scalar) : undefined };
  }
}

/** An init shape with each field absent (half the time) or set; one member of each oneof. */
function randomInit(desc: DescMessage, depth = 0): Record<string, unknown> {
  const out: Record<string, unknown> = {};
  if (depth > 3) return out;
  for (const field of desc.fields) {
    if (field.oneof !== undefined || next() % 2 === 0) continue;
    out[field.localName] = value(field, depth);
  }
  for (const oneof of desc.oneofs) {
    if (next() % 3 === 0) continue;
    const field = pick(oneof.fields);
    out[oneof.localName] = { case: field.localName, value: value(field, depth) };
  }
  return out;
}

const FILES = [
  [health, healthBinary],
  [layout, layoutBinary],
  [engine, engineBinary],
  [peer, peerBinary],
  [sidecar, sidecarBinary],
] as const;

describe("generated encoders", () => {
  it("one per message of every file, each writing what toBinary writes over random values", () => {
    let messages = 0;
    for (const [pb, bin] of FILES) {
      for (const [name, desc] of Object.entries(pb)) {
        if (!name.endsWith("Schema") || (desc as { kind?: unknown }).kind !== "message") continue;
        const local = name.slice(0, -"Schema".length);
        const encode = (bin as Record<string, unknown>)[
          `${local.charAt(0).toLowerCase()}${local.slice(1)}ToBinary`
        ] as ((m: unknown) => Uint8Array) | undefined;
        expect(encode, `${name}: no generated encoder`).toBeTypeOf("function");
        messages++;
        const schema = desc as DescMessage;
        for (let i = 0; i < 200; i++) {
          const init = randomInit(schema);
          const generic = toBinary(schema, create(schema, init));
          expect(Buffer.from(encode!(init)).toString("hex"), `${schema.typeName} #${i}`).toBe(
            Buffer.from(generic).toString("hex"),
          );
          // A whole message (create's output) is an init too.
          expect(Buffer.from(encode!(create(schema, init))).toString("hex")).toBe(
            Buffer.from(generic).toString("hex"),
          );
        }
      }
    }
    expect(messages).toBeGreaterThan(40);
  });

  it("a value the writer refuses goes to protobuf-es, whose error names the field", () => {
    expect(() => peerBinary.xferDoneToBinary({ transferId: "t", sincePrefillDoneMs: 0.5 })).toThrow(
      /since_prefill_done_ms/,
    );
    expect(() => peerBinary.peerMessageToBinary({ senderEpoch: -1n })).toThrow(/sender_epoch/);
  });
});
