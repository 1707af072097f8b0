// docs/protocol.md's state diagrams are the tables the sides run: regenerated here and compared
// (KVXFER_WRITE_DIAGRAMS=1, set by scripts/state-diagrams.mjs, writes them instead).
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";

import { describe, expect, it } from "vitest";

import { withDiagrams } from "./state-diagrams.js";

const DOC = join(import.meta.dirname, "../../docs/protocol.md");

describe("docs/protocol.md state diagrams", () => {
  it("are generated from the tables (node scripts/state-diagrams.mjs writes them)", () => {
    const doc = readFileSync(DOC, "utf8");
    const want = withDiagrams(doc);
    if (process.env.KVXFER_WRITE_DIAGRAMS === "1") writeFileSync(DOC, want);
    else expect(doc, "run: node scripts/state-diagrams.mjs").toBe(want);
  });
});
