/**
 * The simulated engine's own error codes: what only the harness (`kvxfer sim-engine`,
 * kvxfer-sim, the vLLM command-line stand-in) emits, in its JSON lines and control replies. The
 * product's codes are in src/errors.ts (`ERROR_CODES`, docs/api.md); these are not the product's
 * and are listed in docs/testing.md ("The simulated engine's error codes").
 * test/errors-catalogue.test.ts keeps both catalogues, the sources and the two tables in step.
 */
export const SIM_ERROR_CODES = {
  ERR_BAD_PARAMS: "simulated engine behind vLLM's command line: kv_transfer_params it cannot use",
  ERR_BAD_REQUEST: "simulated engine: a control request with a missing or ill-typed field",
  ERR_BOOTSTRAP:
    "simulated engine behind vLLM's command line: P's bootstrap URL did not name its sidecar",
  ERR_EXITED: "a child process (simulated engine, benchmark peer) exited before answering",
  ERR_KV_TIMEOUT:
    "simulated engine behind vLLM's command line: no KvReady or KvFailed within --sim-kv-wait-ms",
  ERR_NO_BLOCKS:
    "simulated engine: a request needs more blocks than the cache has, or than were freed while it waited (--block-wait-ms)",
  ERR_START: "a child process (simulated engine) did not start",
  ERR_UNKNOWN_OP: "simulated engine: a control request with an unknown op",
  ERR_USAGE: "a command line that does not parse (the simulated engine's flags)",
} as const;
