// The TypeScript side of the cross-language wire test: reads JSON lines on stdin and answers one
// line each, using the same generated code (dist/src/gen) the sidecar uses.
//   {"decode": "EngineToSidecar", "hex": "..."}  -> {"json": <proto3 JSON>}
//   {"encode": "SidecarToEngine", "json": {...}} -> {"hex": "..."}
import { createInterface } from "node:readline";
import { fromBinary, fromJson, toBinary, toJson } from "@bufbuild/protobuf";
import * as engine from "../../../dist/src/gen/kvxfer/v1/engine_pb.js";

const schemas = {
  EngineToSidecar: engine.EngineToSidecarSchema,
  SidecarToEngine: engine.SidecarToEngineSchema,
};
for await (const line of createInterface({ input: process.stdin })) {
  const req = JSON.parse(line);
  let out;
  try {
    if (req.decode) {
      const msg = fromBinary(schemas[req.decode], Buffer.from(req.hex, "hex"));
      out = { json: toJson(schemas[req.decode], msg) };
    } else {
      const msg = fromJson(schemas[req.encode], req.json);
      out = { hex: Buffer.from(toBinary(schemas[req.encode], msg)).toString("hex") };
    }
  } catch (err) {
    out = { error: String(err) };
  }
  process.stdout.write(JSON.stringify(out) + "\n");
}
