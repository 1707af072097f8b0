// After each test file: the certificate authorities its worker made (sim/pki.ts) are removed.
// Their exit hook does not run when the runner ends a worker with a signal, and each such
// worker used to leave a /tmp/kvxfer-pki-* folder behind.
import { afterAll } from "vitest";

import { closeAllPkis } from "../../sim/pki.js";

afterAll(() => closeAllPkis());
