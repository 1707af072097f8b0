// The one engine-id rule (it names files, sockets and certificates): the whole id must match,
// not a part of it.
import { describe, expect, it } from "vitest";

import { ENGINE_ID_RULE, engineIdProblem } from "../../src/engine/validate.js";

describe("engine ids", () => {
  it("accepts 1..128 characters of [A-Za-z0-9._-]", () => {
    for (const ok of ["a", "p0-16072-x", "A.b_c-9", "x".repeat(128)])
      expect(engineIdProblem(ok), ok).toBeUndefined();
  });

  it("refuses anything else anywhere in the id, naming the field and the rule", () => {
    for (const bad of ["", "x".repeat(129), "/x", "x/", "../x", "x y", " x", "x\n", "é", "a:b"])
      expect(engineIdProblem(bad, "--engine-id"), JSON.stringify(bad)).toBe(
        `--engine-id must be ${ENGINE_ID_RULE}, got '${bad.length > 64 ? bad.slice(0, 64) + "..." : bad}'`,
      );
  });
});
